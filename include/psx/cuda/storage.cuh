//! @file psx/cuda/storage.cuh
//! `psx::cuda::Device`: a storage type that keeps each server's shards
//! (parameters, optimizer slots, 16-bit copies) in GPU memory, so that
//!
//!     psx::ParameterServer<P, S, psx::optim::Adam, T, psx::cuda::Device>
//!
//! applies Adam through its CUDA specialization (`psx/cuda/optim.cuh`) on the
//! device, gathers pulled rows on the device and deduplicates pushed rows with
//! CUB (`psx::cuda::RowDedup`). The server logic (sync policies, clocks,
//! errors) is the host code of every other storage. Pulls may fill host or
//! device buffers; gradients are read from host memory (a device pointer is
//! refused with psx::config_error). Compile with nvcc.
//!
//! Each shard owns a CUDA stream on the device current when the server was
//! started (the thread that calls `start()`); every operation makes that
//! device current while it runs, and is complete when its call returns, also
//! when it throws. Pageable host memory (gradients, pulls into host buffers,
//! row gathers and scatters by position) moves through the serving thread's
//! `psx::cuda::Staging`, two pinned chunks that the CPU fills while a copy
//! engine moves the other; pinned and device memory are copied directly, and
//! rows pushed from or pulled into pinned memory are gathered or scattered by
//! a kernel that reads or writes it over the bus. Delay compensation
//! (DC-ASGD) reads parameters on the host and is refused at start with this
//! storage.
#pragma once

#include <psx/cuda/kernels.cuh>
#include <psx/storage.hpp>

#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace psx {
inline namespace v0 {
namespace cuda {

namespace detail {

// out[k, :] = src[rows[k], :] for 16-bit rows. (A template, like every kernel
// of these headers, so that several translation units may include them.)
template <class = void>
__global__ void gather_bits_kernel(const std::uint16_t* src, std::size_t width, const std::uint64_t* rows,
                                   std::size_t n, std::uint16_t* out) {
  const std::size_t total = n * width, stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t t = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; t < total; t += stride)
    out[t] = src[rows[t / width] * width + t % width];
}

// dst[positions[k], :] = src[k, :]: rows into a caller's device buffer.
template <class T>
__global__ void scatter_rows_kernel(const T* src, std::size_t width, const std::uint32_t* positions, std::size_t n,
                                    T* dst) {
  const std::size_t total = n * width, stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t t = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; t < total; t += stride)
    dst[std::size_t{positions[t / width]} * width + t % width] = src[t];
}

// dst[k, :] = src[positions[k], :]: rows of a caller's buffer (pinned host
// memory, read over the bus) in push order.
template <class T>
__global__ void gather_positions_kernel(const T* src, std::size_t width, const std::uint32_t* positions, std::size_t n,
                                        T* dst) {
  const std::size_t total = n * width, stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t t = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; t < total; t += stride)
    dst[t] = src[std::size_t{positions[t / width]} * width + t % width];
}

// low[rows[k], :] = 16-bit(params[rows[k], :]) after a row update.
template <bool Bf16>
__global__ void low_rows_kernel(const float* params, std::size_t width, const std::uint64_t* rows, std::size_t n,
                                std::uint16_t* low) {
  const std::size_t total = n * width, stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t t = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; t < total; t += stride) {
    const std::size_t at = rows[t / width] * width + t % width;
    if constexpr (Bf16) low[at] = bfloat16_bits(params[at]);
    else low[at] = float16_bits(params[at]);
  }
}

inline unsigned blocks_for(std::size_t work) {
  const std::size_t b = (work + 255) / 256;
  return static_cast<unsigned>(b < 4096 ? (b == 0 ? 1 : b) : 4096);
}

inline bool on_device(const void* p) { return memory_kind(p) == MemoryKind::device; }

}  // namespace detail

//! Shards in GPU memory; gradients applied by the optimizers' CUDA
//! specializations (`psx::cuda::update`, `update_rows`).
struct Device {
  static constexpr bool host_visible = false;

  //! The server reads gradients on the host (it sums aggregated steps there):
  //! a gradient in device memory is refused with a clear error, before
  //! anything changes. Pulls may fill device buffers.
  static void check_gradient(std::span<const float> g, const std::string& where) {
    if (!g.empty() && detail::on_device(g.data()))
      throw config_error(where + ": the gradient is in device memory; psx::cuda::Device reads gradients from "
                                 "host memory (pulls may fill device buffers)");
  }

