//! @file psx/quantize.hpp
//! int8 symmetric quantization, per tensor or per output channel (each row
//! of a `[rows, width]` tensor), for exporting parameters and for compressed
//! pulls. This is the reference the device kernels (`psx/cuda/convert.cuh`)
//! are tested against, bit for bit:
//!
//!     scale = max(max|x| / 127, FLT_MIN)   (float division; 1 when the max is 0;
//!                                           one step lower where 127 * scale would be infinite)
//!     q     = clamp(nearbyint(x / scale), -127, 127)
//!     x'    = q * scale
//!
//! `nearbyint` rounds ties to even (the default rounding mode). The max
//! ignores NaN (as `std::fmax` does) and a NaN quantizes to 0; an infinity
//! makes the scale infinite, and so every element of its tensor (or row)
//! dequantizes to NaN (0 x inf), finite ones included. FLT_MIN keeps the
//! scale a normal float when the max is tiny (below 127 x FLT_MIN, where
//! max / 127 would lose bits or round to 0): such values, subnormal or
//! nearly, quantize to multiples of FLT_MIN. -128 is never produced, so
//! the range is symmetric.
#pragma once

#include <psx/errors.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace psx {
inline namespace v0 {

//! A quantized tensor: `values` (`rows x width`, row-major) and one scale
//! per row (`per_channel`) or one for the tensor.
struct QuantizedInt8 {
  std::vector<std::int8_t> values;
  std::vector<float> scales;
  std::size_t rows = 0;
  std::size_t width = 0;
  bool per_channel = false;
};

namespace detail {

inline float int8_scale(std::span<const float> x) noexcept {
  float m = 0.0f;
  for (float v : x) m = std::fmax(m, std::fabs(v));
  if (!(m > 0.0f)) return 1.0f;
  float s = std::fmax(m / 127.0f, FLT_MIN);
  // FLT_MAX / 127 rounds up, and 127 times it is infinite: one step down
  // keeps a finite parameter finite when dequantized (still 127 quantized).
  if (std::isfinite(s) && std::isinf(127.0f * s)) s = std::nextafter(s, 0.0f);
  return s;
}

inline std::int8_t quantize_int8_one(float x, float scale) noexcept {
  const float r = std::nearbyint(x / scale);
  if (std::isnan(r)) return 0;
  return static_cast<std::int8_t>(std::clamp(r, -127.0f, 127.0f));
}

}  // namespace detail

//! Quantizes `x`, a `rows x width` tensor, to int8 with one scale for the
//! tensor or, `per_channel`, one per row. Throws psx::shape_error when `x`
//! does not hold `rows * width` values.
inline QuantizedInt8 quantize_int8(std::span<const float> x, std::size_t rows, std::size_t width, bool per_channel) {
  if (width != 0 && rows > x.size() / width)
    throw shape_error("psx::quantize_int8: a " + std::to_string(rows) + " x " + std::to_string(width) +
                      " tensor needs more than the " + std::to_string(x.size()) + " values given");
  if (rows * width != x.size())
    throw shape_error("psx::quantize_int8: a " + std::to_string(rows) + " x " + std::to_string(width) +
                      " tensor has " + std::to_string(rows * width) + " values, " + std::to_string(x.size()) +
                      " given");
  std::vector<float> scales;
  try {
    scales.resize(per_channel ? rows : 1);  // rows of 0 values each have a scale
  } catch (const std::exception&) {
    throw shape_error("psx::quantize_int8: " + std::to_string(rows) + " rows (of " + std::to_string(width) +
                      " values) are more scales than memory holds");
  }
  QuantizedInt8 out{std::vector<std::int8_t>(x.size()), std::move(scales), rows, width, per_channel};
  const std::size_t groups = per_channel ? rows : 1, group = per_channel ? width : x.size();
  for (std::size_t r = 0; r < groups; ++r) {
    const std::span<const float> part = x.subspan(r * group, group);
    const float scale = detail::int8_scale(part);
    out.scales[r] = scale;
    for (std::size_t i = 0; i < group; ++i) out.values[r * group + i] = detail::quantize_int8_one(part[i], scale);
  }
  return out;
}

//! `out[i] = q.values[i] * scale` of its tensor or row. Throws
//! psx::shape_error when `out` or `q`'s own sizes disagree with its shape.
inline void dequantize(const QuantizedInt8& q, std::span<float> out) {
  const std::size_t n = q.rows * q.width;
  if (q.values.size() != n || out.size() != n || q.scales.size() != (q.per_channel ? q.rows : 1))
    throw shape_error("psx::dequantize: a " + std::to_string(q.rows) + " x " + std::to_string(q.width) +
                      (q.per_channel ? " per-channel" : " per-tensor") + " tensor with " +
                      std::to_string(q.values.size()) + " values and " + std::to_string(q.scales.size()) +
                      " scales into " + std::to_string(out.size()) + " floats");
  for (std::size_t i = 0; i < n; ++i)
    out[i] = static_cast<float>(q.values[i]) * q.scales[q.per_channel ? i / q.width : 0];
}

}  // namespace v0
}  // namespace psx
