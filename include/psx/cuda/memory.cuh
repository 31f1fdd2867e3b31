//! @file psx/cuda/memory.cuh
//! Device memory for the CUDA kernel layer: `psx::cuda::check`, which turns a
//! CUDA error into `psx::error`, `psx::cuda::buffer<T>`, an owning,
//! move-only device array, `psx::cuda::pinned_buffer<T>`, its counterpart in
//! pinned host memory, and `psx::cuda::Staging`, which moves pageable host
//! memory to and from the device through pinned chunks. Every kernel
//! launcher in `psx/cuda/` checks its launch (`cudaGetLastError`) with
//! `check`, so a bad launch throws at the call that made it; errors inside a running kernel surface at the next
//! synchronizing call.
#pragma once

#include <psx/errors.hpp>

#include <cuda_runtime.h>

#include <algorithm>
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

// An owning array of `size()` elements of T, uninitialized, move-only, in
// the memory that `Memory::allocate(bytes)` gives and `Memory::release(p)`
// takes back (`Memory::name` names it in errors). A zero-sized array holds
// no memory.
template <class T, class Memory>
class owned_array {
  static_assert(std::is_trivially_copyable_v<T>, "psx::cuda: the element type must be trivially copyable");

 public:
  owned_array() = default;
  explicit owned_array(std::size_t n) : size_(n) {
    if (n == 0) return;
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T))
      throw std::length_error(std::string(Memory::name) + ": " + std::to_string(n) + " elements of " +
                              std::to_string(sizeof(T)) + " bytes are more bytes than a size_t counts");
    data_ = static_cast<T*>(Memory::allocate(n * sizeof(T)));
  }
  owned_array(owned_array&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  owned_array& operator=(owned_array&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  owned_array(const owned_array&) = delete;
  owned_array& operator=(const owned_array&) = delete;
  ~owned_array() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  bool empty() const noexcept { return size_ == 0; }

 private:
  void release() noexcept {
    if (data_) Memory::release(data_);
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
};

struct DeviceMemory {
  static constexpr const char* name = "psx::cuda::buffer";
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc of " + std::to_string(bytes) + " bytes");
    return p;
  }
  // A destructor cannot report; cudaFree fails only on a broken context.
  static void release(void* p) noexcept { cudaFree(p); }
};

struct PinnedMemory {
  static constexpr const char* name = "psx::cuda::pinned_buffer";
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    check(cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
          "cudaHostAlloc of " + std::to_string(bytes) + " bytes");
    return p;
  }
  static void release(void* p) noexcept { cudaFreeHost(p); }
};

}  // namespace detail

//! An owning device array of `size()` elements of T (cudaMalloc/cudaFree),
//! uninitialized; move-only. A zero-sized buffer holds no memory.
template <class T>
class buffer : public detail::owned_array<T, detail::DeviceMemory> {
  using base = detail::owned_array<T, detail::DeviceMemory>;

 public:
  buffer() = default;
  //! Allocates `n` elements.
  explicit buffer(std::size_t n) : base(n) {}
  //! A device copy of `host`.
  explicit buffer(std::span<const T> host) : base(host.size()) { copy_from(host); }

  //! Copies `host` (at most `size()` elements) to the start of the buffer; synchronous.
  void copy_from(std::span<const T> host) {
    if (host.size() > this->size())
      throw shape_error("psx::cuda::buffer: copying " + std::to_string(host.size()) + " elements into a buffer of " +
                        std::to_string(this->size()));
    if (!host.empty())
      check(cudaMemcpy(this->data(), host.data(), host.size_bytes(), cudaMemcpyHostToDevice),
            "cudaMemcpy host to device");
  }
  //! Copies the first `host.size()` elements to `host`; synchronous.
  void copy_to(std::span<T> host) const {
    if (host.size() > this->size())
      throw shape_error("psx::cuda::buffer: copying " + std::to_string(host.size()) + " elements out of a buffer of " +
                        std::to_string(this->size()));
    if (!host.empty())
      check(cudaMemcpy(host.data(), this->data(), host.size_bytes(), cudaMemcpyDeviceToHost),
            "cudaMemcpy device to host");
  }
};

