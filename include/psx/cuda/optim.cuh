//! @file psx/cuda/optim.cuh
//! The CUDA specialization of the built-in optimizers (`psx/optim.hpp`):
//! the same `psx::optim::Adam` value updates parameters that live in device
//! memory. One fused kernel per optimizer reads and writes each array once,
//! 16 bytes at a time when every pointer is 16-byte aligned.
//!
//! Results equal the CPU's: the scalars (learning rate, bias corrections,
//! decays) are computed on the host exactly as `psx/optim.hpp` computes them
//! and rounded to float once; every element operation is rounded on its own
//! in the CPU's order (no fused multiply-adds, whatever the compiler flags).
//! The exceptions are LAMB's norms (double sums over thread blocks here,
//! float partial sums added in double on the CPU), which can move the trust
//! ratio by an ulp, and FTRL with `lr_power != -0.5`, whose power differs
//! from the C library's `powf` by at most an ulp.
//!
//!  - `update(o, w, g, slots, n, ctx, stream)`: dense update of `n` parameters;
//!  - `update_rows(o, table, slots, width, rows, grads, num_rows, ctx, stream)`:
//!    the lazy row update of a sparse push (every optimizer but LAMB).
//!
//! All pointers are device pointers; the calls are asynchronous on `stream`.
//! @code
//! psx::optim::Adam adam{.lr = 1e-3};
//! psx::UpdateContext ctx{.step = t};
//! psx::cuda::update(adam, w, g, {{m, v}, 2}, n, ctx, stream);
//! @endcode
#pragma once

#include <psx/concepts.hpp>
#include <psx/cuda/detail/launch.cuh>
#include <psx/cuda/memory.cuh>
#include <psx/errors.hpp>
#include <psx/optim.hpp>
#include <psx/schedule.hpp>

#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