  template <Optimizer O>
  class shard {
   public:
    shard(const O& optimizer, const VariableInfo& v, const Shard& sh)
        : dtype_(v.meta.dtype), width_(v.meta.row_width), n_(sh.rows() * v.meta.row_width) {
      if (optimizer.slots() > 4)
        throw config_error("psx::cuda::Device: variable '" + v.meta.name + "': the optimizer keeps " +
                           std::to_string(optimizer.slots()) + " slots per parameter, at most 4 on the device");
      std::vector<float> host(n_);
      v.init.fill(v.meta.name, sh.row_begin * width_, host);
      params_ = buffer<float>(n_);
      upload(params_.data(), host.data(), n_);
      slots_ = buffer<float>(optimizer.slots() * n_);
      for (std::size_t k = 0; k < optimizer.slots(); ++k) {
        std::fill(host.begin(), host.end(), initial_slot(optimizer, k));
        upload(slots_.data() + k * n_, host.data(), n_);
        slots_view_.slot[k] = slots_.data() + k * n_;
      }
      slots_view_.count = optimizer.slots();
      if (dtype_ != DType::float32) {
        low_ = buffer<std::uint16_t>(n_);
        refresh_low();
      }
      finish("initialize");
    }
    shard(const shard&) = delete;
    shard& operator=(const shard&) = delete;

    std::size_t size() const noexcept { return n_; }
    bool low_precision() const noexcept { return !low_.empty(); }
    std::size_t parameter_bytes() const noexcept { return params_.bytes() + low_.bytes(); }
    std::size_t slot_bytes() const noexcept { return slots_.bytes(); }

    //! Copies the shard into `out` (host or device memory).
    void read(std::span<float> out) const {
      const op_guard guard(*this);
      copy_out(out.data(), params_.data(), n_ * sizeof(float));
    }
    void read(std::span<std::uint16_t> out) const {
      const op_guard guard(*this);
      copy_out(out.data(), low_.data(), n_ * sizeof(std::uint16_t));
    }

    //! Copies the parameters and the slots (slot-major) to host memory: a checkpoint save.
    void save_state(std::span<float> params, std::span<float> slots) const {
      const op_guard guard(*this);
      to_host(params.data(), params_.data(), n_ * sizeof(float), "copy of the parameters for a checkpoint");
      to_host(slots.data(), slots_.data(), slots_.bytes(), "copy of the slots for a checkpoint");
      finish("checkpoint save");
    }
    //! Replaces the parameters and the slots from host memory and refreshes
    //! the 16-bit copy: a checkpoint restore.
    void assign(std::span<const float> params, std::span<const float> slots) {
      const op_guard guard(*this);
      upload(params_.data(), params.data(), n_);
      if (!slots.empty()) upload(slots_.data(), slots.data(), slots.size());
      if (!low_.empty()) refresh_low();
      finish("checkpoint restore");
    }

    //! Gathers rows `ids[j] - first_row` on the device, then places them at
    //! rows `positions[j]` (or j) of `out`.
    template <class T>
    void read_rows(std::span<const std::uint64_t> ids, std::size_t first_row, std::span<const std::uint32_t> positions,
                   std::span<T> out) const {
      const op_guard guard(*this);
      const std::size_t n = ids.size();
      if (n == 0) return;
      upload_rows(ids, first_row);
      T* staged = reinterpret_cast<T*>(stage(n * width_ * sizeof(T)));
      if constexpr (std::is_same_v<T, float>) {
        gather_rows(params_.data(), width_, rows_.data(), n, staged, stream_);
      } else {
        detail::gather_bits_kernel<><<<detail::blocks_for(n * width_), 256, 0, stream_>>>(low_.data(), width_,
                                                                                         rows_.data(), n, staged);
        detail::check_launch("psx::cuda::Device: gather of 16-bit rows");
      }
      if (positions.empty()) {
        copy_out(out.data(), staged, n * width_ * sizeof(T));
        return;
      }
      // Rows to their positions: by a kernel into device memory and into
      // pinned host memory (written over the bus), else on the way through
      // the thread's Staging.
      T* direct = static_cast<T*>(kernel_pointer(out.data()));
      if (direct) {
        positions_.resize_for(n);
        to_device(positions_.data(), positions.data(), n * sizeof(std::uint32_t), "upload of row positions");
        detail::scatter_rows_kernel<T>
            <<<detail::blocks_for(n * width_), 256, 0, stream_>>>(staged, width_, positions_.data(), n, direct);
        detail::check_launch("psx::cuda::Device: scatter of pulled rows");
      } else {
        const std::size_t row_bytes = width_ * sizeof(T);
        Staging::of_this_thread().download(staged, n, row_bytes, stream_,
                                           [&](std::size_t begin, std::size_t end, const unsigned char* in) {
                                             for (std::size_t j = begin; j < end; ++j, in += row_bytes)
                                               std::memcpy(out.data() + std::size_t{positions[j]} * width_, in,
                                                           row_bytes);
                                           });
      }
      finish("pull_rows");
    }

