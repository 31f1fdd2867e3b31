//! @file psx/optim.hpp
//! Built-in optimizers. The concept is `psx::Optimizer` in `psx/concepts.hpp`;
//! `docs/optimizers.md` gives every formula, the reference each one matches
//! and its memory per parameter.
//!
//! Conventions shared by every optimizer here:
//!  - hyper-parameters are `double`, as in the Python references; element
//!    arithmetic is float32 with the scalars rounded to float once, as
//!    PyTorch's CPU kernels do, and bias corrections are computed in double;
//!  - the learning rate used is `lr * ctx.lr_scale` (sync policy and
//!    schedule factors, see `psx/schedule.hpp`);
//!  - `t`, of bias corrections, learning-rate decay and first-step rules, is
//!    `ctx.step` (updates applied to the shard) for dense pushes and
//!    `ctx.global_step` for row pushes, which may leave a shard untouched
//!    for steps (PyTorch's SparseAdam counts optimizer steps too);
//!  - the loops vectorize when math functions need not set errno: the CMake
//!    target psx::psx adds -fno-math-errno (g++, clang); without it, std::sqrt
//!    keeps them scalar (about 2.5x slower for Adam);
//!  - a row push (`ctx.rows`) is lazy: only the pushed rows and their slots
//!    change. Every optimizer but Adam applies the same formula to a row as to
//!    a dense element; Adam follows `torch.optim.SparseAdam` for rows.
#pragma once

#include <psx/concepts.hpp>
#include <psx/errors.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <ostream>
#include <span>
#include <string>

