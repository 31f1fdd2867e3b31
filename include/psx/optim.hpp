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
//!  - a row push (`ctx.rows`) is lazy: only the pushed rows and their slots
//!    change. Every optimizer but Adam applies the same formula to a row as to
//!    a dense element; Adam follows `torch.optim.SparseAdam` for rows.
#pragma once

#include <psx/concepts.hpp>
#include <psx/errors.hpp>

#include <cmath>
#include <cstddef>
#include <ostream>
#include <span>
#include <string>

namespace psx {
inline namespace v0 {
namespace optim {

namespace detail {

inline double effective_lr(double lr, const UpdateContext& ctx) noexcept { return lr * ctx.lr_scale; }

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
//! Rows: a row first pushed after global step 1 starts from b = 0, i.e.
//! `b = (1 - dampening) * g` (identical to PyTorch when dampening is 0).
struct SGD {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;

  std::size_t slots() const noexcept { return momentum != 0.0 ? 1 : 0; }

  void validate(const VariableMeta& v, std::size_t) const {
    if (nesterov && (momentum <= 0.0 || dampening != 0.0))
      throw config_error("psx: optim::SGD for '" + v.name +
                         "': Nesterov momentum needs momentum > 0 and dampening = 0");
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    const float neg_lr = static_cast<float>(-detail::effective_lr(lr, ctx));
    const float wd = static_cast<float>(weight_decay);
    const std::size_t n = w.size();
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    if (momentum == 0.0) {
      for (std::size_t i = 0; i < n; ++i) {
        const float d = wd != 0.0f ? gp[i] + wd * wp[i] : gp[i];
        wp[i] = wp[i] + neg_lr * d;
      }
      return;
    }
    const float mu = static_cast<float>(momentum);
    const float keep = static_cast<float>(1.0 - dampening);
    const bool first = detail::t_of(ctx) == 1;
    float* __restrict b = s[0].data();
    for (std::size_t i = 0; i < n; ++i) {
      const float d = wd != 0.0f ? gp[i] + wd * wp[i] : gp[i];
      b[i] = first ? d : b[i] * mu + keep * d;
      const float step = nesterov ? d + mu * b[i] : b[i];
      wp[i] = wp[i] + neg_lr * step;
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

  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    const double clr = detail::effective_lr(lr, ctx) / (1.0 + static_cast<double>(detail::t_of(ctx) - 1) * lr_decay);
    const float neg_clr = static_cast<float>(-clr);
    const float wd = static_cast<float>(weight_decay);
    const float e = static_cast<float>(eps);
    const std::size_t n = w.size();
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict acc = s[0].data();
    for (std::size_t i = 0; i < n; ++i) {
      const float d = wd != 0.0f ? gp[i] + wd * wp[i] : gp[i];
      acc[i] = acc[i] + d * d;
      const float stdev = std::sqrt(acc[i]) + e;
      wp[i] = wp[i] + neg_clr * d / stdev;
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

  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    const float neg_lr = static_cast<float>(-detail::effective_lr(lr, ctx));
    const float a = static_cast<float>(alpha), one_minus_a = static_cast<float>(1.0 - alpha);
    const float wd = static_cast<float>(weight_decay), e = static_cast<float>(eps);
    const float mu = static_cast<float>(momentum);
    const std::size_t n = w.size();
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict sq = s[0].data();
    float* __restrict ga = centered ? s[1].data() : nullptr;
    float* __restrict b = momentum > 0.0 ? s[centered ? 2 : 1].data() : nullptr;
    for (std::size_t i = 0; i < n; ++i) {
      const float d = wd != 0.0f ? gp[i] + wd * wp[i] : gp[i];
      sq[i] = sq[i] * a + one_minus_a * d * d;
      float avg;
      if (ga) {
        ga[i] = ga[i] * a + one_minus_a * d;
        avg = std::sqrt(sq[i] + -1.0f * ga[i] * ga[i]) + e;
      } else {
        avg = std::sqrt(sq[i]) + e;
      }
      if (b) {
        b[i] = b[i] * mu + d / avg;
        wp[i] = wp[i] + neg_lr * b[i];
      } else {
        wp[i] = wp[i] + neg_lr * d / avg;
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

  // Dense: torch.optim.Adam / AdamW (1.13), eps added after the bias-corrected root.
  void dense(std::span<float> w, std::span<const float> g, const SlotView& s, const UpdateContext& ctx) const noexcept {
    const double lr_t = effective_lr(lr, ctx);
    const double bc1 = bias_correction(beta1, ctx.step), bc2 = bias_correction(beta2, ctx.step);
    const float neg_step = static_cast<float>(-(lr_t / bc1));
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const float b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2);
    const float one_minus_b1 = static_cast<float>(1.0 - beta1), one_minus_b2 = static_cast<float>(1.0 - beta2);
    const float e = static_cast<float>(eps);
    const float wd = decoupled ? 0.0f : static_cast<float>(weight_decay);
    const float shrink = static_cast<float>(1.0 - lr_t * weight_decay);
    const std::size_t n = w.size();
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict m = s[0].data();
    float* __restrict v = s[1].data();
    float* __restrict vmax = amsgrad ? s[2].data() : nullptr;
    if (decoupled && weight_decay != 0.0)
      for (std::size_t i = 0; i < n; ++i) wp[i] = wp[i] * shrink;
    for (std::size_t i = 0; i < n; ++i) {
      const float d = wd != 0.0f ? gp[i] + wd * wp[i] : gp[i];
      m[i] = m[i] * b1 + one_minus_b1 * d;
      v[i] = v[i] * b2 + one_minus_b2 * d * d;
      float root;
      if (vmax) {
        vmax[i] = std::fmax(vmax[i], v[i]);
        root = std::sqrt(vmax[i]);
      } else {
        root = std::sqrt(v[i]);
      }
      const float denom = root / bc2_sqrt + e;
      wp[i] = wp[i] + neg_step * m[i] / denom;
    }
  }

  // Rows: torch.optim.SparseAdam (1.13), lazy, eps added to the uncorrected
  // root and the bias corrections folded into the step size.
  void rows(std::span<float> w, std::span<const float> g, const SlotView& s, const UpdateContext& ctx) const noexcept {
    const double lr_t = effective_lr(lr, ctx);
    const double bc1 = bias_correction(beta1, ctx.global_step), bc2 = bias_correction(beta2, ctx.global_step);
    const float neg_step = static_cast<float>(-(lr_t * std::sqrt(bc2) / bc1));
    const float one_minus_b1 = static_cast<float>(1.0 - beta1), one_minus_b2 = static_cast<float>(1.0 - beta2);
    const float e = static_cast<float>(eps);
    const float wd = decoupled ? 0.0f : static_cast<float>(weight_decay);
    const float shrink = static_cast<float>(1.0 - lr_t * weight_decay);
    const std::size_t n = w.size();
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict m = s[0].data();
    float* __restrict v = s[1].data();
    float* __restrict vmax = amsgrad ? s[2].data() : nullptr;
    for (std::size_t i = 0; i < n; ++i) {
      if (decoupled && weight_decay != 0.0) wp[i] = wp[i] * shrink;
      const float d = wd != 0.0f ? gp[i] + wd * wp[i] : gp[i];
      m[i] = m[i] + (d - m[i]) * one_minus_b1;
      v[i] = v[i] + (d * d - v[i]) * one_minus_b2;
      float root;
      if (vmax) {
        vmax[i] = std::fmax(vmax[i], v[i]);
        root = std::sqrt(vmax[i]);
      } else {
        root = std::sqrt(v[i]);
      }
      wp[i] = wp[i] + neg_step * (m[i] / (root + e));
    }
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s, const UpdateContext& ctx) const noexcept {
    if (ctx.rows) rows(w, g, s, ctx);
    else dense(w, g, s, ctx);
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
//! `lr_power = -0.5` uses square roots, as TensorFlow does. Rows are lazy,
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
    if (lr_power > 0.0 || initial_accumulator_value < 0.0 || l1 < 0.0 || l2 < 0.0)
      throw config_error("psx: optim::Ftrl for '" + v.name +
                         "': needs lr_power <= 0, initial_accumulator_value >= 0, l1 >= 0 and l2 >= 0");
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s,
              const UpdateContext& ctx) const noexcept {
    const float lr_t = static_cast<float>(detail::effective_lr(lr, ctx));
    const float l1f = static_cast<float>(l1), two_l2 = static_cast<float>(2.0 * l2);
    const float power = static_cast<float>(-lr_power);
    const bool sqrt_power = lr_power == -0.5;
    auto root = [&](float x) { return sqrt_power ? std::sqrt(x) : std::pow(x, power); };
    const std::size_t n = w.size();
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict acc = s[0].data();
    float* __restrict z = s[1].data();
    for (std::size_t i = 0; i < n; ++i) {
      const float d = gp[i];
      const float acc_new = acc[i] + d * d;
      const float root_new = root(acc_new);
      z[i] = z[i] + (d - (root_new - root(acc[i])) / lr_t * wp[i]);
      const float quadratic = root_new / lr_t + two_l2;
      const float sign = z[i] > 0.0f ? 1.0f : z[i] < 0.0f ? -1.0f : 0.0f;
      wp[i] = std::fabs(z[i]) > l1f ? (sign * l1f - z[i]) / quadratic : 0.0f;
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
//! Slots: m, v (12 bytes per parameter). Norms are accumulated in double.
struct Lamb {
  double lr = 0.001;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-6;
  double weight_decay = 0.0;
  bool per_shard_trust_ratio = false;

  std::size_t slots() const noexcept { return 2; }

  void validate(const VariableMeta& v, std::size_t shards) const {
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
    const float inv_bc1 = static_cast<float>(1.0 / detail::bias_correction(beta1, ctx.step));
    const float inv_bc2 = static_cast<float>(1.0 / detail::bias_correction(beta2, ctx.step));
    const float b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2);
    const float one_minus_b1 = static_cast<float>(1.0 - beta1), one_minus_b2 = static_cast<float>(1.0 - beta2);
    const float e = static_cast<float>(eps), wd = static_cast<float>(weight_decay);
    const std::size_t n = w.size();
    float* __restrict wp = w.data();
    const float* __restrict gp = g.data();
    float* __restrict m = s[0].data();
    float* __restrict v = s[1].data();
    auto r_of = [&](std::size_t i) { return (m[i] * inv_bc1) / (std::sqrt(v[i] * inv_bc2) + e) + wd * wp[i]; };
    double w_norm2 = 0.0, r_norm2 = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      m[i] = m[i] * b1 + one_minus_b1 * gp[i];
      v[i] = v[i] * b2 + one_minus_b2 * gp[i] * gp[i];
      const float r = r_of(i);
      w_norm2 += static_cast<double>(wp[i]) * wp[i];
      r_norm2 += static_cast<double>(r) * r;
    }
    const float w_norm = static_cast<float>(std::sqrt(w_norm2)), r_norm = static_cast<float>(std::sqrt(r_norm2));
    const float ratio = w_norm > 0.0f && r_norm > 0.0f ? w_norm / r_norm : 1.0f;
    const float scale = static_cast<float>(-detail::effective_lr(lr, ctx)) * ratio;
    for (std::size_t i = 0; i < n; ++i) wp[i] = wp[i] + scale * r_of(i);
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
