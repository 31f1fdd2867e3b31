//! @file psx/detail/hash.hpp
//! Specified hashes: FNV-1a 64 for names and SplitMix64 for counter-based
//! random numbers. Both are fixed by their published definitions, so a hash
//! computed on one host equals the one computed on another (unlike std::hash).
#pragma once

#include <cstdint>
#include <string_view>

namespace psx {
inline namespace v0 {
namespace detail {

//! FNV-1a, 64-bit (offset basis 14695981039346656037, prime 1099511628211).
constexpr std::uint64_t fnv1a64(std::string_view s) noexcept {
  std::uint64_t h = 14695981039346656037ull;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

//! SplitMix64's finalizer (Steele, Lea, Flood 2014): a bijective 64-bit mix.
constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

//! A uniform double in [0, 1) that depends only on (key, counter): the
//! counter-based generator behind the initializers.
constexpr double uniform01(std::uint64_t key, std::uint64_t counter) noexcept {
  const std::uint64_t bits = mix64(key ^ mix64(counter));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

}  // namespace detail
}  // namespace v0
}  // namespace psx