namespace psx {
inline namespace v0 {
namespace optim {

namespace detail {

// Calls `f` with one std::bool_constant per runtime flag, so that the loop
// `f` runs has no branch inside and vectorizes.
template <class F>
void with_flags(F&& f) {
  f();
}
template <class F, class... Rest>
void with_flags(F&& f, bool flag, Rest... rest) {
  if (flag) with_flags([&](auto... c) { f(std::true_type{}, c...); }, rest...);
  else with_flags([&](auto... c) { f(std::false_type{}, c...); }, rest...);
}

inline double effective_lr(double lr, const UpdateContext& ctx) noexcept { return lr * ctx.lr_scale; }

// Refuses a hyper-parameter, as PyTorch's constructors do (ValueError there,
// config_error at `declare` here), naming the optimizer, the variable and
// the rule.
inline void require(bool ok, const char* optimizer, const VariableMeta& v, const char* rule) {
  if (!ok)
    throw config_error(std::string("psx: optim::") + optimizer + " for '" + v.name + "': needs " + rule);
}
inline bool is_beta(double b) noexcept { return b >= 0.0 && b < 1.0; }

// The `t` of bias corrections, learning-rate decay and first-step rules: the
// shard's update count for dense pushes, the global step for row pushes
// (a shard's rows may go untouched for steps; PyTorch's SparseAdam and
// TensorFlow's lazy optimizers count optimizer steps, not row updates).
inline std::uint64_t t_of(const UpdateContext& ctx) noexcept { return ctx.rows ? ctx.global_step : ctx.step; }

// `1 - beta^t`, in double as Python computes it.
inline double bias_correction(double beta, std::uint64_t t) noexcept {
  return 1.0 - std::pow(beta, static_cast<double>(t));
}

}  // namespace detail

//! Bytes the server holds per parameter with optimizer `o`: the float32
//! parameter plus its slots.
template <Optimizer O>
constexpr std::size_t bytes_per_parameter(const O& o) noexcept {
  return sizeof(float) * (1 + o.slots());
}

// ---------------------------------------------------------------------------
// SGD
// ---------------------------------------------------------------------------

//! Stochastic gradient descent with optional momentum, dampening, Nesterov
//! momentum and L2 weight decay; follows `torch.optim.SGD` (PyTorch 1.13):
//!
//!     g += weight_decay * w
//!     b  = (t == 1) ? g : momentum * b + (1 - dampening) * g     (momentum != 0)
//!     g  = nesterov ? g + momentum * b : b                       (momentum != 0)
//!     w -= lr * g
//!
//! One slot (the momentum buffer) when `momentum != 0`, none otherwise.
//! Rows: the buffer starts at 0 and is always `momentum * b + (1 - dampening) * g`,
//! so a row's first push gives `b = (1 - dampening) * g` (PyTorch's rule when
//! dampening is 0; PyTorch's sparse SGD has no momentum).
struct SGD {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;

  std::size_t slots() const noexcept { return momentum != 0.0 ? 1 : 0; }

  void validate(const VariableMeta& v, std::size_t) const {
    detail::require(lr >= 0.0 && momentum >= 0.0 && weight_decay >= 0.0, "SGD", v,
                    "lr, momentum and weight_decay >= 0");
    detail::require(!std::isnan(dampening), "SGD", v, "a dampening that is a number");
    if (nesterov && (momentum <= 0.0 || dampening != 0.0))
      throw config_error("psx: optim::SGD for '" + v.name +
                         "': Nesterov momentum needs momentum > 0 and dampening = 0");
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    const float neg_lr = static_cast<float>(-detail::effective_lr(lr, ctx));
    const float wd = static_cast<float>(weight_decay);
    const float mu = static_cast<float>(momentum);
    const float keep = static_cast<float>(1.0 - dampening);
    const std::size_t n = w.size();
    float* wp = w.data();
    const float* gp = g.data();
    float* b = momentum != 0.0 ? s[0].data() : nullptr;
    detail::with_flags([&](auto... flags) { loop<decltype(flags)::value...>(n, wp, gp, b, neg_lr, wd, mu, keep); },
                       weight_decay != 0.0, momentum != 0.0, !ctx.rows && ctx.step == 1, nesterov);
  }

  // Scalars by value and restrict pointers: nothing the loop stores can
  // alias what it reads, so it vectorizes without run-time alias checks.
  template <bool Decay, bool Momentum, bool First, bool Nesterov>
  static void loop(std::size_t n, float* __restrict w, const float* __restrict g, float* __restrict b, float neg_lr,
                   float wd, float mu, float keep) noexcept {
    for (std::size_t i = 0; i < n; ++i) {
      float d = g[i];
      if constexpr (Decay) d = d + wd * w[i];
      if constexpr (Momentum) {
        if constexpr (First) b[i] = d;
        else b[i] = b[i] * mu + keep * d;
        if constexpr (Nesterov) d = d + mu * b[i];
        else d = b[i];
      }
      w[i] = w[i] + neg_lr * d;
    }
  }

  friend bool operator==(const SGD&, const SGD&) = default;
  friend std::ostream& operator<<(std::ostream& os, const SGD& o) {
    os << "SGD{lr=" << o.lr;
    if (o.momentum != 0.0) os << ", momentum=" << o.momentum << ", dampening=" << o.dampening;
    if (o.nesterov) os << ", nesterov";
    if (o.weight_decay != 0.0) os << ", weight_decay=" << o.weight_decay;
    return os << '}';
  }
};
static_assert(Optimizer<SGD>);

// ---------------------------------------------------------------------------
// Adagrad
// ---------------------------------------------------------------------------

//! Adagrad; follows `torch.optim.Adagrad` (PyTorch 1.13), dense and sparse:
//!
//!     g   += weight_decay * w
//!     clr  = lr / (1 + (t - 1) * lr_decay)
//!     acc += g * g                                  (acc starts at initial_accumulator_value)
//!     w   -= clr * g / (sqrt(acc) + eps)
//!
//! One slot (the accumulator).
struct Adagrad {
  double lr = 0.01;
  double lr_decay = 0.0;
  double weight_decay = 0.0;
  double initial_accumulator_value = 0.0;
  double eps = 1e-10;

  std::size_t slots() const noexcept { return 1; }
  float initial_slot(std::size_t) const noexcept { return static_cast<float>(initial_accumulator_value); }

  void validate(const VariableMeta& v, std::size_t) const {
    detail::require(lr >= 0.0 && lr_decay >= 0.0 && weight_decay >= 0.0 && initial_accumulator_value >= 0.0 &&
                        eps >= 0.0,
                    "Adagrad", v, "lr, lr_decay, weight_decay, initial_accumulator_value and eps >= 0");
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    const double clr = detail::effective_lr(lr, ctx) / (1.0 + static_cast<double>(detail::t_of(ctx) - 1) * lr_decay);
    const float neg_clr = static_cast<float>(-clr);
    const float wd = static_cast<float>(weight_decay);
    const float e = static_cast<float>(eps);
    detail::with_flags([&](auto... flags) {
      loop<decltype(flags)::value...>(w.size(), w.data(), g.data(), s[0].data(), neg_clr, wd, e);
    }, weight_decay != 0.0);
  }

  template <bool Decay>
  static void loop(std::size_t n, float* __restrict w, const float* __restrict g, float* __restrict acc,
                   float neg_clr, float wd, float e) noexcept {
    for (std::size_t i = 0; i < n; ++i) {
      float d = g[i];
      if constexpr (Decay) d = d + wd * w[i];
      acc[i] = acc[i] + d * d;
      const float stdev = std::sqrt(acc[i]) + e;
      w[i] = w[i] + neg_clr * d / stdev;
    }
  }

  friend bool operator==(const Adagrad&, const Adagrad&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Adagrad& o) {
    return os << "Adagrad{lr=" << o.lr << ", lr_decay=" << o.lr_decay << ", weight_decay=" << o.weight_decay
              << ", initial_accumulator_value=" << o.initial_accumulator_value << ", eps=" << o.eps << '}';
  }
};
static_assert(Optimizer<Adagrad>);

// ---------------------------------------------------------------------------
// RMSProp
// ---------------------------------------------------------------------------

//! RMSProp, plain or centered, with optional momentum; follows
//! `torch.optim.RMSprop` (PyTorch 1.13), where eps is added after the root:
//!
//!     g   += weight_decay * w
//!     sq   = alpha * sq + (1 - alpha) * g * g
//!     ga   = alpha * ga + (1 - alpha) * g                        (centered)
//!     avg  = sqrt(sq - ga * ga) + eps   (centered)  |  sqrt(sq) + eps
//!     b    = momentum * b + g / avg;  w -= lr * b                 (momentum > 0)
//!     w   -= lr * g / avg                                         (otherwise)
//!
//! Slots: sq, then ga if centered, then b if momentum > 0.
struct RMSProp {
  double lr = 0.01;
  double alpha = 0.99;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;
  bool centered = false;

  std::size_t slots() const noexcept { return 1 + (centered ? 1 : 0) + (momentum > 0.0 ? 1 : 0); }

  void validate(const VariableMeta& v, std::size_t) const {
    detail::require(lr >= 0.0 && alpha >= 0.0 && eps >= 0.0 && weight_decay >= 0.0 && momentum >= 0.0, "RMSProp",
                    v, "lr, alpha, eps, weight_decay and momentum >= 0");
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    const float neg_lr = static_cast<float>(-detail::effective_lr(lr, ctx));
    const Scalars k{static_cast<float>(alpha), static_cast<float>(1.0 - alpha), static_cast<float>(eps),
                    static_cast<float>(weight_decay), static_cast<float>(momentum), neg_lr};
    float* ga = centered ? s[1].data() : nullptr;
    float* b = momentum > 0.0 ? s[centered ? 2 : 1].data() : nullptr;
    detail::with_flags([&](auto... flags) {
      loop<decltype(flags)::value...>(w.size(), w.data(), g.data(), s[0].data(), ga, b, k);
    }, weight_decay != 0.0, centered, momentum > 0.0);
  }

  struct Scalars {
    float a, one_minus_a, e, wd, mu, neg_lr;
  };
  template <bool Decay, bool Centered, bool Momentum>
  static void loop(std::size_t n, float* __restrict w, const float* __restrict g, float* __restrict sq,
                   float* __restrict ga, float* __restrict b, Scalars k) noexcept {
    for (std::size_t i = 0; i < n; ++i) {
      float d = g[i];
      if constexpr (Decay) d = d + k.wd * w[i];
      sq[i] = sq[i] * k.a + k.one_minus_a * d * d;
      float avg;
      if constexpr (Centered) {
        ga[i] = ga[i] * k.a + k.one_minus_a * d;
        avg = std::sqrt(sq[i] + -1.0f * ga[i] * ga[i]) + k.e;
      } else {
        avg = std::sqrt(sq[i]) + k.e;
      }
      if constexpr (Momentum) {
        b[i] = b[i] * k.mu + d / avg;
        w[i] = w[i] + k.neg_lr * b[i];
      } else {
        w[i] = w[i] + k.neg_lr * d / avg;
      }
    }
  }

  friend bool operator==(const RMSProp&, const RMSProp&) = default;
  friend std::ostream& operator<<(std::ostream& os, const RMSProp& o) {
    return os << "RMSProp{lr=" << o.lr << ", alpha=" << o.alpha << ", eps=" << o.eps
              << ", weight_decay=" << o.weight_decay << ", momentum=" << o.momentum
              << (o.centered ? ", centered}" : "}");
  }
};
static_assert(Optimizer<RMSProp>);

// ---------------------------------------------------------------------------
// Adam and AdamW
// ---------------------------------------------------------------------------

namespace detail {

// The Adam family's shared body. `decoupled` selects AdamW's weight decay.
struct AdamCore {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, decoupled;

  struct Scalars {
    float neg_step, bc2_sqrt, b1, b2, one_minus_b1, one_minus_b2, e, wd, shrink;
  };

  Scalars scalars(const UpdateContext& ctx, bool rows) const noexcept {
    const double lr_t = effective_lr(lr, ctx);
    const std::uint64_t t = rows ? ctx.global_step : ctx.step;
    const double bc1 = bias_correction(beta1, t), bc2 = bias_correction(beta2, t);
    // Dense: lr / bc1 and eps after the corrected root; rows (SparseAdam):
    // lr * sqrt(bc2) / bc1 and eps on the uncorrected root.
    const double step = rows ? lr_t * std::sqrt(bc2) / bc1 : lr_t / bc1;
    return {static_cast<float>(-step), static_cast<float>(std::sqrt(bc2)), static_cast<float>(beta1),
            static_cast<float>(beta2), static_cast<float>(1.0 - beta1), static_cast<float>(1.0 - beta2),
            static_cast<float>(eps), decoupled ? 0.0f : static_cast<float>(weight_decay),
            static_cast<float>(1.0 - lr_t * weight_decay)};
  }

  // Dense: torch.optim.Adam / AdamW (1.13).
  template <bool Decoupled, bool Decay, bool Ams>
  static void dense(std::size_t n, float* __restrict w, const float* __restrict g, float* __restrict m,
                    float* __restrict v, float* __restrict vmax, Scalars k) noexcept {
    for (std::size_t i = 0; i < n; ++i) {
      if constexpr (Decoupled) w[i] = w[i] * k.shrink;  // AdamW's w *= 1 - lr * wd, in the same pass
      float d = g[i];
      if constexpr (Decay) d = d + k.wd * w[i];
      m[i] = m[i] * k.b1 + k.one_minus_b1 * d;
      v[i] = v[i] * k.b2 + k.one_minus_b2 * d * d;
      float root;
      if constexpr (Ams) {
        vmax[i] = vmax[i] >= v[i] ? vmax[i] : v[i];  // torch.maximum: NaN in v propagates
        root = std::sqrt(vmax[i]);
      } else {
        root = std::sqrt(v[i]);
      }
      const float denom = root / k.bc2_sqrt + k.e;
      w[i] = w[i] + k.neg_step * m[i] / denom;
    }
  }

  // Rows: torch.optim.SparseAdam (1.13), lazy.
  template <bool Decoupled, bool Decay, bool Ams>
  static void rows(std::size_t n, float* __restrict w, const float* __restrict g, float* __restrict m,
                   float* __restrict v, float* __restrict vmax, Scalars k) noexcept {
    for (std::size_t i = 0; i < n; ++i) {
      if constexpr (Decoupled) w[i] = w[i] * k.shrink;
      float d = g[i];
      if constexpr (Decay) d = d + k.wd * w[i];
      m[i] = m[i] + (d - m[i]) * k.one_minus_b1;
      v[i] = v[i] + (d * d - v[i]) * k.one_minus_b2;
      float root;
      if constexpr (Ams) {
        vmax[i] = vmax[i] >= v[i] ? vmax[i] : v[i];
        root = std::sqrt(vmax[i]);
      } else {
        root = std::sqrt(v[i]);
      }
      w[i] = w[i] + k.neg_step * (m[i] / (root + k.e));
    }
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s, const UpdateContext& ctx) const noexcept {
    const Scalars k = scalars(ctx, ctx.rows);
    float* vmax = amsgrad ? s[2].data() : nullptr;
    with_flags([&](auto... flags) {
      if (ctx.rows) rows<decltype(flags)::value...>(w.size(), w.data(), g.data(), s[0].data(), s[1].data(), vmax, k);
      else dense<decltype(flags)::value...>(w.size(), w.data(), g.data(), s[0].data(), s[1].data(), vmax, k);
    }, decoupled && weight_decay != 0.0, !decoupled && weight_decay != 0.0, amsgrad);
  }
};

}  // namespace detail

//! Adam with optional AMSGrad and L2 weight decay (added to the gradient).
//! Dense pushes follow `torch.optim.Adam` (PyTorch 1.13):
//!
//!     g += weight_decay * w
//!     m  = beta1 * m + (1 - beta1) * g
//!     v  = beta2 * v + (1 - beta2) * g * g
//!     vmax = max(vmax, v)                                   (amsgrad; used for v below)
//!     w -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//!
//! Row pushes follow `torch.optim.SparseAdam` (lazy Adam): only pushed rows
//! and their m, v change, and eps sits on the uncorrected root:
//!
//!     w -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps)
//!
//! Slots: m, v, and vmax with AMSGrad (8 or 12 bytes per parameter).
struct Adam {
  double lr = 0.001;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;

  std::size_t slots() const noexcept { return amsgrad ? 3 : 2; }
  void validate(const VariableMeta& v, std::size_t) const {
    detail::require(lr >= 0.0 && eps >= 0.0 && weight_decay >= 0.0, "Adam", v, "lr, eps and weight_decay >= 0");
    detail::require(detail::is_beta(beta1) && detail::is_beta(beta2), "Adam", v, "beta1 and beta2 in [0, 1)");
  }
  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    detail::AdamCore{lr, beta1, beta2, eps, weight_decay, amsgrad, false}.update(w, g, s, ctx);
  }

  friend bool operator==(const Adam&, const Adam&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Adam& o) {
    return os << "Adam{lr=" << o.lr << ", beta1=" << o.beta1 << ", beta2=" << o.beta2 << ", eps=" << o.eps
              << ", weight_decay=" << o.weight_decay << (o.amsgrad ? ", amsgrad}" : "}");
  }
};
static_assert(Optimizer<Adam>);

//! AdamW: Adam with decoupled weight decay; follows `torch.optim.AdamW`
//! (PyTorch 1.13): first `w *= 1 - lr * weight_decay`, then Adam's update
//! without weight decay in the gradient. Rows: the same, lazily, with
//! SparseAdam's formula for the Adam part.
struct AdamW {
  double lr = 0.001;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  bool amsgrad = false;

  std::size_t slots() const noexcept { return amsgrad ? 3 : 2; }
  void validate(const VariableMeta& v, std::size_t) const {
    detail::require(lr >= 0.0 && eps >= 0.0 && weight_decay >= 0.0, "AdamW", v, "lr, eps and weight_decay >= 0");
    detail::require(detail::is_beta(beta1) && detail::is_beta(beta2), "AdamW", v, "beta1 and beta2 in [0, 1)");
  }
  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    detail::AdamCore{lr, beta1, beta2, eps, weight_decay, amsgrad, true}.update(w, g, s, ctx);
  }

  friend bool operator==(const AdamW&, const AdamW&) = default;
  friend std::ostream& operator<<(std::ostream& os, const AdamW& o) {
    return os << "AdamW{lr=" << o.lr << ", beta1=" << o.beta1 << ", beta2=" << o.beta2 << ", eps=" << o.eps
              << ", weight_decay=" << o.weight_decay << (o.amsgrad ? ", amsgrad}" : "}");
  }
};
static_assert(Optimizer<AdamW>);

// ---------------------------------------------------------------------------
// FTRL-Proximal
// ---------------------------------------------------------------------------

//! FTRL-Proximal (McMahan et al. 2013), the recommender-system standard;
//! follows TensorFlow's `ApplyFtrlV2` / `SparseApplyFtrlV2` kernels (as used
//! by `tf.keras.optimizers.Ftrl` with beta = 0 and no l2 shrinkage):
//!
//!     n'     = n + g * g                               (n starts at initial_accumulator_value)
//!     z     += g - (n'^(-lr_power) - n^(-lr_power)) / lr * w
//!     w      = |z| > l1 ? (sign(z) * l1 - z) / (n'^(-lr_power) / lr + 2 * l2) : 0
//!     n      = n'
//!
//! `lr_power = -0.5` uses square roots, as TensorFlow does. An update whose
//! learning rate (after the policy's and schedule's factors) is 0 changes
//! nothing (TensorFlow refuses lr <= 0; a schedule may reach 0). Rows are lazy,
//! exactly TensorFlow's sparse kernel. Slots: n, z (12 bytes per parameter).
//! The sync policy's and the schedule's factors scale `lr`.
struct Ftrl {
  double lr = 0.001;
  double lr_power = -0.5;
  double l1 = 0.0;
  double l2 = 0.0;
  double initial_accumulator_value = 0.1;

