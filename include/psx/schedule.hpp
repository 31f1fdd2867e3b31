//! @file psx/schedule.hpp
//! Learning-rate schedules driven by the global step, and
//! `psx::optim::Scheduled`, which puts one in front of any optimizer.
//!
//! A schedule is a copyable value with `double operator()(std::uint64_t t)
//! const` returning the factor on the optimizer's `lr` at 0-based global step
//! `t` (the first update is evaluated at t = 0). With an optimizer's `lr` as
//! TensorFlow's `initial_learning_rate`, each factor times `lr` is exactly the
//! TensorFlow schedule named below; `docs/optimizers.md` lists the formulas.
#pragma once

#include <psx/concepts.hpp>
#include <psx/errors.hpp>
#include <psx/variable.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <numbers>
#include <ostream>
#include <sstream>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {

//! A learning-rate schedule: the factor on `lr` at 0-based global step t.
template <class S>
concept Schedule = std::copy_constructible<S> && requires(const S& s, std::uint64_t t) {
  { s(t) } -> std::convertible_to<double>;
};

namespace detail {

// A schedule's setting in a message, as printed (6 significant digits, "inf", "nan").
inline std::string setting(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// Runs `validate` (a schedule's or a pruning schedule's), naming variable `v`
// in a config_error it throws: "psx: schedule::Cosine needs ..." becomes
// "psx: schedule::Cosine for 'w': needs ...".
template <class F>
void validate_for(const VariableMeta& v, F&& validate) {
  try {
    validate();
  } catch (const config_error& e) {
    std::string what = e.what();
    const std::size_t name_end = what.find(' ', 5);
    if (what.rfind("psx: ", 0) != 0 || name_end == std::string::npos) throw;
    what.insert(name_end, " for '" + v.name + "':");
    throw config_error(what);
  }
}

}  // namespace detail

namespace schedule {

// Every setting of a schedule must be a finite number (validate(), at
// declare): an infinite or NaN one would turn the factor on `lr` into NaN
// or infinity, and a negative factor training into gradient ascent.

//! Factor 1 at every step.
struct Constant {
  double operator()(std::uint64_t) const noexcept { return 1.0; }
  friend bool operator==(const Constant&, const Constant&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Constant&) { return os << "Constant{}"; }
};

//! `decay_rate^(t / decay_steps)`, or `decay_rate^floor(t / decay_steps)`
//! with `staircase` (tf.keras.optimizers.schedules.ExponentialDecay).
struct Exponential {
  std::uint64_t decay_steps = 1;
  double decay_rate = 0.96;
  bool staircase = false;

  double operator()(std::uint64_t t) const noexcept {
    const double p = static_cast<double>(t) / static_cast<double>(decay_steps);
    return std::pow(decay_rate, staircase ? std::floor(p) : p);
  }
  void validate() const {
    if (decay_steps == 0 || !(decay_rate > 0.0) || std::isinf(decay_rate))
      throw config_error("psx: schedule::Exponential needs decay_steps >= 1 and a finite decay_rate > 0, got " +
                         std::to_string(decay_steps) + " and " + detail::setting(decay_rate));
  }
  friend bool operator==(const Exponential&, const Exponential&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Exponential& s) {
    return os << "Exponential{decay_steps=" << s.decay_steps << ", decay_rate=" << s.decay_rate
              << (s.staircase ? ", staircase}" : "}");
  }
};

//! `(1 - end) * (1 - min(t, decay_steps) / decay_steps)^power + end`
//! (tf.keras.optimizers.schedules.PolynomialDecay without cycle; `end` is the
//! final factor, TensorFlow's end_learning_rate / initial_learning_rate).
struct Polynomial {
  std::uint64_t decay_steps = 1;
  double end = 0.0001;
  double power = 1.0;

  double operator()(std::uint64_t t) const noexcept {
    const double s = static_cast<double>(std::min(t, decay_steps)) / static_cast<double>(decay_steps);
    return (1.0 - end) * std::pow(1.0 - s, power) + end;
  }
  void validate() const {
    if (decay_steps == 0 || !(power > 0.0) || std::isinf(power) || !(end >= 0.0) || std::isinf(end))
      throw config_error("psx: schedule::Polynomial needs decay_steps >= 1, a finite power > 0 and a finite end >= 0, "
                         "got " + std::to_string(decay_steps) + ", " + detail::setting(power) + " and " +
                         detail::setting(end));
  }
  friend bool operator==(const Polynomial&, const Polynomial&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Polynomial& s) {
    return os << "Polynomial{decay_steps=" << s.decay_steps << ", end=" << s.end << ", power=" << s.power << '}';
  }
};

//! `values[0]` while t <= boundaries[0], `values[i]` while
//! boundaries[i-1] < t <= boundaries[i], the last value after the last
//! boundary (tf.keras.optimizers.schedules.PiecewiseConstantDecay). Needs
//! increasing boundaries and one value more than boundaries (config_error).
struct Piecewise {
  std::vector<std::uint64_t> boundaries;
  std::vector<double> values{1.0};