    //! Applies a gradient for the whole shard (host or device memory).
    void apply(const O& optimizer, std::span<const float> g, const UpdateContext& ctx) {
      const op_guard guard(*this);
      grads_.resize_for(n_);
      to_device(grads_.data(), g.data(), n_ * sizeof(float), "upload of a gradient");
      update(optimizer, params_.data(), grads_.data(), slots_view_, n_, ctx, stream_);
      if (!low_.empty()) refresh_low();
      finish("push");
    }

    //! Applies summed gradient rows (summed on the host by the server).
    void apply_rows(const O& optimizer, const psx::detail::RowAccumulator& rows, const UpdateContext& ctx) {
      const op_guard guard(*this);
      const std::size_t n = rows.rows().size();
      if (n == 0) return;
      rows_.resize_for(n);
      grads_.resize_for(n * width_);
      to_device(rows_.data(), rows.rows().data(), n * sizeof(std::uint64_t), "upload of row ids");
      to_device(grads_.data(), rows.data().data(), n * width_ * sizeof(float), "upload of gradient rows");
      update_rows(optimizer, params_.data(), slots_view_, width_, rows_.data(), grads_.data(), n, ctx, stream_);
      if (!low_.empty()) refresh_low_rows(rows_.data(), n);
      finish("push_rows");
    }

    //! Applies a row push as it came: ids `ids[j]` (global, of this shard) with
    //! gradient row `positions[j]` (or j) of `grads`; repeated ids are summed
    //! on the device (CUB radix sort, then each id's rows in push order).
    void apply_raw_rows(const O& optimizer, std::span<const std::uint64_t> ids, std::size_t first_row,
                        std::span<const std::uint32_t> positions, std::span<const float> grads,
                        const UpdateContext& ctx) {
      const op_guard guard(*this);
      const std::size_t n = ids.size();
      if (n == 0) return;
      upload_rows(ids, first_row);
      grads_.resize_for(n * width_);
      if (positions.empty()) {
        to_device(grads_.data(), grads.data(), n * width_ * sizeof(float), "upload of gradient rows");
      } else if (const float* mapped = static_cast<const float*>(mapped_pointer(grads.data()))) {
        // Pinned host memory: the rows of this shard read over the bus, in push order.
        positions_.resize_for(n);
        to_device(positions_.data(), positions.data(), n * sizeof(std::uint32_t), "upload of row positions");
        detail::gather_positions_kernel<float>
            <<<detail::blocks_for(n * width_), 256, 0, stream_>>>(mapped, width_, positions_.data(), n, grads_.data());
        detail::check_launch("psx::cuda::Device: gather of pushed rows");
      } else {
        // Rows of this shard, in push order, gathered from the caller's buffer on the way.
        const std::size_t row_bytes = width_ * sizeof(float);
        Staging::of_this_thread().upload(grads_.data(), n, row_bytes, stream_,
                                         [&](std::size_t begin, std::size_t end, unsigned char* out) {
                                           for (std::size_t j = begin; j < end; ++j, out += row_bytes)
                                             std::memcpy(out, grads.data() + std::size_t{positions[j]} * width_,
                                                         row_bytes);
                                         });
      }
      const std::size_t unique = dedup_.run(rows_.data(), grads_.data(), n, width_, stream_);
      update_rows(optimizer, params_.data(), slots_view_, width_, dedup_.unique_ids(), dedup_.sums(), unique, ctx,
                  stream_);
      if (!low_.empty()) refresh_low_rows(dedup_.unique_ids(), unique);
      finish("push_rows");
    }

   private:
    // Around every operation but the constructor (which runs on the device it
    // takes): the shard's device current on this thread (a server thread
    // starts on device 0) and the caller's current device back afterwards;
    // and when the operation throws, the shard's stream synchronized, so that
    // no copy or kernel still reads or writes a caller's buffer once the call
    // has ended.
    class op_guard {
     public:
      explicit op_guard(const shard& s)
          : s_(s), unwinding_(std::uncaught_exceptions()), caller_device_(current_device()) {
        if (caller_device_ != s.device_) check(cudaSetDevice(s.device_), "psx::cuda::Device: cudaSetDevice");
      }
      ~op_guard() {
        if (std::uncaught_exceptions() > unwinding_) (void)cudaStreamSynchronize(s_.stream_);
        if (caller_device_ != s_.device_) (void)cudaSetDevice(caller_device_);
      }
      op_guard(const op_guard&) = delete;
      op_guard& operator=(const op_guard&) = delete;

     private:
      const shard& s_;
      int unwinding_;
      int caller_device_;
    };

    static int current_device() {
      int device = 0;
      check(cudaGetDevice(&device), "psx::cuda::Device: cudaGetDevice");
      return device;
    }