  std::size_t slots() const noexcept { return 2; }
  float initial_slot(std::size_t k) const noexcept {
    return k == 0 ? static_cast<float>(initial_accumulator_value) : 0.0f;
  }

  void validate(const VariableMeta& v, std::size_t) const {
    // Each rule holds as written (a NaN fails every comparison, so is refused).
    detail::require(lr > 0.0 && lr_power <= 0.0 && initial_accumulator_value >= 0.0 && l1 >= 0.0 && l2 >= 0.0, "Ftrl",
                    v, "lr > 0, lr_power <= 0, initial_accumulator_value >= 0, l1 >= 0 and l2 >= 0");
  }

  //! False when the effective learning rate is 0 (or less): a schedule's
  //! factor 0 (e.g. Warmup's first step) would divide by 0 and corrupt z for
  //! good, so FTRL then leaves everything as it is (the CUDA kernels too).
  bool applies(const UpdateContext& ctx) const noexcept {
    return static_cast<float>(detail::effective_lr(lr, ctx)) > 0.0f;
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    if (!applies(ctx)) return;
    const float lr_t = static_cast<float>(detail::effective_lr(lr, ctx));
    const float l1f = static_cast<float>(l1), two_l2 = static_cast<float>(2.0 * l2);
    const float power = static_cast<float>(-lr_power);
    detail::with_flags([&](auto... flags) {
      loop<decltype(flags)::value...>(w.size(), w.data(), g.data(), s[0].data(), s[1].data(), lr_t, l1f, two_l2, power);
    }, lr_power == -0.5);
  }