//! An owning array of `size()` elements of T in pinned host memory
//! (page-locked, mapped into the device's address space, usable from every
//! device: `cudaHostAlloc` with `cudaHostAllocPortable | cudaHostAllocMapped`),
//! uninitialized; move-only. Gradients pushed from it and parameters pulled
//! into it cross the bus at the copy engines' rate, with no CPU copy on the
//! way (docs/gpu.md, "Host memory"). A zero-sized buffer holds no memory.
template <class T>
class pinned_buffer : public detail::owned_array<T, detail::PinnedMemory> {
  using base = detail::owned_array<T, detail::PinnedMemory>;

 public:
  pinned_buffer() = default;
  //! Allocates `n` elements.
  explicit pinned_buffer(std::size_t n) : base(n) {}

  //! The elements, for `Worker::push`, `pull`, `push_rows` and `pull_rows`.
  std::span<T> span() noexcept { return {this->data(), this->size()}; }
  std::span<const T> span() const noexcept { return {this->data(), this->size()}; }
};

//! Where a pointer points, as CUDA sees it.
enum class MemoryKind {
  pageable,  //!< ordinary host memory: the copy engines cannot read it directly
  pinned,    //!< page-locked host memory (cudaMallocHost, cudaHostRegister)
  device,    //!< device or managed memory
};

namespace detail {
// CUDA's view of `p`; unregistered (pageable) where CUDA does not know it.
inline cudaPointerAttributes attributes(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // plain host memory on old drivers
    a = cudaPointerAttributes{};
    a.type = cudaMemoryTypeUnregistered;
  }
  return a;
}
}  // namespace detail

//! The kind of memory `p` points into (pageable where CUDA does not know it).
inline MemoryKind memory_kind(const void* p) {
  const cudaPointerAttributes a = detail::attributes(p);
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return MemoryKind::device;
  return a.type == cudaMemoryTypeHost ? MemoryKind::pinned : MemoryKind::pageable;
}

//! The address at which a kernel reads and writes the pinned host memory at
//! `p` (over the bus), or nullptr when `p` is not pinned or not mapped.
inline void* mapped_pointer(const void* p) {
  const cudaPointerAttributes a = detail::attributes(p);
  return a.type == cudaMemoryTypeHost ? a.devicePointer : nullptr;
}

//! The address at which a kernel reads and writes `p`: `p` itself for device
//! or managed memory, `mapped_pointer(p)` for pinned memory, else nullptr
//! (one query where asking both would make two).
inline void* kernel_pointer(const void* p) {
  const cudaPointerAttributes a = detail::attributes(p);
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return const_cast<void*>(p);
  return a.type == cudaMemoryTypeHost ? a.devicePointer : nullptr;
}

