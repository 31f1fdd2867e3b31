//! @file psx/cuda/memory.cuh
//! Device memory for the CUDA kernel layer: `psx::cuda::check`, which turns a
//! CUDA error into `psx::error`, and `psx::cuda::buffer<T>`, an owning,
//! move-only device array. Every kernel launcher in `psx/cuda/` checks its
//! launch (`cudaGetLastError`) with `check`, so a bad launch throws at the
//! call that made it; errors inside a running kernel surface at the next
//! synchronizing call.
#pragma once

#include <psx/errors.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace psx {
inline namespace v0 {
namespace cuda {

//! Throws `psx::error` naming `what` and CUDA's error when `status` is not `cudaSuccess`.
inline void check(cudaError_t status, std::string_view what) {
  if (status == cudaSuccess) return;
  throw error("psx: CUDA: " + std::string(what) + " failed: " + cudaGetErrorName(status) + " (" +
              cudaGetErrorString(status) + ")");
}

namespace detail {
// After a `<<<...>>>` launch: a bad configuration is reported here, at once.
inline void check_launch(std::string_view kernel) { check(cudaGetLastError(), kernel); }
}  // namespace detail

//! An owning device array of `size()` elements of T (cudaMalloc/cudaFree),
//! uninitialized; move-only. A zero-sized buffer holds no memory.
template <class T>
class buffer {
  static_assert(std::is_trivially_copyable_v<T>, "psx::cuda::buffer<T>: T must be trivially copyable");

 public:
  buffer() = default;
  //! Allocates `n` elements.
  explicit buffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T))
      throw std::length_error("psx::cuda::buffer: " + std::to_string(n) + " elements of " + std::to_string(sizeof(T)) +
                              " bytes are more bytes than a size_t counts");
    void* p = nullptr;
    check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc of " + std::to_string(n * sizeof(T)) + " bytes");
    data_ = static_cast<T*>(p);
  }
  //! A device copy of `host`.
  explicit buffer(std::span<const T> host) : buffer(host.size()) { copy_from(host); }

  buffer(buffer&& other) noexcept : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  buffer& operator=(buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  ~buffer() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  bool empty() const noexcept { return size_ == 0; }

  //! Copies `host` (at most `size()` elements) to the start of the buffer; synchronous.
  void copy_from(std::span<const T> host) {
    if (host.size() > size_) throw shape_error("psx::cuda::buffer: copying " + std::to_string(host.size()) +
                                               " elements into a buffer of " + std::to_string(size_));
    if (!host.empty())
      check(cudaMemcpy(data_, host.data(), host.size_bytes(), cudaMemcpyHostToDevice), "cudaMemcpy host to device");
  }
  //! Copies the first `host.size()` elements to `host`; synchronous.
  void copy_to(std::span<T> host) const {
    if (host.size() > size_) throw shape_error("psx::cuda::buffer: copying " + std::to_string(host.size()) +
                                               " elements out of a buffer of " + std::to_string(size_));
    if (!host.empty())
      check(cudaMemcpy(host.data(), data_, host.size_bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
  }

 private:
  void release() noexcept {
    if (data_) cudaFree(data_);  // a destructor cannot report; cudaFree fails only on a broken context
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace cuda
}  // namespace v0
}  // namespace psx
