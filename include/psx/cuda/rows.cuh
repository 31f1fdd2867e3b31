//! @file psx/cuda/rows.cuh
//! Sparse rows on the device: `gather_rows` answers a pull of rows by id,
//! and `RowDedup` turns a push of (id, gradient row) pairs with repeated ids
//! into unique ids, ascending, each with the sum of its gradient rows in the
//! order they were pushed: the same floats a sequential CPU sum gives
//! (`RowAccumulator` in `psx/server.hpp`), on every run.
//!
//! @code
//! psx::cuda::RowDedup dedup;                       // keep it: it reuses its memory
//! std::size_t u = dedup.run(ids, grads, n, width, stream);
//! psx::cuda::update_rows(adam, table, slots, width, dedup.unique_ids(), dedup.sums(), u, ctx, stream);
//! @endcode
#pragma once

#include <psx/cuda/detail/launch.cuh>
#include <psx/cuda/memory.cuh>
#include <psx/errors.hpp>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>
#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

namespace psx {
inline namespace v0 {
namespace cuda {

namespace detail {

template <int V>
struct FloatVec;
template <>
struct FloatVec<1> {
  using type = float;
  __device__ static float add(float a, float b) { return fp::add(a, b); }
};
template <>
struct FloatVec<4> {
  using type = float4;
  __device__ static float4 add(const float4& a, const float4& b) {
    return make_float4(fp::add(a.x, b.x), fp::add(a.y, b.y), fp::add(a.z, b.z), fp::add(a.w, b.w));
  }
};

// out[k, :] = table[ids[k], :]; V floats at a time (V = 4 needs width % 4 == 0 and aligned rows).
template <int V>
__global__ void __launch_bounds__(block_threads)
    gather_rows_kernel(const float* __restrict__ table, std::size_t width, const std::uint64_t* __restrict__ ids,
                       std::size_t n, float* __restrict__ out) {
  using T = typename FloatVec<V>::type;
  const std::size_t cols = width / V, total = n * cols;
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t t = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; t < total; t += stride) {
    const std::size_t k = t / cols, c = t % cols;
    reinterpret_cast<T*>(out + k * width)[c] =
        reinterpret_cast<const T*>(table + static_cast<std::size_t>(ids[k]) * width)[c];
  }
}

template <class = void>
__global__ void iota_kernel(std::uint32_t* out, std::size_t n) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = static_cast<std::uint32_t>(i);
}

// Ids with more rows than this go to the block-wide kernel below; the others
// are folded by one thread per (id, column group), 8 rows in flight.
inline constexpr std::uint32_t dedup_light_max_rows = 32;
// The block-wide kernel stages rows in shared memory, 32 KiB a stage, with
// cp.async, up to 4 stages; it takes rows of at most 4096 floats, and reads
// the rows' positions 1024 at a time.
inline constexpr std::size_t dedup_stage_floats = 8192;
inline constexpr int dedup_max_stages = 4;
inline constexpr std::size_t dedup_max_width = 4096;
inline constexpr unsigned dedup_window_rows = 1024;
inline constexpr std::size_t dedup_window_bytes = 2 * dedup_window_rows * sizeof(std::uint32_t);

// One thread per (unique id, V columns): the id's rows, in push order.
// Ids with more than `light_max` rows are listed in `heavy` instead.
template <int V>
__global__ void __launch_bounds__(block_threads)
    dedup_light_kernel(const std::uint32_t* __restrict__ counts, const std::uint32_t* __restrict__ offsets,
                       const std::uint32_t* __restrict__ pos, const float* __restrict__ grads, std::size_t width,
                       std::size_t unique, float* __restrict__ out, std::uint32_t light_max,
                       std::uint32_t* __restrict__ heavy, int* __restrict__ num_heavy) {
  using Vec = FloatVec<V>;
  using T = typename Vec::type;
  const std::size_t cols = width / V, total = unique * cols;
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t t = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; t < total; t += stride) {
    const std::size_t k = t / cols, c = t % cols;
    const std::uint32_t count = counts[k];
    if (count > light_max) {
      if (c == 0) heavy[atomicAdd(num_heavy, 1)] = static_cast<std::uint32_t>(k);
      continue;
    }
    const std::uint32_t* p = pos + offsets[k];
    auto row = [&](std::uint32_t r) { return reinterpret_cast<const T*>(grads + std::size_t{p[r]} * width)[c]; };
    T acc = row(0);
    std::uint32_t r = 1;
    for (; r + 8 <= count; r += 8) {
      T x[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = row(r + j);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc = Vec::add(acc, x[j]);
    }
    for (; r < count; ++r) acc = Vec::add(acc, row(r));
    reinterpret_cast<T*>(out + k * width)[c] = acc;
  }
}

// One block per heavy id: the block copies chunks of the id's rows into a
// ring of shared-memory stages (cp.async), `stages - 1` chunks ahead, while
// the threads fold the landed chunk, V columns each, in push order, into
// registers. The rows' positions come into shared memory a window of 1024 at
// a time (two windows, so copies in flight keep theirs).
template <int V>
__global__ void __launch_bounds__(block_threads)
    dedup_heavy_kernel(const std::uint32_t* __restrict__ heavy, const int* __restrict__ num_heavy,
                       const std::uint32_t* __restrict__ counts, const std::uint32_t* __restrict__ offsets,
                       const std::uint32_t* __restrict__ pos, const float* __restrict__ grads, std::size_t width,
                       float* __restrict__ out, int stages) {
  using Vec = FloatVec<V>;
  using T = typename Vec::type;
  constexpr unsigned copies = dedup_stage_floats / V / block_threads;  // per thread and stage, at most
  constexpr unsigned groups = dedup_max_width / V / block_threads;     // column groups per thread, at most
  extern __shared__ float4 stage_memory[];
  std::uint32_t* window = reinterpret_cast<std::uint32_t*>(stage_memory);
  float* smem = reinterpret_cast<float*>(stage_memory) + 2 * dedup_window_rows;
  const unsigned w = static_cast<unsigned>(width);  // <= dedup_max_width
  const unsigned cols = w / V;
  unsigned chunk = 1;  // rows per stage: a power of two, so that windows hold whole chunks
  while (2 * chunk * w <= dedup_stage_floats && 2 * chunk <= dedup_window_rows) chunk *= 2;
  const unsigned ring = static_cast<unsigned>(stages);
  const int nh = *num_heavy;
  for (int h = static_cast<int>(blockIdx.x); h < nh; h += static_cast<int>(gridDim.x)) {
    const std::uint32_t k = heavy[h];
    const unsigned count = counts[k];
    const std::uint32_t* p = pos + offsets[k];
    const unsigned chunks = (count + chunk - 1) / chunk;
    auto rows_in = [&](unsigned c) { return count - c * chunk < chunk ? count - c * chunk : chunk; };
    unsigned loaded = ~0u;  // the window in window[loaded & 1]
    // Block-uniform: every thread calls it with the same chunk.
    auto issue = [&](unsigned c) {
      if (c < chunks) {
        const unsigned r0 = c * chunk, wx = r0 / dedup_window_rows;
        std::uint32_t* rows = window + (wx & 1) * dedup_window_rows;
        if (wx != loaded) {
          // The other window's copies are issued; this one's were, before the last barrier.
          const unsigned base = wx * dedup_window_rows;
          for (unsigned r = threadIdx.x; r < dedup_window_rows && base + r < count; r += block_threads)
            rows[r] = p[base + r];
          __syncthreads();
          loaded = wx;
        }
        rows += r0 - wx * dedup_window_rows;
        const unsigned items = rows_in(c) * cols;
        float* dst = smem + (c % ring) * dedup_stage_floats;
#pragma unroll
        for (unsigned i = 0; i < copies; ++i) {
          const unsigned e = threadIdx.x + i * block_threads;
          if (e < items) {
            const unsigned r = e / cols, col = (e - r * cols) * V;
            __pipeline_memcpy_async(dst + r * w + col, grads + std::size_t{rows[r]} * width + col,
                                    V * sizeof(float));
          }
        }
      }
      __pipeline_commit();  // empty groups too, so that wait_prior counts stages
    };
    for (unsigned c = 0; c + 1 < ring; ++c) issue(c);
    T acc[groups];
    for (unsigned c = 0; c < chunks; ++c) {
      issue(c + ring - 1);
      __pipeline_wait_prior(ring - 1);
      __syncthreads();
      const T* src = reinterpret_cast<const T*>(smem + (c % ring) * dedup_stage_floats);
      const unsigned nrows = rows_in(c);
#pragma unroll
      for (unsigned g = 0; g < groups; ++g) {
        const unsigned j = threadIdx.x + g * block_threads;
        if (j < cols) {
          const T* s = src + j;
          unsigned r = 0;
          if (c == 0) acc[g] = s[r++ * cols];
          for (; r + 8 <= nrows; r += 8) {
            T x[8];
#pragma unroll
            for (unsigned q = 0; q < 8; ++q) x[q] = s[(r + q) * cols];
#pragma unroll
            for (unsigned q = 0; q < 8; ++q) acc[g] = Vec::add(acc[g], x[q]);
          }
          for (; r < nrows; ++r) acc[g] = Vec::add(acc[g], s[r * cols]);
        }
      }
      __syncthreads();  // the stage may be refilled
    }
#pragma unroll
    for (unsigned g = 0; g < groups; ++g) {
      const unsigned j = threadIdx.x + g * block_threads;
      if (j < cols) reinterpret_cast<T*>(out + std::size_t{k} * width)[j] = acc[g];
    }
  }
}

template <class T>
void reserve(buffer<T>& b, std::size_t n) {
  if (b.size() < n) b = buffer<T>(n);
}

}  // namespace detail

//! Pull: `out[k, :] = table[ids[k], :]` for `k < n`, rows of `width` floats
//! (device pointers; ids inside the table, unchecked). Asynchronous on `stream`.
inline void gather_rows(const float* table, std::size_t width, const std::uint64_t* ids, std::size_t n, float* out,
                        cudaStream_t stream = 0) {
  if (n == 0 || width == 0) return;
  const bool vec = width % 4 == 0 && detail::aligned16(table) && detail::aligned16(out);
  const std::size_t work = n * (vec ? width / 4 : width);
  if (vec) detail::gather_rows_kernel<4><<<detail::grid_for(work), detail::block_threads, 0, stream>>>(table, width, ids, n, out);
  else detail::gather_rows_kernel<1><<<detail::grid_for(work), detail::block_threads, 0, stream>>>(table, width, ids, n, out);
  detail::check_launch("psx::cuda::gather_rows kernel launch");
}

//! Push: deduplicates the ids of a row push and sums each id's gradient
//! rows in push order. Owns its device memory, kept and grown across calls:
//! keep one per stream. Not thread-safe.
//!
//! `run` sorts (id, position) pairs by id with CUB's stable radix sort,
//! finds the runs of equal ids (run-length encoding, then a scan for their
//! starts) and folds each run's rows in position order: one thread per id
//! and column group for ids with few rows, one block with staged
//! shared-memory copies for ids with many.
class RowDedup {
 public:
  //! Deduplicates `n` ids (device) with their gradient rows `grads`
  //! (device, `n x width`, row-major) and returns the number of unique ids.
  //! Ids must be below `2^end_bit` (fewer bits sort faster). Synchronizes
  //! `stream` once, to learn the count; the outputs are ready when it returns
  //! (the sums are computed on `stream` after it: use them on that stream).
  std::size_t run(const std::uint64_t* ids, const float* grads, std::size_t n, std::size_t width,
                  cudaStream_t stream = 0, int end_bit = 64) {
    width_ = width;
    size_ = 0;
    if (n == 0) return 0;
    if (n > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      throw shape_error("psx::cuda::RowDedup: " + std::to_string(n) + " ids in one push; at most 2^31 - 1");
    if (end_bit < 1 || end_bit > 64)
      throw shape_error("psx::cuda::RowDedup: end_bit " + std::to_string(end_bit) + " is not in [1, 64]");
    const int items = static_cast<int>(n);
    detail::reserve(positions_, 2 * n);
    detail::reserve(sorted_ids_, n);
    detail::reserve(unique_, n);
    detail::reserve(counts_, 2 * n);      // counts, run offsets
    detail::reserve(counters_, 2);        // runs, heavy ids
    std::uint32_t* pos_in = positions_.data();
    std::uint32_t* pos = positions_.data() + n;
    std::uint32_t* counts = counts_.data();
    std::uint32_t* offsets = counts_.data() + n;
    std::uint32_t* heavy = positions_.data();  // pos_in is free once sorted
    int* num_runs = counters_.data();
    int* num_heavy = counters_.data() + 1;

    std::size_t sort_bytes = 0, encode_bytes = 0, scan_bytes = 0;
    check(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, ids, sorted_ids_.data(), pos_in, pos, items, 0,
                                          end_bit, stream),
          "cub::DeviceRadixSort::SortPairs (size query)");
    check(cub::DeviceRunLengthEncode::Encode(nullptr, encode_bytes, sorted_ids_.data(), unique_.data(), counts,
                                             num_runs, items, stream),
          "cub::DeviceRunLengthEncode::Encode (size query)");
    check(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, counts, offsets, items, stream),
          "cub::DeviceScan::ExclusiveSum (size query)");
    detail::reserve(temp_, std::max({sort_bytes, encode_bytes, scan_bytes, std::size_t{1}}));
    std::size_t temp_bytes = temp_.size();