//! Copies between pageable host memory and the device through two pinned
//! chunks of `chunk_bytes`, so that the CPU fills (or empties) one chunk while
//! a copy engine moves the other, and so that the CPU's copy can gather or
//! scatter (rows by position, ids made local) on the way. Several threads,
//! each with its own Staging, copy in parallel; the CUDA driver's own staging
//! of a pageable `cudaMemcpy` does not (docs/gpu.md has the figures).
//!
//! A Staging belongs to one thread; the chunks are portable pinned memory,
//! allocated at the first copy and grown for items larger than a chunk; the
//! events that tell when a chunk is free are made on the current device and
//! made again when a copy comes from another one. Every call returns when
//! the host side is done: an upload has handed each chunk to `stream`, a
//! download has written every item to the host. The two chunks take turns
//! across calls, so that one call's fill need not wait for the last call's
//! copy.
class Staging {
 public:
  static constexpr std::size_t chunk_bytes = std::size_t{4} << 20;

  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    for (chunk& c : chunks_) {  // a destructor cannot report; these fail only on a broken context
      if (c.done) {
        cudaEventSynchronize(c.done);  // the copy engine may still read the chunk
        cudaEventDestroy(c.done);
      }
      if (c.data) cudaFreeHost(c.data);
    }
  }

  //! Uploads `count` items of `item_bytes` to `dst` (device memory) on
  //! `stream`; `fill(begin, end, out)` writes items [begin, end) to `out`.
  template <class Fill>
  void upload(void* dst, std::size_t count, std::size_t item_bytes, cudaStream_t stream, Fill&& fill) {
    const std::size_t per = items_per_chunk(item_bytes);
    for (std::size_t begin = 0; begin < count; begin += per) {
      const std::size_t end = std::min(count, begin + per);
      chunk& c = take(turn_++);
      fill(begin, end, c.data);
      check(cudaMemcpyAsync(static_cast<unsigned char*>(dst) + begin * item_bytes, c.data, (end - begin) * item_bytes,
                            cudaMemcpyHostToDevice, stream),
            "psx::cuda::Staging: copy of a chunk to the device");
      check(cudaEventRecord(c.done, stream), "psx::cuda::Staging: cudaEventRecord");
    }
  }

  //! Downloads `count` items of `item_bytes` from `src` (device memory) on
  //! `stream`; `drain(begin, end, in)` takes items [begin, end) from `in`.
  template <class Drain>
  void download(const void* src, std::size_t count, std::size_t item_bytes, cudaStream_t stream, Drain&& drain) {
    const std::size_t per = items_per_chunk(item_bytes);
    const std::size_t chunks = (count + per - 1) / per;
    const std::size_t first = turn_;
    turn_ += chunks;
    auto enqueue = [&](std::size_t k) {
      chunk& c = take(first + k);
      const std::size_t begin = k * per, end = std::min(count, begin + per);
      check(cudaMemcpyAsync(c.data, static_cast<const unsigned char*>(src) + begin * item_bytes,
                            (end - begin) * item_bytes, cudaMemcpyDeviceToHost, stream),
            "psx::cuda::Staging: copy of a chunk from the device");
      check(cudaEventRecord(c.done, stream), "psx::cuda::Staging: cudaEventRecord");
    };
    if (chunks > 0) enqueue(0);
    for (std::size_t k = 0; k < chunks; ++k) {
      if (k + 1 < chunks) enqueue(k + 1);
      chunk& c = chunks_[(first + k) & 1];
      check(cudaEventSynchronize(c.done), "psx::cuda::Staging: wait for a chunk from the device");
      drain(k * per, std::min(count, (k + 1) * per), static_cast<const unsigned char*>(c.data));
    }
  }

  //! The calling thread's Staging.
  static Staging& of_this_thread() {
    thread_local Staging staging;
    return staging;
  }

 private:
  struct chunk {
    unsigned char* data = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t done = nullptr;
    int device = -1;  // where `done` was made
  };

  // At least one item a chunk, however large.
  std::size_t items_per_chunk(std::size_t item_bytes) {
    const std::size_t per = item_bytes == 0 ? 1 : std::max<std::size_t>(1, chunk_bytes / item_bytes);
    need_ = per * std::max<std::size_t>(item_bytes, 1);
    return per;
  }

  // Chunk k % 2, once the copy engine is done with its last use, at least
  // need_ bytes, with an event of the current device.
  chunk& take(std::size_t k) {
    chunk& c = chunks_[k & 1];
    int device = 0;
    check(cudaGetDevice(&device), "psx::cuda::Staging: cudaGetDevice");
    if (c.done && c.device != device) {  // an event records only on its own device's streams
      check(cudaEventSynchronize(c.done), "psx::cuda::Staging: wait for a chunk to be free");
      check(cudaEventDestroy(c.done), "psx::cuda::Staging: cudaEventDestroy");
      c.done = nullptr;
    }
    if (!c.done) {
      check(cudaEventCreateWithFlags(&c.done, cudaEventDisableTiming), "psx::cuda::Staging: cudaEventCreate");
      c.device = device;
    }
    check(cudaEventSynchronize(c.done), "psx::cuda::Staging: wait for a chunk to be free");
    if (c.bytes < need_) {
      if (c.data) check(cudaFreeHost(c.data), "psx::cuda::Staging: cudaFreeHost");
      c.data = nullptr;
      c.bytes = 0;
      void* p = nullptr;
      check(cudaHostAlloc(&p, need_, cudaHostAllocPortable),
            "psx::cuda::Staging: cudaHostAlloc of " + std::to_string(need_) + " bytes");
      c.data = static_cast<unsigned char*>(p);
      c.bytes = need_;
    }
    return c;
  }

  chunk chunks_[2];
  std::size_t need_ = 0;
  std::size_t turn_ = 0;  // the chunk the next copy takes (modulo 2)
};

}  // namespace cuda
}  // namespace v0
}  // namespace psx