  template <bool SquareRoot>
  static void loop(std::size_t n, float* __restrict w, const float* __restrict g, float* __restrict acc,
                   float* __restrict z, float lr_t, float l1f, float two_l2, float power) noexcept {
    auto root = [power](float x) {
      if constexpr (SquareRoot) return std::sqrt(x);
      else return std::pow(x, power);
    };
    for (std::size_t i = 0; i < n; ++i) {
      const float d = g[i];
      const float acc_new = acc[i] + d * d;
      const float root_new = root(acc_new);
      const float zi = z[i] + (d - (root_new - root(acc[i])) / lr_t * w[i]);
      const float quadratic = root_new / lr_t + two_l2;
      // (sign(z) * l1 - z) / quadratic where |z| > l1, else +0. Computed for
      // every element and masked, so that the loop has no branch (a division
      // under a condition stops vectorization); z = 0 never passes |z| > l1.
      const float shrunk = (std::copysign(l1f, zi) - zi) / quadratic;
      const std::uint32_t keep = std::fabs(zi) > l1f ? 0xffffffffu : 0u;
      w[i] = std::bit_cast<float>(std::bit_cast<std::uint32_t>(shrunk) & keep);
      z[i] = zi;
      acc[i] = acc_new;
    }
  }

  friend bool operator==(const Ftrl&, const Ftrl&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Ftrl& o) {
    return os << "Ftrl{lr=" << o.lr << ", lr_power=" << o.lr_power << ", l1=" << o.l1 << ", l2=" << o.l2
              << ", initial_accumulator_value=" << o.initial_accumulator_value << '}';
  }
};
static_assert(Optimizer<Ftrl>);

// ---------------------------------------------------------------------------
// LAMB
// ---------------------------------------------------------------------------

//! LAMB (You et al. 2019); follows TensorFlow Addons' `tfa.optimizers.LAMB`:
//!
//!     m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
//!     r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
//!     ratio = (|w| > 0 && |r| > 0) ? |w| / |r| : 1      (l2 norms over the layer)
//!     w -= lr * ratio * r
//!
//! The trust ratio is per layer, and a layer is a variable: its norms need the
//! whole variable. A server sees one shard, so psx refuses (config_error at
//! `start`) a variable that the partitioner splits across servers, unless
//! `per_shard_trust_ratio` is set, which makes each shard its own layer
//! (as LAMB implementations do for each parameter tensor). Use a partitioner
//! that keeps variables whole (HashByName, RoundRobin) for textbook LAMB.
//! Sparse variables (row pushes) are refused: a row is not a layer.
//! Slots: m, v (12 bytes per parameter). Norms: float partial sums over
//! blocks of 1024 elements, added up in double.
struct Lamb {
  double lr = 0.001;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-6;
  double weight_decay = 0.0;
  bool per_shard_trust_ratio = false;