namespace psx {
inline namespace v0 {
namespace cuda {

//! Device pointers of an optimizer's slots, in the order of the CPU
//! optimizer's `SlotView` (e.g. Adam: m, v, then vmax with AMSGrad); `count`
//! must equal `o.slots()`. Each slot is aligned with the parameters.
struct DeviceSlots {
  float* slot[4] = {nullptr, nullptr, nullptr, nullptr};
  std::size_t count = 0;
};

namespace detail {

template <int NS>
struct SlotPtrs {
  float* p[NS > 0 ? NS : 1];
};

template <int NS>
SlotPtrs<NS> slot_ptrs(const DeviceSlots& s) noexcept {
  SlotPtrs<NS> out{};
  for (int k = 0; k < NS; ++k) out.p[k] = s.slot[k];
  return out;
}

inline void expect_slots(const char* name, std::size_t expected, const DeviceSlots& s) {
  if (s.count != expected)
    throw shape_error(std::string("psx::cuda::update: optim::") + name + " needs " + std::to_string(expected) +
                      " slots, DeviceSlots holds " + std::to_string(s.count));
}

// Parameter index of the e-th gradient element.
struct DenseIndex {
  __device__ std::size_t operator()(std::size_t e) const { return e; }
};
struct RowIndex {
  const std::uint64_t* rows;
  std::size_t width;
  __device__ std::size_t operator()(std::size_t e) const {
    return static_cast<std::size_t>(rows[e / width]) * width + e % width;
  }
};

__device__ __forceinline__ float& lane(float4& v, int c) { return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w; }

// One element-wise pass: Op updates (w, g, slots) of one element. With
// `vec`, groups of 4 gradient elements map to 4 contiguous 16-byte aligned
// parameters (dense, or rows whose width is a multiple of 4).
template <class Op, class Index>
__global__ void __launch_bounds__(block_threads)
    elementwise_kernel(Op op, float* w, const float* __restrict__ g, SlotPtrs<Op::slots> s, std::size_t n,
                       Index index, bool vec) {
  constexpr int ns = Op::slots;
  constexpr int na = ns > 0 ? ns : 1;
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t tid = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::size_t nv = vec ? n / 4 : 0;
  for (std::size_t i = tid; i < nv; i += stride) {
    const std::size_t e = 4 * i, p = index(e);
    float4 w4 = *reinterpret_cast<const float4*>(w + p);
    float4 g4 = *reinterpret_cast<const float4*>(g + e);
    float4 s4[na];
#pragma unroll
    for (int k = 0; k < ns; ++k) s4[k] = *reinterpret_cast<const float4*>(s.p[k] + p);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float sl[na];
#pragma unroll
      for (int k = 0; k < ns; ++k) sl[k] = lane(s4[k], c);
      op(lane(w4, c), lane(g4, c), sl);
#pragma unroll
      for (int k = 0; k < ns; ++k) lane(s4[k], c) = sl[k];
    }
    *reinterpret_cast<float4*>(w + p) = w4;
#pragma unroll
    for (int k = 0; k < ns; ++k) *reinterpret_cast<float4*>(s.p[k] + p) = s4[k];
  }
  for (std::size_t e = 4 * nv + tid; e < n; e += stride) {
    const std::size_t p = index(e);
    float wl = w[p];
    float sl[na];
#pragma unroll
    for (int k = 0; k < ns; ++k) sl[k] = s.p[k][p];
    op(wl, g[e], sl);
    w[p] = wl;
#pragma unroll
    for (int k = 0; k < ns; ++k) s.p[k][p] = sl[k];
  }
}

template <class Op, class Index>
void launch_elementwise(const Op& op, float* w, const float* g, const DeviceSlots& s, std::size_t n, Index index,
                        bool vec_ok, cudaStream_t stream) {
  if (n == 0) return;
  bool vec = vec_ok && aligned16(w) && aligned16(g);
  for (int k = 0; k < Op::slots; ++k) vec = vec && aligned16(s.slot[k]);
  const unsigned grid = grid_for(vec ? (n + 3) / 4 : n);
  elementwise_kernel<<<grid, block_threads, 0, stream>>>(op, w, g, slot_ptrs<Op::slots>(s), n, index, vec);
  check_launch("psx::cuda optimizer kernel launch");
}

// --- element operations: psx/optim.hpp's loops, operation for operation ----

struct SgdPlainOp {
  static constexpr int slots = 0;
  float neg_lr, wd;
  __device__ void operator()(float& w, float g, float*) const {
    const float d = wd != 0.0f ? fp::add(g, fp::mul(wd, w)) : g;
    w = fp::add(w, fp::mul(neg_lr, d));
  }
};

struct SgdMomentumOp {
  static constexpr int slots = 1;
  float neg_lr, wd, mu, keep;
  bool first, nesterov;
  __device__ void operator()(float& w, float g, float* s) const {
    const float d = wd != 0.0f ? fp::add(g, fp::mul(wd, w)) : g;
    s[0] = first ? d : fp::add(fp::mul(s[0], mu), fp::mul(keep, d));
    const float step = nesterov ? fp::add(d, fp::mul(mu, s[0])) : s[0];
    w = fp::add(w, fp::mul(neg_lr, step));
  }
};

struct AdagradOp {
  static constexpr int slots = 1;
  float neg_clr, wd, eps;
  __device__ void operator()(float& w, float g, float* s) const {
    const float d = wd != 0.0f ? fp::add(g, fp::mul(wd, w)) : g;
    s[0] = fp::add(s[0], fp::mul(d, d));
    const float stdev = fp::add(fp::sqrt(s[0]), eps);
    w = fp::add(w, fp::div(fp::mul(neg_clr, d), stdev));
  }
};

template <bool Centered, bool Momentum>
struct RmspropOp {
  static constexpr int slots = 1 + (Centered ? 1 : 0) + (Momentum ? 1 : 0);
  float neg_lr, a, one_minus_a, wd, eps, mu;
  __device__ void operator()(float& w, float g, float* s) const {
    const float d = wd != 0.0f ? fp::add(g, fp::mul(wd, w)) : g;
    s[0] = fp::add(fp::mul(s[0], a), fp::mul(fp::mul(one_minus_a, d), d));
    float avg;
    if constexpr (Centered) {
      s[1] = fp::add(fp::mul(s[1], a), fp::mul(one_minus_a, d));
      avg = fp::add(fp::sqrt(fp::add(s[0], fp::mul(fp::mul(-1.0f, s[1]), s[1]))), eps);
    } else {
      avg = fp::add(fp::sqrt(s[0]), eps);
    }
    if constexpr (Momentum) {
      constexpr int b = Centered ? 2 : 1;
      s[b] = fp::add(fp::mul(s[b], mu), fp::div(d, avg));
      w = fp::add(w, fp::mul(neg_lr, s[b]));
    } else {
      w = fp::add(w, fp::div(fp::mul(neg_lr, d), avg));
    }
  }
};

// torch.optim.Adam / AdamW (dense).
template <bool Amsgrad>
struct AdamDenseOp {
  static constexpr int slots = Amsgrad ? 3 : 2;
  float neg_step, bc2_sqrt, b1, b2, one_minus_b1, one_minus_b2, eps, wd, shrink;
  bool shrink_on;
  __device__ void operator()(float& w, float g, float* s) const {
    if (shrink_on) w = fp::mul(w, shrink);
    const float d = wd != 0.0f ? fp::add(g, fp::mul(wd, w)) : g;
    s[0] = fp::add(fp::mul(s[0], b1), fp::mul(one_minus_b1, d));
    s[1] = fp::add(fp::mul(s[1], b2), fp::mul(fp::mul(one_minus_b2, d), d));
    float root;
    if constexpr (Amsgrad) {
      s[2] = s[2] >= s[1] ? s[2] : s[1];  // as the CPU (torch.maximum): NaN in v propagates
      root = fp::sqrt(s[2]);
    } else {
      root = fp::sqrt(s[1]);
    }
    const float denom = fp::add(fp::div(root, bc2_sqrt), eps);
    w = fp::add(w, fp::div(fp::mul(neg_step, s[0]), denom));
  }
};

// torch.optim.SparseAdam (rows).
template <bool Amsgrad>
struct AdamRowsOp {
  static constexpr int slots = Amsgrad ? 3 : 2;
  float neg_step, one_minus_b1, one_minus_b2, eps, wd, shrink;
  bool shrink_on;
  __device__ void operator()(float& w, float g, float* s) const {
    if (shrink_on) w = fp::mul(w, shrink);
    const float d = wd != 0.0f ? fp::add(g, fp::mul(wd, w)) : g;
    s[0] = fp::add(s[0], fp::mul(fp::sub(d, s[0]), one_minus_b1));
    s[1] = fp::add(s[1], fp::mul(fp::sub(fp::mul(d, d), s[1]), one_minus_b2));
    float root;
    if constexpr (Amsgrad) {
      s[2] = s[2] >= s[1] ? s[2] : s[1];  // as the CPU (torch.maximum): NaN in v propagates
      root = fp::sqrt(s[2]);
    } else {
      root = fp::sqrt(s[1]);
    }
    w = fp::add(w, fp::mul(neg_step, fp::div(s[0], fp::add(root, eps))));
  }
};

struct FtrlOp {
  static constexpr int slots = 2;
  float lr, l1, two_l2, power;
  bool sqrt_power;
  __device__ float root(float x) const {
    // powf on the device may be 2 ulp off; the double power rounded once is
    // within an ulp of the C library's powf.
    return sqrt_power ? fp::sqrt(x) : static_cast<float>(::pow(static_cast<double>(x), static_cast<double>(power)));
  }
  __device__ void operator()(float& w, float g, float* s) const {
    const float acc_new = fp::add(s[0], fp::mul(g, g));
    const float root_new = root(acc_new);
    s[1] = fp::add(s[1], fp::sub(g, fp::mul(fp::div(fp::sub(root_new, root(s[0])), lr), w)));
    const float quadratic = fp::add(fp::div(root_new, lr), two_l2);
    const float z = s[1];
    const float sign = z > 0.0f ? 1.0f : z < 0.0f ? -1.0f : 0.0f;
    w = fabsf(z) > l1 ? fp::div(fp::sub(fp::mul(sign, l1), z), quadratic) : 0.0f;
    s[0] = acc_new;
  }
};

// --- host side: the scalars, as psx/optim.hpp computes them -----------------

template <class F>
void with_op(const optim::SGD& o, const UpdateContext& ctx, F&& f) {
  const float neg_lr = static_cast<float>(-optim::detail::effective_lr(o.lr, ctx));
  const float wd = static_cast<float>(o.weight_decay);
  if (o.momentum == 0.0) return f(SgdPlainOp{neg_lr, wd});
  f(SgdMomentumOp{neg_lr, wd, static_cast<float>(o.momentum), static_cast<float>(1.0 - o.dampening),
                  !ctx.rows && ctx.step == 1, o.nesterov});
}

template <class F>
void with_op(const optim::Adagrad& o, const UpdateContext& ctx, F&& f) {
  const double clr = optim::detail::effective_lr(o.lr, ctx) /
                     (1.0 + static_cast<double>(optim::detail::t_of(ctx) - 1) * o.lr_decay);
  f(AdagradOp{static_cast<float>(-clr), static_cast<float>(o.weight_decay), static_cast<float>(o.eps)});
}

template <class F>
void with_op(const optim::RMSProp& o, const UpdateContext& ctx, F&& f) {
  const float neg_lr = static_cast<float>(-optim::detail::effective_lr(o.lr, ctx));
  const float a = static_cast<float>(o.alpha), one_minus_a = static_cast<float>(1.0 - o.alpha);
  const float wd = static_cast<float>(o.weight_decay), e = static_cast<float>(o.eps);
  const float mu = static_cast<float>(o.momentum);
  const bool momentum = o.momentum > 0.0;
  if (o.centered && momentum) f(RmspropOp<true, true>{neg_lr, a, one_minus_a, wd, e, mu});
  else if (o.centered) f(RmspropOp<true, false>{neg_lr, a, one_minus_a, wd, e, mu});
  else if (momentum) f(RmspropOp<false, true>{neg_lr, a, one_minus_a, wd, e, mu});
  else f(RmspropOp<false, false>{neg_lr, a, one_minus_a, wd, e, mu});
}

template <class F>
void with_adam_op(const optim::detail::AdamCore& c, const UpdateContext& ctx, F&& f) {
  const double lr_t = optim::detail::effective_lr(c.lr, ctx);
  const float one_minus_b1 = static_cast<float>(1.0 - c.beta1), one_minus_b2 = static_cast<float>(1.0 - c.beta2);
  const float e = static_cast<float>(c.eps);
  const float wd = c.decoupled ? 0.0f : static_cast<float>(c.weight_decay);
  const float shrink = static_cast<float>(1.0 - lr_t * c.weight_decay);
  const bool shrink_on = c.decoupled && c.weight_decay != 0.0;
  if (ctx.rows) {
    const double bc1 = optim::detail::bias_correction(c.beta1, ctx.global_step);
    const double bc2 = optim::detail::bias_correction(c.beta2, ctx.global_step);
    const float neg_step = static_cast<float>(-(lr_t * std::sqrt(bc2) / bc1));
    if (c.amsgrad) f(AdamRowsOp<true>{neg_step, one_minus_b1, one_minus_b2, e, wd, shrink, shrink_on});
    else f(AdamRowsOp<false>{neg_step, one_minus_b1, one_minus_b2, e, wd, shrink, shrink_on});
    return;
  }
  const double bc1 = optim::detail::bias_correction(c.beta1, ctx.step);
  const double bc2 = optim::detail::bias_correction(c.beta2, ctx.step);
  const float neg_step = static_cast<float>(-(lr_t / bc1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float b1 = static_cast<float>(c.beta1), b2 = static_cast<float>(c.beta2);
  if (c.amsgrad)
    f(AdamDenseOp<true>{neg_step, bc2_sqrt, b1, b2, one_minus_b1, one_minus_b2, e, wd, shrink, shrink_on});
  else
    f(AdamDenseOp<false>{neg_step, bc2_sqrt, b1, b2, one_minus_b1, one_minus_b2, e, wd, shrink, shrink_on});
}

template <class F>
void with_op(const optim::Adam& o, const UpdateContext& ctx, F&& f) {
  with_adam_op({o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.amsgrad, false}, ctx, f);
}
template <class F>
void with_op(const optim::AdamW& o, const UpdateContext& ctx, F&& f) {
  with_adam_op({o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.amsgrad, true}, ctx, f);
}

template <class F>
void with_op(const optim::Ftrl& o, const UpdateContext& ctx, F&& f) {
  f(FtrlOp{static_cast<float>(optim::detail::effective_lr(o.lr, ctx)), static_cast<float>(o.l1),
           static_cast<float>(2.0 * o.l2), static_cast<float>(-o.lr_power), o.lr_power == -0.5});
}

template <class O>
void dense(const char* name, const O& o, float* w, const float* g, const DeviceSlots& s, std::size_t n,
           const UpdateContext& ctx, cudaStream_t stream) {
  expect_slots(name, o.slots(), s);
  with_op(o, ctx, [&](const auto& op) { launch_elementwise(op, w, g, s, n, DenseIndex{}, true, stream); });
}

template <class O>
void rows(const char* name, const O& o, float* table, const DeviceSlots& s, std::size_t width,
          const std::uint64_t* row_ids, const float* grads, std::size_t num_rows, const UpdateContext& ctx,
          cudaStream_t stream) {
  expect_slots(name, o.slots(), s);
  if (width == 0 || num_rows == 0) return;
  with_op(o, ctx, [&](const auto& op) {
    launch_elementwise(op, table, grads, s, num_rows * width, RowIndex{row_ids, width}, width % 4 == 0, stream);
  });
}

// --- LAMB: moments and norms, trust ratio, update -------------------------

struct LambParams {
  float inv_bc1, inv_bc2, b1, b2, one_minus_b1, one_minus_b2, eps, wd;
  __device__ float r(float w, float m, float v) const {
    return fp::add(fp::div(fp::mul(m, inv_bc1), fp::add(fp::sqrt(fp::mul(v, inv_bc2)), eps)), fp::mul(wd, w));
  }
};

struct Sum2 {
  __device__ double2 operator()(const double2& a, const double2& b) const {
    return make_double2(fp::dadd(a.x, b.x), fp::dadd(a.y, b.y));
  }
};

// Pass 1: m and v, and each block's sums of w^2 and r^2 (double) in `partials`.
template <class = void>
__global__ void __launch_bounds__(block_threads)
    lamb_moments_kernel(LambParams p, const float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                        float* __restrict__ v, std::size_t n, bool vec, double2* partials) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t tid = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::size_t nv = vec ? n / 4 : 0;
  double2 acc = make_double2(0.0, 0.0);
  auto one = [&](float wi, float gi, float& mi, float& vi) {
    mi = fp::add(fp::mul(mi, p.b1), fp::mul(p.one_minus_b1, gi));
    vi = fp::add(fp::mul(vi, p.b2), fp::mul(fp::mul(p.one_minus_b2, gi), gi));
    const float r = p.r(wi, mi, vi);
    acc.x = fp::dadd(acc.x, fp::dmul(static_cast<double>(wi), static_cast<double>(wi)));
    acc.y = fp::dadd(acc.y, fp::dmul(static_cast<double>(r), static_cast<double>(r)));
  };
  for (std::size_t i = tid; i < nv; i += stride) {
    const float4 w4 = reinterpret_cast<const float4*>(w)[i];
    const float4 g4 = reinterpret_cast<const float4*>(g)[i];
    float4 m4 = reinterpret_cast<const float4*>(m)[i];
    float4 v4 = reinterpret_cast<const float4*>(v)[i];
    one(w4.x, g4.x, m4.x, v4.x);
    one(w4.y, g4.y, m4.y, v4.y);
    one(w4.z, g4.z, m4.z, v4.z);
    one(w4.w, g4.w, m4.w, v4.w);
    reinterpret_cast<float4*>(m)[i] = m4;
    reinterpret_cast<float4*>(v)[i] = v4;
  }
  for (std::size_t e = 4 * nv + tid; e < n; e += stride) {
    float mi = m[e], vi = v[e];
    one(w[e], g[e], mi, vi);
    m[e] = mi;
    v[e] = vi;
  }
  using Reduce = cub::BlockReduce<double2, block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  const double2 total = Reduce(temp).Reduce(acc, Sum2{});
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Pass 2: the blocks' sums in a fixed order, then `lr * ratio` as the CPU rounds it.
template <class = void>
__global__ void __launch_bounds__(block_threads)
    lamb_ratio_kernel(const double2* partials, unsigned blocks, float neg_lr, float* scale) {
  double2 acc = make_double2(0.0, 0.0);
  for (unsigned i = threadIdx.x; i < blocks; i += blockDim.x) acc = Sum2{}(acc, partials[i]);
  using Reduce = cub::BlockReduce<double2, block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  const double2 total = Reduce(temp).Reduce(acc, Sum2{});
  if (threadIdx.x == 0) {
    const float w_norm = __double2float_rn(__dsqrt_rn(total.x)), r_norm = __double2float_rn(__dsqrt_rn(total.y));
    const float ratio = w_norm > 0.0f && r_norm > 0.0f ? fp::div(w_norm, r_norm) : 1.0f;
    *scale = fp::mul(neg_lr, ratio);
  }
}

// Pass 3: w += scale * r, with r recomputed from the new m and v.
template <class = void>
__global__ void __launch_bounds__(block_threads)
    lamb_apply_kernel(LambParams p, float* __restrict__ w, const float* __restrict__ m, const float* __restrict__ v,
                      std::size_t n, bool vec, const float* scale_ptr) {
  const float scale = *scale_ptr;
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  const std::size_t tid = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const std::size_t nv = vec ? n / 4 : 0;
  for (std::size_t i = tid; i < nv; i += stride) {
    float4 w4 = reinterpret_cast<const float4*>(w)[i];
    const float4 m4 = reinterpret_cast<const float4*>(m)[i];
    const float4 v4 = reinterpret_cast<const float4*>(v)[i];
    w4.x = fp::add(w4.x, fp::mul(scale, p.r(w4.x, m4.x, v4.x)));
    w4.y = fp::add(w4.y, fp::mul(scale, p.r(w4.y, m4.y, v4.y)));
    w4.z = fp::add(w4.z, fp::mul(scale, p.r(w4.z, m4.z, v4.z)));
    w4.w = fp::add(w4.w, fp::mul(scale, p.r(w4.w, m4.w, v4.w)));
    reinterpret_cast<float4*>(w)[i] = w4;
  }
  for (std::size_t e = 4 * nv + tid; e < n; e += stride) w[e] = fp::add(w[e], fp::mul(scale, p.r(w[e], m[e], v[e])));
}

//! Names the optimizer in the error of the generic entries below.
template <class O>
struct no_cuda_specialization_for : std::false_type {};

}  // namespace detail

//! Dense SGD (momentum, Nesterov, weight decay, first-step rule), as `optim::SGD::update`.
inline void update(const optim::SGD& o, float* w, const float* g, DeviceSlots slots, std::size_t n,
                   const UpdateContext& ctx, cudaStream_t stream = 0) {
  detail::dense("SGD", o, w, g, slots, n, ctx, stream);
}
//! Dense Adagrad, as `optim::Adagrad::update`.
inline void update(const optim::Adagrad& o, float* w, const float* g, DeviceSlots slots, std::size_t n,
                   const UpdateContext& ctx, cudaStream_t stream = 0) {
  detail::dense("Adagrad", o, w, g, slots, n, ctx, stream);
}
//! Dense RMSProp (plain or centered, with or without momentum), as `optim::RMSProp::update`.
inline void update(const optim::RMSProp& o, float* w, const float* g, DeviceSlots slots, std::size_t n,
                   const UpdateContext& ctx, cudaStream_t stream = 0) {
  detail::dense("RMSProp", o, w, g, slots, n, ctx, stream);
}
//! Dense Adam (AMSGrad), as `optim::Adam::update`; SparseAdam's formula when `ctx.rows`.
inline void update(const optim::Adam& o, float* w, const float* g, DeviceSlots slots, std::size_t n,
                   const UpdateContext& ctx, cudaStream_t stream = 0) {
  detail::dense("Adam", o, w, g, slots, n, ctx, stream);
}
//! Dense AdamW (AMSGrad), as `optim::AdamW::update`.
inline void update(const optim::AdamW& o, float* w, const float* g, DeviceSlots slots, std::size_t n,
                   const UpdateContext& ctx, cudaStream_t stream = 0) {
  detail::dense("AdamW", o, w, g, slots, n, ctx, stream);
}
//! Dense FTRL-Proximal, as `optim::Ftrl::update`.
inline void update(const optim::Ftrl& o, float* w, const float* g, DeviceSlots slots, std::size_t n,
                   const UpdateContext& ctx, cudaStream_t stream = 0) {
  if (!o.applies(ctx)) return;  // as the CPU: learning rate 0 changes nothing
  detail::dense("Ftrl", o, w, g, slots, n, ctx, stream);
}

//! LAMB over the `n` parameters as one layer, as `optim::Lamb::update`: a
//! pass updating m, v and the double sums of w^2 and r^2, a one-block pass
//! for the trust ratio, and a pass applying `w += -lr * ratio * r` with r
//! recomputed. Takes stream-ordered scratch memory (cudaMallocAsync).
inline void update(const optim::Lamb& o, float* w, const float* g, DeviceSlots slots, std::size_t n,
                   const UpdateContext& ctx, cudaStream_t stream = 0) {
  detail::expect_slots("Lamb", o.slots(), slots);
  if (n == 0) return;
  const detail::LambParams p{static_cast<float>(1.0 / optim::detail::bias_correction(o.beta1, ctx.step)),
                             static_cast<float>(1.0 / optim::detail::bias_correction(o.beta2, ctx.step)),
                             static_cast<float>(o.beta1),
                             static_cast<float>(o.beta2),
                             static_cast<float>(1.0 - o.beta1),
                             static_cast<float>(1.0 - o.beta2),
                             static_cast<float>(o.eps),
                             static_cast<float>(o.weight_decay)};
  const float neg_lr = static_cast<float>(-optim::detail::effective_lr(o.lr, ctx));
  float* m = slots.slot[0];
  float* v = slots.slot[1];
  const bool vec = detail::aligned16(w) && detail::aligned16(g) && detail::aligned16(m) && detail::aligned16(v);
  const unsigned grid = detail::grid_for(vec ? (n + 3) / 4 : n);
  detail::Scratch scratch(grid * sizeof(double2) + sizeof(float), stream);
  double2* partials = scratch.as<double2>();
  float* scale = scratch.as<float>(grid * sizeof(double2));
  detail::lamb_moments_kernel<><<<grid, detail::block_threads, 0, stream>>>(p, w, g, m, v, n, vec, partials);
  detail::check_launch("psx::cuda LAMB moments kernel launch");
  detail::lamb_ratio_kernel<><<<1, detail::block_threads, 0, stream>>>(partials, grid, neg_lr, scale);
  detail::check_launch("psx::cuda LAMB trust-ratio kernel launch");
  detail::lamb_apply_kernel<><<<grid, detail::block_threads, 0, stream>>>(p, w, m, v, n, vec, scale);
  detail::check_launch("psx::cuda LAMB apply kernel launch");
}

//! A scheduled optimizer: `ctx.lr_scale` times the schedule at `global_step - 1`, as `optim::Scheduled::update`.
template <class O, class S>
void update(const optim::Scheduled<O, S>& o, float* w, const float* g, DeviceSlots slots, std::size_t n,
            const UpdateContext& ctx, cudaStream_t stream = 0) {
  update(o.optimizer, w, g, slots, n, o.scaled(ctx), stream);
}

//! Any other optimizer: a compile-time error naming it.
template <class O>
void update(const O&, float*, const float*, DeviceSlots, std::size_t, const UpdateContext&, cudaStream_t = 0) {
  static_assert(detail::no_cuda_specialization_for<O>::value,
                "psx::cuda::update: this optimizer (O, named in the instantiation below) has no CUDA "
                "specialization; psx/cuda/optim.cuh has SGD, Adagrad, RMSProp, Adam, AdamW, Ftrl, Lamb and "
                "optim::Scheduled of them. Write 'void update(const YourOptimizer&, float* w, const float* g, "
                "psx::cuda::DeviceSlots, std::size_t n, const psx::UpdateContext&, cudaStream_t)' in namespace "
                "psx::cuda, or update on the host.");
}

//! The lazy row update of a sparse push, as the CPU applies `o.update` to
//! each row with `ctx.rows` set: rows `rows[0..num_rows)` of `table`
//! (`[*, width]`, row-major) and of its slots take gradient rows
//! `grads[k * width ..]`; nothing else changes. `rows` must be distinct
//! (`RowDedup` makes them so) and inside the table; neither is checked.
//! Vectorized when `width % 4 == 0` and the pointers are 16-byte aligned.
inline void update_rows(const optim::SGD& o, float* table, DeviceSlots slots, std::size_t width,
                        const std::uint64_t* rows, const float* grads, std::size_t num_rows, const UpdateContext& ctx,
                        cudaStream_t stream = 0) {
  detail::rows("SGD", o, table, slots, width, rows, grads, num_rows, ctx, stream);
}
//! Row update for Adagrad (see the SGD overload).
inline void update_rows(const optim::Adagrad& o, float* table, DeviceSlots slots, std::size_t width,
                        const std::uint64_t* rows, const float* grads, std::size_t num_rows, const UpdateContext& ctx,
                        cudaStream_t stream = 0) {
  detail::rows("Adagrad", o, table, slots, width, rows, grads, num_rows, ctx, stream);
}
//! Row update for RMSProp (see the SGD overload).
inline void update_rows(const optim::RMSProp& o, float* table, DeviceSlots slots, std::size_t width,
                        const std::uint64_t* rows, const float* grads, std::size_t num_rows, const UpdateContext& ctx,
                        cudaStream_t stream = 0) {
  detail::rows("RMSProp", o, table, slots, width, rows, grads, num_rows, ctx, stream);
}
//! Row update for Adam: `torch.optim.SparseAdam` with t = `ctx.global_step` (see the SGD overload).
inline void update_rows(const optim::Adam& o, float* table, DeviceSlots slots, std::size_t width,
                        const std::uint64_t* rows, const float* grads, std::size_t num_rows, const UpdateContext& ctx,
                        cudaStream_t stream = 0) {
  detail::rows("Adam", o, table, slots, width, rows, grads, num_rows, ctx, stream);
}
//! Row update for AdamW: decay, then SparseAdam (see the SGD overload).
inline void update_rows(const optim::AdamW& o, float* table, DeviceSlots slots, std::size_t width,
                        const std::uint64_t* rows, const float* grads, std::size_t num_rows, const UpdateContext& ctx,
                        cudaStream_t stream = 0) {
  detail::rows("AdamW", o, table, slots, width, rows, grads, num_rows, ctx, stream);
}
//! Row update for FTRL: TensorFlow's sparse kernel (see the SGD overload).
inline void update_rows(const optim::Ftrl& o, float* table, DeviceSlots slots, std::size_t width,
                        const std::uint64_t* rows, const float* grads, std::size_t num_rows, const UpdateContext& ctx,
                        cudaStream_t stream = 0) {
  if (!o.applies(ctx)) return;
  detail::rows("Ftrl", o, table, slots, width, rows, grads, num_rows, ctx, stream);
}

//! Row update for a scheduled optimizer (see the SGD overload).
template <class O, class S>
void update_rows(const optim::Scheduled<O, S>& o, float* table, DeviceSlots slots, std::size_t width,
                 const std::uint64_t* rows, const float* grads, std::size_t num_rows, const UpdateContext& ctx,
                 cudaStream_t stream = 0) {
  update_rows(o.optimizer, table, slots, width, rows, grads, num_rows, o.scaled(ctx), stream);
}

//! Any other optimizer (LAMB included: a row is not a layer): a compile-time error naming it.
template <class O>
void update_rows(const O&, float*, DeviceSlots, std::size_t, const std::uint64_t*, const float*, std::size_t,
                 const UpdateContext&, cudaStream_t = 0) {
  static_assert(detail::no_cuda_specialization_for<O>::value,
                "psx::cuda::update_rows: this optimizer (O, named in the instantiation below) has no "
                "CUDA row update; psx/cuda/optim.cuh has SGD, Adagrad, RMSProp, Adam, AdamW, Ftrl and "
                "optim::Scheduled of them (LAMB refuses sparse variables: a row is not a layer).");
}

}  // namespace cuda
}  // namespace v0
}  // namespace psx
