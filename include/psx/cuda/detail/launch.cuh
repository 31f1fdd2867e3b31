//! @file psx/cuda/detail/launch.cuh
//! Internals of the CUDA kernel layer: launch sizes, alignment tests,
//! float arithmetic rounded exactly as the CPU rounds it, and stream-ordered
//! scratch memory. Not part of the public API.
#pragma once

#include <psx/cuda/memory.cuh>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace psx {
inline namespace v0 {
namespace cuda {
namespace detail {

// Every kernel in psx/cuda is a template; those with nothing to vary take a
// defaulted parameter (`template <class = void>`, launched as `k<><<<...>>>`).
// A plain __global__ function defined in a header is defined again by each
// translation unit that includes it, and the link fails; template
// instantiations are merged.

// Threads per block of the element-wise kernels. Not tuned: 256 is the
// usual choice for streaming kernels and the bench reports their bandwidth.
inline constexpr int block_threads = 256;
// Grid-stride kernels launch at most this many blocks per multiprocessor
// (2048 resident threads on sm_80/sm_90 at 256 threads a block).
inline constexpr int blocks_per_sm = 8;

inline int sm_count() {
  int device = 0, count = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return count > 0 ? count : 1;
}

// Blocks for `work` items, one per thread, capped for a grid-stride loop.
inline unsigned grid_for(std::size_t work, int per_sm = blocks_per_sm) {
  const std::size_t wanted = (work + block_threads - 1) / block_threads;
  const std::size_t cap = static_cast<std::size_t>(sm_count()) * static_cast<std::size_t>(per_sm);
  const std::size_t blocks = wanted < cap ? wanted : cap;
  return static_cast<unsigned>(blocks > 0 ? blocks : 1);
}

inline bool aligned16(const void* p) noexcept { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Element arithmetic with each operation rounded to nearest even on its own,
// as the CPU rounds it (psx::psx compiles the host with -ffp-contract=off):
// the `__f*_rn` intrinsics are never contracted into fused multiply-adds, so
// the device results equal `psx/optim.hpp`'s bit for bit. Not under
// `-ftz=true` (which `-use_fast_math` implies): it flushes subnormal inputs
// and results of these too, where the CPU keeps them.
namespace fp {
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double dadd(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double dmul(double a, double b) { return __dmul_rn(a, b); }
}  // namespace fp

// Stream-ordered scratch memory (cudaMallocAsync), freed in stream order
// when the owner goes out of scope: the kernels that use it are queued first.
class Scratch {
 public:
  Scratch(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    check(cudaMallocAsync(&data_, bytes, stream), "cudaMallocAsync of scratch memory");
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (data_) cudaFreeAsync(data_, stream_);
  }
  template <class T>
  T* as(std::size_t byte_offset = 0) const noexcept {
    return reinterpret_cast<T*>(static_cast<char*>(data_) + byte_offset);
  }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace detail
}  // namespace cuda
}  // namespace v0
}  // namespace psx
