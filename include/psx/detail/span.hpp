//! @file psx/detail/span.hpp
//! Small helpers shared by the worker and the server.
#pragma once

#include <cstddef>
#include <cstring>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail {

//! "[784, 10]": a shape as error messages print it.
inline std::string shape_string(std::span<const std::size_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ']';
}

//! Product of the extents (1 for a scalar's empty shape).
inline std::size_t element_count(std::span<const std::size_t> shape) noexcept {
  return std::accumulate(shape.begin(), shape.end(), std::size_t{1}, std::multiplies<>{});
}

//! Copies `n` floats. Rows of embedding tables are short (8 to 128 floats),
//! where a call to memcpy per row costs as much as the copy; copies of a
//! size known at compile time are inlined as a few vector moves instead.
inline void copy_floats(float* dst, const float* src, std::size_t n) noexcept {
  switch (n) {
    case 4: std::memcpy(dst, src, 4 * sizeof(float)); return;
    case 8: std::memcpy(dst, src, 8 * sizeof(float)); return;
    case 16: std::memcpy(dst, src, 16 * sizeof(float)); return;
    case 32: std::memcpy(dst, src, 32 * sizeof(float)); return;
    case 64: std::memcpy(dst, src, 64 * sizeof(float)); return;
    default: std::memcpy(dst, src, n * sizeof(float));
  }
}

//! Asks for the cache lines of `[p, p + bytes)`, `bytes > 0` (the last one
//! too, where `p` is not on a line): rows read out of order then miss the
//! caches together instead of one after another.
//!
//! The empty volatile asm is what keeps the prefetches: GCC finds a
//! function whose only effect is a prefetch (this one, or a lambda around
//! it) "const", and deletes calls to it that it did not inline: the row
//! updates' prefetches were gone so, and 100k random rows of 8 floats took
//! 7.5 ms instead of 1-2.
inline void prefetch_bytes(const void* p, std::size_t bytes) noexcept {
  const auto* c = static_cast<const char*>(p);
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b);
  __builtin_prefetch(c + bytes - 1);
#if defined(__GNUC__)
  asm volatile("" : : "r"(c) : );
#endif
}

}  // namespace detail
}  // namespace v0
}  // namespace psx