  std::size_t slots() const noexcept { return 2; }

  //! LAMB does not apply row pushes: the server refuses them (a row is not a layer).
  static constexpr bool accepts_rows = false;

  void validate(const VariableMeta& v, std::size_t shards) const {
    detail::require(lr >= 0.0 && eps >= 0.0 && weight_decay >= 0.0, "Lamb", v, "lr, eps and weight_decay >= 0");
    detail::require(detail::is_beta(beta1) && detail::is_beta(beta2), "Lamb", v, "beta1 and beta2 in [0, 1)");
    if (v.kind == VariableKind::sparse)
      throw config_error("psx: optim::Lamb: variable '" + v.name +
                         "' is sparse; LAMB's trust ratio is per layer and a row is not one");
    if (shards > 1 && !per_shard_trust_ratio)
      throw config_error("psx: optim::Lamb: variable '" + v.name + "' is split into " + std::to_string(shards) +
                         " shards, but LAMB's trust ratio needs the whole variable; use a partitioner that keeps "
                         "variables whole (HashByName, RoundRobin) or set per_shard_trust_ratio");
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    const Scalars k{static_cast<float>(1.0 / detail::bias_correction(beta1, ctx.step)),
                    static_cast<float>(1.0 / detail::bias_correction(beta2, ctx.step)),
                    static_cast<float>(beta1),
                    static_cast<float>(beta2),
                    static_cast<float>(1.0 - beta1),
                    static_cast<float>(1.0 - beta2),
                    static_cast<float>(eps),
                    static_cast<float>(weight_decay)};
    const std::size_t n = w.size();
    double norms[2] = {};  // |w|^2, |r|^2
    moments(n, w.data(), g.data(), s[0].data(), s[1].data(), k, norms);
    const float w_norm = static_cast<float>(std::sqrt(norms[0])), r_norm = static_cast<float>(std::sqrt(norms[1]));
    const float ratio = w_norm > 0.0f && r_norm > 0.0f ? w_norm / r_norm : 1.0f;
    apply(n, w.data(), s[0].data(), s[1].data(), k, static_cast<float>(-detail::effective_lr(lr, ctx)) * ratio);
  }