  double operator()(std::uint64_t t) const noexcept {
    if (values.empty()) return 1.0;  // refused by validate(); never read out of bounds
    const auto i = std::lower_bound(boundaries.begin(), boundaries.end(), t) - boundaries.begin();
    return values[std::min(static_cast<std::size_t>(i), values.size() - 1)];
  }
  void validate() const {
    if (values.size() != boundaries.size() + 1)
      throw config_error("psx: schedule::Piecewise needs one value more than boundaries (got " +
                         std::to_string(boundaries.size()) + " boundaries, " + std::to_string(values.size()) +
                         " values)");
    if (std::adjacent_find(boundaries.begin(), boundaries.end(), std::greater_equal<>()) != boundaries.end())
      throw config_error("psx: schedule::Piecewise needs strictly increasing boundaries");
    for (std::size_t i = 0; i < values.size(); ++i)
      if (!(values[i] >= 0.0) || std::isinf(values[i]))
        throw config_error("psx: schedule::Piecewise needs finite values >= 0, got value " + std::to_string(i) +
                           " = " + detail::setting(values[i]));
  }
  friend bool operator==(const Piecewise&, const Piecewise&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Piecewise& s) {
    os << "Piecewise{boundaries=[";
    for (std::size_t i = 0; i < s.boundaries.size(); ++i) os << (i ? "," : "") << s.boundaries[i];
    os << "], values=[";
    for (std::size_t i = 0; i < s.values.size(); ++i) os << (i ? "," : "") << s.values[i];
    return os << "]}";
  }
};

//! `(1 - alpha) * 0.5 * (1 + cos(pi * min(t, decay_steps) / decay_steps)) + alpha`
//! (tf.keras.optimizers.schedules.CosineDecay; `alpha` is the final factor).
struct Cosine {
  std::uint64_t decay_steps = 1;
  double alpha = 0.0;

  double operator()(std::uint64_t t) const noexcept {
    const double s = static_cast<double>(std::min(t, decay_steps)) / static_cast<double>(decay_steps);
    const double c = 0.5 * (1.0 + std::cos(std::numbers::pi * s));
    return (1.0 - alpha) * c + alpha;
  }
  void validate() const {
    if (decay_steps == 0 || !(alpha >= 0.0) || std::isinf(alpha))
      throw config_error("psx: schedule::Cosine needs decay_steps >= 1 and a finite alpha >= 0, got " +
                         std::to_string(decay_steps) + " and " + detail::setting(alpha));
  }
  friend bool operator==(const Cosine&, const Cosine&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Cosine& s) {
    return os << "Cosine{decay_steps=" << s.decay_steps << ", alpha=" << s.alpha << '}';
  }
};

//! Linear warm-up around any schedule: `t / steps` while t < steps, then
//! `after(t - steps)` (the rule of Hugging Face's `get_*_schedule_with_warmup`:
//! the first update runs at factor 0 when steps > 0).
template <Schedule After = Constant>
struct Warmup {
  std::uint64_t steps = 0;
  After after{};

  double operator()(std::uint64_t t) const noexcept(noexcept(after(t))) {
    if (t < steps) return static_cast<double>(t) / static_cast<double>(steps);
    return after(t - steps);
  }
  void validate() const {
    if constexpr (requires { after.validate(); }) after.validate();
  }
  friend bool operator==(const Warmup&, const Warmup&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Warmup& s) {
    return os << "Warmup{steps=" << s.steps << ", after=" << s.after << '}';
  }
};

}  // namespace schedule

namespace optim {

//! Optimizer `O` with its learning rate scaled by schedule `S` at the
//! update's global step: `ctx.lr_scale *= schedule(ctx.global_step - 1)`.
//! Slots, initial slots, validation and whether row pushes are taken are O's.
template <Optimizer O, Schedule S>
struct Scheduled {
  O optimizer{};
  S schedule{};

  static constexpr bool accepts_rows = psx::accepts_rows<O>();
  std::size_t slots() const noexcept { return optimizer.slots(); }
  float initial_slot(std::size_t k) const { return psx::initial_slot(optimizer, k); }
  void validate(const VariableMeta& v, std::size_t shards) const {
    if constexpr (requires { schedule.validate(); }) ::psx::detail::validate_for(v, [&] { schedule.validate(); });
    validate_optimizer(optimizer, v, shards);
  }

  //! `ctx` with the learning-rate factor scaled by the schedule at the
  //! update's global step (also what the CUDA specializations apply).
  UpdateContext scaled(const UpdateContext& ctx) const {
    UpdateContext out = ctx;
    out.lr_scale *= schedule(ctx.global_step == 0 ? 0 : ctx.global_step - 1);
    return out;
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s, const UpdateContext& ctx) const {
    optimizer.update(w, g, s, scaled(ctx));
  }

  friend bool operator==(const Scheduled&, const Scheduled&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Scheduled& o) {
    return os << "Scheduled{" << o.optimizer << ", " << o.schedule << '}';
  }
};

//! `optim::Scheduled{optimizer, schedule}` with both types deduced.
template <Optimizer O, Schedule S>
Scheduled<O, S> scheduled(O optimizer, S schedule) {
  return {std::move(optimizer), std::move(schedule)};
}

}  // namespace optim
}  // namespace v0
}  // namespace psx