    // The shard's stream, destroyed with the shard (also when its
    // constructor throws after creating it).
    struct owned_stream {
      cudaStream_t s = nullptr;
      owned_stream() { check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "psx::cuda::Device: cudaStreamCreate"); }
      ~owned_stream() {
        if (s) cudaStreamDestroy(s);
      }
      owned_stream(const owned_stream&) = delete;
      owned_stream& operator=(const owned_stream&) = delete;
    };

    // A device buffer that only grows.
    template <class T>
    struct scratch {
      buffer<T> b;
      void resize_for(std::size_t n) {
        if (b.size() < n) b = buffer<T>(n);
      }
      T* data() noexcept { return b.data(); }
    };

    // `bytes` from host memory (pageable ones through the thread's Staging)
    // or device memory to the device, on the shard's stream.
    void to_device(void* dst, const void* src, std::size_t bytes, const char* what) const {
      if (bytes == 0) return;
      if (memory_kind(src) == MemoryKind::pageable) {
        Staging::of_this_thread().upload(dst, bytes, 1, stream_,
                                         [&](std::size_t begin, std::size_t end, unsigned char* out) {
                                           std::memcpy(out, static_cast<const unsigned char*>(src) + begin, end - begin);
                                         });
      } else {
        check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), std::string("psx::cuda::Device: ") + what);
      }
    }
    // `bytes` from the device to host or device memory, on the shard's
    // stream; pageable memory is written when this returns.
    void to_host(void* dst, const void* src, std::size_t bytes, const char* what) const {
      if (bytes == 0) return;
      if (memory_kind(dst) == MemoryKind::pageable) {
        Staging::of_this_thread().download(src, bytes, 1, stream_,
                                           [&](std::size_t begin, std::size_t end, const unsigned char* in) {
                                             std::memcpy(static_cast<unsigned char*>(dst) + begin, in, end - begin);
                                           });
      } else {
        check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), std::string("psx::cuda::Device: ") + what);
      }
    }
    void upload(float* dst, const float* src, std::size_t n) {
      to_device(dst, src, n * sizeof(float), "upload");
      finish("upload");
    }
    // The shard's row numbers of `ids` (global ids of this shard), made local on the way.
    void upload_rows(std::span<const std::uint64_t> ids, std::size_t first_row) const {
      rows_.resize_for(ids.size());
      Staging::of_this_thread().upload(rows_.data(), ids.size(), sizeof(std::uint64_t), stream_,
                                       [&](std::size_t begin, std::size_t end, unsigned char* out) {
                                         std::uint64_t* local = reinterpret_cast<std::uint64_t*>(out);
                                         for (std::size_t j = begin; j < end; ++j) *local++ = ids[j] - first_row;
                                       });
    }
    void* stage(std::size_t bytes) const {
      stage_.resize_for(bytes);
      return stage_.data();
    }
    void copy_out(void* dst, const void* src, std::size_t bytes) const {
      to_host(dst, src, bytes, "copy of a pull");
      finish("pull");
    }
    void refresh_low() {
      if (dtype_ == DType::bfloat16) convert(params_.data(), reinterpret_cast<bfloat16*>(low_.data()), n_, stream_);
      else convert(params_.data(), reinterpret_cast<float16*>(low_.data()), n_, stream_);
    }
    void refresh_low_rows(const std::uint64_t* rows, std::size_t n) {
      if (dtype_ == DType::bfloat16)
        detail::low_rows_kernel<true>
            <<<detail::blocks_for(n * width_), 256, 0, stream_>>>(params_.data(), width_, rows, n, low_.data());
      else
        detail::low_rows_kernel<false>
            <<<detail::blocks_for(n * width_), 256, 0, stream_>>>(params_.data(), width_, rows, n, low_.data());
      detail::check_launch("psx::cuda::Device: 16-bit copy of updated rows");
    }
    void finish(const char* what) const {
      check(cudaStreamSynchronize(stream_), std::string("psx::cuda::Device: ") + what);
    }

    DType dtype_;
    std::size_t width_;
    std::size_t n_;
    int device_ = current_device();  // current when the shard was made: its stream's and its memory's
    owned_stream owned_stream_;
    cudaStream_t stream_ = owned_stream_.s;
    buffer<float> params_;
    buffer<float> slots_;
    buffer<std::uint16_t> low_;
    DeviceSlots slots_view_;
    // Scratch, reused across calls (one server thread uses a shard).
    mutable scratch<std::uint64_t> rows_;
    mutable scratch<std::uint32_t> positions_;
    mutable scratch<float> grads_;
    mutable scratch<unsigned char> stage_;
    RowDedup dedup_;
  };
};

}  // namespace cuda
}  // namespace v0
}  // namespace psx