    detail::iota_kernel<><<<detail::grid_for(n), detail::block_threads, 0, stream>>>(pos_in, n);
    detail::check_launch("psx::cuda::RowDedup iota kernel launch");
    check(cub::DeviceRadixSort::SortPairs(temp_.data(), temp_bytes, ids, sorted_ids_.data(), pos_in, pos, items, 0,
                                          end_bit, stream),
          "cub::DeviceRadixSort::SortPairs");
    temp_bytes = temp_.size();
    check(cub::DeviceRunLengthEncode::Encode(temp_.data(), temp_bytes, sorted_ids_.data(), unique_.data(), counts,
                                             num_runs, items, stream),
          "cub::DeviceRunLengthEncode::Encode");
    check(cudaMemsetAsync(num_heavy, 0, sizeof(int), stream), "cudaMemsetAsync");
    int runs = 0;
    check(cudaMemcpyAsync(&runs, num_runs, sizeof(int), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (RowDedup)");
    const std::size_t unique = static_cast<std::size_t>(runs);
    temp_bytes = temp_.size();
    check(cub::DeviceScan::ExclusiveSum(temp_.data(), temp_bytes, counts, offsets, runs, stream),
          "cub::DeviceScan::ExclusiveSum");
    size_ = unique;
    if (width == 0) return unique;
    detail::reserve(sums_, unique * width);

    const bool vec = width % 4 == 0 && detail::aligned16(grads);
    const int stages = heavy_stages(width, vec);
    const std::uint32_t light_max = stages > 0 ? detail::dedup_light_max_rows
                                               : std::numeric_limits<std::uint32_t>::max();
    const std::size_t work = unique * (vec ? width / 4 : width);
    const unsigned grid = detail::grid_for(work);
    if (vec)
      detail::dedup_light_kernel<4><<<grid, detail::block_threads, 0, stream>>>(
          counts, offsets, pos, grads, width, unique, sums_.data(), light_max, heavy, num_heavy);
    else
      detail::dedup_light_kernel<1><<<grid, detail::block_threads, 0, stream>>>(
          counts, offsets, pos, grads, width, unique, sums_.data(), light_max, heavy, num_heavy);
    detail::check_launch("psx::cuda::RowDedup sum kernel launch");
    if (stages > 0) {
      const std::size_t smem =
          static_cast<std::size_t>(stages) * detail::dedup_stage_floats * sizeof(float) + detail::dedup_window_bytes;
      const unsigned blocks = detail::grid_for(unique * detail::block_threads, 1);
      if (vec)
        detail::dedup_heavy_kernel<4><<<blocks, detail::block_threads, smem, stream>>>(
            heavy, num_heavy, counts, offsets, pos, grads, width, sums_.data(), stages);
      else
        detail::dedup_heavy_kernel<1><<<blocks, detail::block_threads, smem, stream>>>(
            heavy, num_heavy, counts, offsets, pos, grads, width, sums_.data(), stages);
      detail::check_launch("psx::cuda::RowDedup heavy-row sum kernel launch");
    }
    return unique;
  }

  //! The unique ids of the last `run`, ascending (device, `size()` of them).
  const std::uint64_t* unique_ids() const noexcept { return unique_.data(); }
  //! Each unique id's gradient sum (device, `size() x width()`, row-major).
  const float* sums() const noexcept { return sums_.data(); }
  //! How many times each unique id occurred (device, `size()` of them).
  const std::uint32_t* counts() const noexcept { return counts_.data(); }
  //! Unique ids found by the last `run`.
  std::size_t size() const noexcept { return size_; }
  //! Row width of the last `run`.
  std::size_t width() const noexcept { return width_; }

 private:
  // Stages of the heavy-id kernel for rows of `width` floats; 0 when the
  // rows or the device's shared memory are too small for it.
  static int heavy_stages(std::size_t width, bool vec) {
    if (width > detail::dedup_max_width) return 0;
    int device = 0, optin = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
    const int stage_bytes = static_cast<int>(detail::dedup_stage_floats * sizeof(float));
    const int stages =
        std::min(detail::dedup_max_stages, (optin - static_cast<int>(detail::dedup_window_bytes)) / stage_bytes);
    if (stages < 2) return 0;
    const int bytes = stages * stage_bytes + static_cast<int>(detail::dedup_window_bytes);
    if (vec)
      check(cudaFuncSetAttribute(detail::dedup_heavy_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
            "cudaFuncSetAttribute");
    else
      check(cudaFuncSetAttribute(detail::dedup_heavy_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
            "cudaFuncSetAttribute");
    return stages;
  }

  buffer<std::uint32_t> positions_;  // positions in, then sorted positions
  buffer<std::uint64_t> sorted_ids_;
  buffer<std::uint64_t> unique_;
  buffer<std::uint32_t> counts_;  // counts, then run offsets
  buffer<int> counters_;
  buffer<unsigned char> temp_;
  buffer<float> sums_;
  std::size_t size_ = 0;
  std::size_t width_ = 0;
};

}  // namespace cuda
}  // namespace v0
}  // namespace psx
