//! @file psx/cuda/convert.cuh
//! Conversions on the device: float32 to and from `psx::bfloat16` and
//! `psx::float16`, bit for bit as `psx/half.hpp` converts (the same integer
//! algorithms: round to nearest even, infinities and signed zeros kept, NaN
//! made quiet with its payload), and int8 symmetric quantization per tensor
//! or per output channel, equal to `psx::quantize_int8` (`psx/quantize.hpp`).
#pragma once

#include <psx/cuda/detail/launch.cuh>
#include <psx/cuda/memory.cuh>
#include <psx/errors.hpp>
#include <psx/half.hpp>

#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

namespace psx {
inline namespace v0 {
namespace cuda {

namespace detail {

static_assert(sizeof(bfloat16) == 2 && sizeof(float16) == 2, "psx::bfloat16 and psx::float16 are 16 bits");

// psx::bfloat16::from_float.
__device__ __forceinline__ std::uint16_t bfloat16_bits(float f) {
  const std::uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float bfloat16_float(std::uint16_t b) { return __uint_as_float(std::uint32_t{b} << 16); }

// psx::float16::from_float.
__device__ __forceinline__ std::uint16_t float16_bits(float f) {
  const std::uint32_t u = __float_as_uint(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (a < 0x38800000u) {
    const float shifted = fp::add(__uint_as_float(a), 0.5f);
    return static_cast<std::uint16_t>(sign | (__float_as_uint(shifted) - 0x3f000000u));
  }
  const std::uint32_t odd = (a >> 13) & 1u;
  return static_cast<std::uint16_t>(sign | ((a - 0x38000000u + 0xfffu + odd) >> 13));
}
// psx::float16::to_float.
__device__ __forceinline__ float float16_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    const float mag = fp::mul(static_cast<float>(man), 5.9604644775390625e-8f);
    return sign ? -mag : mag;
  }
  return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

template <bool Bf16>
__global__ void __launch_bounds__(block_threads)
    to_half_kernel(const float* __restrict__ in, std::uint16_t* __restrict__ out, std::size_t n, bool vec) {
  auto cvt = [](float f) { return Bf16 ? bfloat16_bits(f) : float16_bits(f); };
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t tid = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::size_t nv = vec ? n / 4 : 0;
  for (std::size_t i = tid; i < nv; i += stride) {
    const float4 x = reinterpret_cast<const float4*>(in)[i];
    const std::uint32_t lo = cvt(x.x) | (std::uint32_t{cvt(x.y)} << 16);
    const std::uint32_t hi = cvt(x.z) | (std::uint32_t{cvt(x.w)} << 16);
    reinterpret_cast<uint2*>(out)[i] = make_uint2(lo, hi);
  }
  for (std::size_t e = 4 * nv + tid; e < n; e += stride) out[e] = cvt(in[e]);
}

template <bool Bf16>
__global__ void __launch_bounds__(block_threads)
    from_half_kernel(const std::uint16_t* __restrict__ in, float* __restrict__ out, std::size_t n, bool vec) {
  auto cvt = [](std::uint16_t h) { return Bf16 ? bfloat16_float(h) : float16_float(h); };
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t tid = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::size_t nv = vec ? n / 4 : 0;
  for (std::size_t i = tid; i < nv; i += stride) {
    const uint2 x = reinterpret_cast<const uint2*>(in)[i];
    reinterpret_cast<float4*>(out)[i] =
        make_float4(cvt(static_cast<std::uint16_t>(x.x & 0xffffu)), cvt(static_cast<std::uint16_t>(x.x >> 16)),
                    cvt(static_cast<std::uint16_t>(x.y & 0xffffu)), cvt(static_cast<std::uint16_t>(x.y >> 16)));
  }
  for (std::size_t e = 4 * nv + tid; e < n; e += stride) out[e] = cvt(in[e]);
}

template <bool Bf16>
void to_half(const float* in, std::uint16_t* out, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = aligned16(in) && (reinterpret_cast<std::uintptr_t>(out) & 7u) == 0;
  to_half_kernel<Bf16><<<grid_for(vec ? (n + 3) / 4 : n), block_threads, 0, stream>>>(in, out, n, vec);
  check_launch("psx::cuda::convert kernel launch");
}
template <bool Bf16>
void from_half(const std::uint16_t* in, float* out, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = (reinterpret_cast<std::uintptr_t>(in) & 7u) == 0 && aligned16(out);
  from_half_kernel<Bf16><<<grid_for(vec ? (n + 3) / 4 : n), block_threads, 0, stream>>>(in, out, n, vec);
  check_launch("psx::cuda::convert kernel launch");
}

// --- int8 -------------------------------------------------------------------

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// psx::quantize_int8's element: nearbyint (ties to even) of x / scale,
// clamped to [-127, 127]; NaN gives 0.
__device__ __forceinline__ std::int8_t quantize_one(float x, float scale) {
  const float r = rintf(fp::div(x, scale));
  if (r != r) return 0;
  return static_cast<std::int8_t>(fminf(fmaxf(r, -127.0f), 127.0f));
}
// psx::detail::int8_scale's scale, bit for bit (one step down where 127
// times it would be infinite: max |x| = FLT_MAX).
__device__ __forceinline__ float scale_of(float max_abs) {
  if (!(max_abs > 0.0f)) return 1.0f;
  float s = fmaxf(fp::div(max_abs, 127.0f), FLT_MIN);
  if (isfinite(s) && isinf(fp::mul(127.0f, s))) s = nextafterf(s, 0.0f);
  return s;
}

// Per tensor, pass 1: max |x| (NaN ignored, as fmax does) into *max_bits; the
// values are >= 0, so their bits order as unsigned integers.
template <class = void>
__global__ void __launch_bounds__(block_threads)
    max_abs_kernel(const float* __restrict__ x, std::size_t n, bool vec, unsigned* max_bits) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t tid = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::size_t nv = vec ? n / 4 : 0;
  float m = 0.0f;
  for (std::size_t i = tid; i < nv; i += stride) {
    const float4 v = reinterpret_cast<const float4*>(x)[i];
    m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  }
  for (std::size_t e = 4 * nv + tid; e < n; e += stride) m = fmaxf(m, fabsf(x[e]));
  using Reduce = cub::BlockReduce<float, block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  const float block_max = Reduce(temp).Reduce(m, MaxOp{});
  if (threadIdx.x == 0) atomicMax(max_bits, __float_as_uint(block_max));
}

// Per tensor, pass 2.
template <class = void>
__global__ void __launch_bounds__(block_threads)
    quantize_tensor_kernel(const float* __restrict__ x, std::size_t n, bool vec, const unsigned* max_bits,
                           std::int8_t* __restrict__ q, float* __restrict__ scales) {
  const float scale = scale_of(__uint_as_float(*max_bits));
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t tid = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (tid == 0) scales[0] = scale;
  const std::size_t nv = vec ? n / 4 : 0;
  for (std::size_t i = tid; i < nv; i += stride) {
    const float4 v = reinterpret_cast<const float4*>(x)[i];
    reinterpret_cast<char4*>(q)[i] = make_char4(quantize_one(v.x, scale), quantize_one(v.y, scale),
                                                quantize_one(v.z, scale), quantize_one(v.w, scale));
  }
  for (std::size_t e = 4 * nv + tid; e < n; e += stride) q[e] = quantize_one(x[e], scale);
}

// Per channel: one block per row (grid-stride over rows), max then quantize.
// With `vec` (width % 4 == 0, aligned), rows of up to `row_cache * 4 *
// block_threads` floats are read once, into registers; longer rows twice.
inline constexpr unsigned row_cache = 4;

template <class = void>
__global__ void __launch_bounds__(block_threads)
    quantize_rows_kernel(const float* __restrict__ x, std::size_t rows, std::size_t width, bool vec,
                         std::int8_t* __restrict__ q, float* __restrict__ scales) {
  using Reduce = cub::BlockReduce<float, block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float row_scale;
  const std::size_t c4 = vec ? width / 4 : 0;
  for (std::size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * width;
    const float4* xr4 = reinterpret_cast<const float4*>(xr);
    float4 cached[row_cache];
    float m = 0.0f;
    auto max4 = [](float a, const float4& v) {
      return fmaxf(a, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    };
#pragma unroll
    for (unsigned i = 0; i < row_cache; ++i) {
      const std::size_t c = threadIdx.x + i * block_threads;
      if (c < c4) {
        cached[i] = xr4[c];
        m = max4(m, cached[i]);
      }
    }
    for (std::size_t c = threadIdx.x + row_cache * block_threads; c < c4; c += blockDim.x) m = max4(m, xr4[c]);
    for (std::size_t j = 4 * c4 + threadIdx.x; j < width; j += blockDim.x) m = fmaxf(m, fabsf(xr[j]));
    const float row_max = Reduce(temp).Reduce(m, MaxOp{});
    if (threadIdx.x == 0) {
      row_scale = scale_of(row_max);
      scales[r] = row_scale;
    }
    __syncthreads();
    const float scale = row_scale;
    char4* qr4 = reinterpret_cast<char4*>(q + r * width);
    auto quantize4 = [scale](const float4& v) {
      return make_char4(quantize_one(v.x, scale), quantize_one(v.y, scale), quantize_one(v.z, scale),
                        quantize_one(v.w, scale));
    };
#pragma unroll
    for (unsigned i = 0; i < row_cache; ++i) {
      const std::size_t c = threadIdx.x + i * block_threads;
      if (c < c4) qr4[c] = quantize4(cached[i]);
    }
    for (std::size_t c = threadIdx.x + row_cache * block_threads; c < c4; c += blockDim.x) qr4[c] = quantize4(xr4[c]);
    for (std::size_t j = 4 * c4 + threadIdx.x; j < width; j += blockDim.x) q[r * width + j] = quantize_one(xr[j], scale);
    __syncthreads();  // temp and row_scale are reused by the next row
  }
}

template <class = void>
__global__ void __launch_bounds__(block_threads)
    dequantize_kernel(const std::int8_t* __restrict__ q, const float* __restrict__ scales, std::size_t n,
                      std::size_t width, bool per_channel, bool vec, float* __restrict__ out) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t tid = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::size_t nv = vec ? n / 4 : 0;
  for (std::size_t i = tid; i < nv; i += stride) {
    const char4 v = reinterpret_cast<const char4*>(q)[i];
    const float s = scales[per_channel ? 4 * i / width : 0];
    reinterpret_cast<float4*>(out)[i] = make_float4(fp::mul(static_cast<float>(v.x), s), fp::mul(static_cast<float>(v.y), s),
                                                    fp::mul(static_cast<float>(v.z), s), fp::mul(static_cast<float>(v.w), s));
  }
  for (std::size_t e = 4 * nv + tid; e < n; e += stride)
    out[e] = fp::mul(static_cast<float>(q[e]), scales[per_channel ? e / width : 0]);
}

}  // namespace detail

//! float32 -> bfloat16, as `psx::bfloat16::from_float` (device pointers; asynchronous).
inline void convert(const float* in, bfloat16* out, std::size_t n, cudaStream_t stream = 0) {
  detail::to_half<true>(in, reinterpret_cast<std::uint16_t*>(out), n, stream);
}
//! bfloat16 -> float32, as `psx::bfloat16::to_float`.
inline void convert(const bfloat16* in, float* out, std::size_t n, cudaStream_t stream = 0) {
  detail::from_half<true>(reinterpret_cast<const std::uint16_t*>(in), out, n, stream);
}
//! float32 -> float16, as `psx::float16::from_float`.
inline void convert(const float* in, float16* out, std::size_t n, cudaStream_t stream = 0) {
  detail::to_half<false>(in, reinterpret_cast<std::uint16_t*>(out), n, stream);
}
//! float16 -> float32, as `psx::float16::to_float`.
inline void convert(const float16* in, float* out, std::size_t n, cudaStream_t stream = 0) {
  detail::from_half<false>(reinterpret_cast<const std::uint16_t*>(in), out, n, stream);
}

//! int8 symmetric quantization of `x` (`rows x width`, row-major), as
//! `psx::quantize_int8`: one scale (`scales[0]`) or, `per_channel`, one per
//! row (`scales[0..rows)`), `scale = max(max|x| / 127, FLT_MIN)` (1 when the max is 0;
//! one step lower where 127 * scale would be infinite),
//! `q = clamp(nearbyint(x / scale), -127, 127)` with ties to even. Per
//! tensor takes stream-ordered scratch memory for the max.
inline void quantize_int8(const float* x, std::size_t rows, std::size_t width, bool per_channel, std::int8_t* q,
                          float* scales, cudaStream_t stream = 0) {
  if (width != 0 && rows > std::numeric_limits<std::size_t>::max() / width)
    throw shape_error("psx::cuda::quantize_int8: a " + std::to_string(rows) + " x " + std::to_string(width) +
                      " tensor has more values than a size_t counts");
  const std::size_t n = rows * width;
  if (per_channel) {
    if (rows == 0) return;
    const bool vec = width % 4 == 0 && detail::aligned16(x) && (reinterpret_cast<std::uintptr_t>(q) & 3u) == 0;
    const unsigned grid = detail::grid_for(rows * detail::block_threads);
    detail::quantize_rows_kernel<><<<grid, detail::block_threads, 0, stream>>>(x, rows, width, vec, q, scales);
    detail::check_launch("psx::cuda::quantize_int8 kernel launch");
    return;
  }
  const bool vec = detail::aligned16(x) && (reinterpret_cast<std::uintptr_t>(q) & 3u) == 0;
  const unsigned grid = detail::grid_for(vec ? (n + 3) / 4 : n);
  detail::Scratch scratch(sizeof(unsigned), stream);
  unsigned* max_bits = scratch.as<unsigned>();
  check(cudaMemsetAsync(max_bits, 0, sizeof(unsigned), stream), "cudaMemsetAsync");
  if (n > 0) {
    detail::max_abs_kernel<><<<grid, detail::block_threads, 0, stream>>>(x, n, vec, max_bits);
    detail::check_launch("psx::cuda::quantize_int8 max kernel launch");
  }
  detail::quantize_tensor_kernel<><<<grid, detail::block_threads, 0, stream>>>(x, n, vec, max_bits, q, scales);
  detail::check_launch("psx::cuda::quantize_int8 kernel launch");
}

//! `out[i] = q[i] * scale` of its tensor or row, as `psx::dequantize`.
inline void dequantize_int8(const std::int8_t* q, const float* scales, std::size_t rows, std::size_t width,
                            bool per_channel, float* out, cudaStream_t stream = 0) {
  const std::size_t n = rows * width;
  if (n == 0) return;
  const bool vec = (!per_channel || width % 4 == 0) && (reinterpret_cast<std::uintptr_t>(q) & 3u) == 0 &&
                   detail::aligned16(out);
  detail::dequantize_kernel<><<<detail::grid_for(vec ? (n + 3) / 4 : n), detail::block_threads, 0, stream>>>(
      q, scales, n, width, per_channel, vec, out);
  detail::check_launch("psx::cuda::dequantize_int8 kernel launch");
}

}  // namespace cuda
}  // namespace v0
}  // namespace psx
