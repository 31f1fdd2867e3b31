//! @file psx/cuda/aggregate.cuh
//! Aggregation of k workers' gradients on the device, in worker order, with
//! the same floats as the CPU server: `sum = g0; sum += g1; ...; sum += g(k-1)`
//! then, for a mean, `sum /= count` (a division, as
//! `sync::detail::ClockedSteps::finish` does, not a multiplication by 1/k).
#pragma once

#include <psx/cuda/detail/launch.cuh>
#include <psx/cuda/memory.cuh>
#include <psx/errors.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace psx {
inline namespace v0 {
namespace cuda {

namespace detail {

// Gradients summed per launch; more are summed in further launches that
// continue from `out`, which holds the exact float partial sum.
inline constexpr int aggregate_fan_in = 16;

struct GradPtrs {
  const float* p[aggregate_fan_in];
  int count;
};

template <class = void>
__global__ void __launch_bounds__(block_threads)
    aggregate_kernel(GradPtrs gp, bool from_out, float* out, std::size_t n, float divisor, bool divide, bool vec) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t tid = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::size_t nv = vec ? n / 4 : 0;
  const int first = from_out ? 0 : 1;
  for (std::size_t i = tid; i < nv; i += stride) {
    float4 x[aggregate_fan_in];
#pragma unroll
    for (int j = 0; j < aggregate_fan_in; ++j)
      if (j < gp.count) x[j] = reinterpret_cast<const float4*>(gp.p[j])[i];
    float4 acc = from_out ? reinterpret_cast<const float4*>(out)[i] : x[0];
#pragma unroll
    for (int j = 0; j < aggregate_fan_in; ++j) {
      if (j >= first && j < gp.count) {
        acc.x = fp::add(acc.x, x[j].x);
        acc.y = fp::add(acc.y, x[j].y);
        acc.z = fp::add(acc.z, x[j].z);
        acc.w = fp::add(acc.w, x[j].w);
      }
    }
    if (divide) {
      acc.x = fp::div(acc.x, divisor);
      acc.y = fp::div(acc.y, divisor);
      acc.z = fp::div(acc.z, divisor);
      acc.w = fp::div(acc.w, divisor);
    }
    reinterpret_cast<float4*>(out)[i] = acc;
  }
  for (std::size_t e = 4 * nv + tid; e < n; e += stride) {
    float acc = from_out ? out[e] : gp.p[0][e];
    for (int j = first; j < gp.count; ++j) acc = fp::add(acc, gp.p[j][e]);
    out[e] = divide ? fp::div(acc, divisor) : acc;
  }
}

}  // namespace detail

//! `out[i] = (((g0[i] + g1[i]) + g2[i]) + ... + g(k-1)[i]) / divisor` for
//! `i < n`: `grads` is a host array of `k >= 1` device pointers, summed in
//! worker order; `divisor` is 1 for `Aggregate::sum` (no division is made)
//! and the number of contributions for `Aggregate::mean`. Bit-identical to
//! the CPU server's aggregate. `out` may be one of the gradients only if it
//! is `grads[0]`. Asynchronous on `stream`.
inline void aggregate(const float* const* grads, std::size_t k, std::size_t n, float* out, float divisor,
                      cudaStream_t stream = 0) {
  if (k == 0) throw shape_error("psx::cuda::aggregate: no gradients to aggregate (k = 0)");
  if (n == 0) return;
  bool vec = detail::aligned16(out);
  for (std::size_t j = 0; j < k; ++j) vec = vec && detail::aligned16(grads[j]);
  const unsigned grid = detail::grid_for(vec ? (n + 3) / 4 : n);
  for (std::size_t done = 0; done < k;) {
    detail::GradPtrs gp{};
    const std::size_t take = k - done < detail::aggregate_fan_in ? k - done : detail::aggregate_fan_in;
    for (std::size_t j = 0; j < take; ++j) gp.p[j] = grads[done + j];
    gp.count = static_cast<int>(take);
    const bool last = done + take == k;
    detail::aggregate_kernel<><<<grid, detail::block_threads, 0, stream>>>(gp, done > 0, out, n, divisor,
                                                                         last && divisor != 1.0f, vec);
    detail::check_launch("psx::cuda::aggregate kernel launch");
    done += take;
  }
}

}  // namespace cuda
}  // namespace v0
}  // namespace psx