  struct Scalars {
    float inv_bc1, inv_bc2, b1, b2, one_minus_b1, one_minus_b2, e, wd;
    float r(float m, float v, float w) const noexcept { return (m * inv_bc1) / (std::sqrt(v * inv_bc2) + e) + wd * w; }
    // Moves the moments by gradient g; returns r at the new moments.
    float step(float& m, float& v, float g, float w) const noexcept {
      m = m * b1 + one_minus_b1 * g;
      v = v * b2 + one_minus_b2 * g * g;
      return r(m, v, w);
    }
  };

  // Pass 1: the moments, and the squared norms of w and r: 8 float lanes
  // per block of 1024 elements (so the loop vectorizes), blocks summed in
  // double.
  static void moments(std::size_t n, const float* __restrict w, const float* __restrict g, float* __restrict m,
                      float* __restrict v, Scalars k, double (&norms)[2]) noexcept {
    constexpr std::size_t lanes = 8, block = 1024;
    double w2 = 0.0, r2 = 0.0;
    const std::size_t whole = n / lanes * lanes;
    for (std::size_t b = 0; b < whole; b += block) {
      const std::size_t end = std::min(whole, b + block);
      float wl[lanes] = {}, rl[lanes] = {};
      for (std::size_t i = b; i < end; i += lanes)
        for (std::size_t l = 0; l < lanes; ++l) {
          const std::size_t j = i + l;
          const float r = k.step(m[j], v[j], g[j], w[j]);
          wl[l] += w[j] * w[j];
          rl[l] += r * r;
        }
      for (std::size_t l = 0; l < lanes; ++l) w2 += wl[l], r2 += rl[l];
    }
    for (std::size_t j = whole; j < n; ++j) {
      const float r = k.step(m[j], v[j], g[j], w[j]);
      w2 += static_cast<double>(w[j]) * w[j];
      r2 += static_cast<double>(r) * r;
    }
    norms[0] = w2;
    norms[1] = r2;
  }

  // Pass 2: w -= lr * ratio * r, r recomputed from the new moments.
  static void apply(std::size_t n, float* __restrict w, const float* __restrict m, const float* __restrict v,
                    Scalars k, float scale) noexcept {
    for (std::size_t i = 0; i < n; ++i) w[i] = w[i] + scale * k.r(m[i], v[i], w[i]);
  }

  friend bool operator==(const Lamb&, const Lamb&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Lamb& o) {
    return os << "Lamb{lr=" << o.lr << ", beta1=" << o.beta1 << ", beta2=" << o.beta2 << ", eps=" << o.eps
              << ", weight_decay=" << o.weight_decay << (o.per_shard_trust_ratio ? ", per_shard_trust_ratio}" : "}");
  }
};
static_assert(Optimizer<Lamb>);

}  // namespace optim
}  // namespace v0
}  // namespace psx
