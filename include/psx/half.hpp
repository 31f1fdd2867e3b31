//! @file psx/half.hpp
//! The 16-bit storage types of mixed-precision variables: `psx::bfloat16`
//! and `psx::float16` (IEEE 754 binary16). They only store and convert;
//! arithmetic is done in float32. Conversions round to nearest, ties to
//! even, keep infinities and signed zeros, and make a NaN quiet when narrowing
//! (widening keeps a NaN's payload);
//! tests check them against Eigen's `Eigen::bfloat16` and `Eigen::half` for
//! every 16-bit pattern and millions of floats. They are written here, not
//! taken from Eigen, so that the core stays free of dependencies.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace psx {
inline namespace v0 {

//! Element type of a variable on the server. float32 variables are stored
//! as they are; bfloat16 and float16 variables keep a float32 master copy
//! (which the optimizer updates in float32) and a 16-bit copy, refreshed after
//! every update, that 16-bit pulls return.
enum class DType : std::uint8_t { float32, bfloat16, float16 };

inline const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::float32: return "float32";
    case DType::bfloat16: return "bfloat16";
    case DType::float16: return "float16";
  }
  return "unknown";
}

//! Bytes of one element of `t`.
inline constexpr std::size_t dtype_size(DType t) noexcept { return t == DType::float32 ? 4 : 2; }

//! bfloat16: the upper half of a float32 (8 exponent bits, 7 mantissa bits).
struct bfloat16 {
  std::uint16_t bits = 0;
  static constexpr DType dtype = DType::bfloat16;

  static constexpr bfloat16 from_float(float f) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<std::uint16_t>((u >> 16) | 0x40u)};  // quiet NaN
    const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return {static_cast<std::uint16_t>(rounded >> 16)};
  }
  constexpr float to_float() const noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
  friend constexpr bool operator==(bfloat16, bfloat16) = default;
};

//! float16: IEEE 754 binary16 (5 exponent bits, 10 mantissa bits).
struct float16 {
  std::uint16_t bits = 0;
  static constexpr DType dtype = DType::float16;

  static constexpr float16 from_float(float f) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = (u >> 16) & 0x8000u;
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return {static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};  // NaN
    if (a >= 0x477ff000u) return {static_cast<std::uint16_t>(sign | 0x7c00u)};  // rounds to infinity
    if (a < 0x38800000u) {
      // Subnormal or zero in half: add 0.5 (as float), whose ulp is a half
      // subnormal step, so the float adder rounds to nearest even for us.
      const float shifted = std::bit_cast<float>(a) + 0.5f;
      return {static_cast<std::uint16_t>(sign | (std::bit_cast<std::uint32_t>(shifted) - 0x3f000000u))};
    }
    const std::uint32_t odd = (a >> 13) & 1u;
    const std::uint32_t r = a - 0x38000000u + 0xfffu + odd;  // rebias 127 -> 15, round to nearest even
    return {static_cast<std::uint16_t>(sign | (r >> 13))};
  }
  constexpr float to_float() const noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
    const std::uint32_t exp = (bits >> 10) & 0x1fu;
    const std::uint32_t man = bits & 0x3ffu;
    if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
      // Zero or subnormal: man * 2^-24, exact in float.
      const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
      return sign ? -mag : mag;
    }
    return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
  }
  friend constexpr bool operator==(float16, float16) = default;
};

namespace detail {

//! Converts `n` floats to the 16-bit `dtype` (bfloat16 or float16).
inline void to_low(DType dtype, const float* src, std::uint16_t* dst, std::size_t n) noexcept {
  if (dtype == DType::bfloat16)
    for (std::size_t i = 0; i < n; ++i) dst[i] = bfloat16::from_float(src[i]).bits;
  else
    for (std::size_t i = 0; i < n; ++i) dst[i] = float16::from_float(src[i]).bits;
}

//! Converts `n` 16-bit values of `dtype` (bfloat16 or float16) to float, exactly.
inline void from_low(DType dtype, const std::uint16_t* src, float* dst, std::size_t n) noexcept {
  if (dtype == DType::bfloat16)
    for (std::size_t i = 0; i < n; ++i) dst[i] = bfloat16{src[i]}.to_float();
  else
    for (std::size_t i = 0; i < n; ++i) dst[i] = float16{src[i]}.to_float();
}

}  // namespace detail
}  // namespace v0
}  // namespace psx
