//! @file psx/pruning.hpp
//! Magnitude pruning during training: `psx::optim::Pruned<O>` wraps any
//! optimizer and, on the steps a `PolynomialDecaySparsity` schedule names,
//! zeroes the smallest-magnitude weights of the variables it prunes until
//! the schedule's sparsity is reached; a mask kept as one more optimizer
//! slot holds pruned weights at zero after every later update. This is the
//! method of Zhu & Gupta (2017), "To prune, or not to prune", as TensorFlow
//! Model Optimization's `prune_low_magnitude` with `PolynomialDecay` applies
//! it. An export (psx/export.hpp) then stores the pruned tensors sparsely.
//!
//! @code
//! psx::optim::Pruned<psx::optim::Adam> opt{
//!     .optimizer = {.lr = 0.01},
//!     .schedule = {.initial_sparsity = 0.0, .final_sparsity = 0.8, .begin_step = 100, .end_step = 1000, .frequency = 50},
//!     .names = {"dense*/kernel"}};
//! @endcode
//!
//! Ranking is per shard: a variable split over several servers reaches the
//! sparsity on each shard (so overall), each ranking its own weights; one
//! server holding the variable ranks it whole, as TensorFlow does. Row
//! pushes (sparse variables) apply the mask but never recompute it.
#pragma once

#include <psx/concepts.hpp>
#include <psx/errors.hpp>
#include <psx/schedule.hpp>
#include <psx/sync.hpp>
#include <psx/variable.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

namespace psx {
inline namespace v0 {
namespace optim {

//! TensorFlow Model Optimization's `PolynomialDecay` pruning schedule, at
//! training step `t` (0-based; an update of global step g is at t = g - 1):
//!
//!     p(t)        = clamp((t - begin_step) / (end_step - begin_step), 0, 1)
//!     sparsity(t) = final + (initial - final) * (1 - p(t))^power
//!
//! The mask is recomputed at `begin_step <= t <= end_step` when
//! `(t - begin_step) % frequency == 0`; between those steps, and after
//! `end_step`, it stays as it is.
struct PolynomialDecaySparsity {
  double initial_sparsity = 0.0;
  double final_sparsity = 0.5;
  std::uint64_t begin_step = 0;
  std::uint64_t end_step = 1000;
  std::uint64_t frequency = 100;
  double power = 3.0;

  double sparsity(std::uint64_t t) const noexcept {
    const double span = static_cast<double>(end_step - begin_step);
    const double p = t <= begin_step ? 0.0 : std::min(1.0, static_cast<double>(t - begin_step) / span);
    return final_sparsity + (initial_sparsity - final_sparsity) * std::pow(1.0 - p, power);
  }
  bool prunes_at(std::uint64_t t) const noexcept {
    return t >= begin_step && t <= end_step && (t - begin_step) % frequency == 0;
  }
  void validate() const {
    if (!(initial_sparsity >= 0.0 && initial_sparsity <= final_sparsity && final_sparsity < 1.0))
      throw config_error("psx: PolynomialDecaySparsity needs 0 <= initial_sparsity <= final_sparsity < 1, got " +
                         std::to_string(initial_sparsity) + " and " + std::to_string(final_sparsity));
    if (end_step <= begin_step || frequency == 0 || !(power > 0.0))
      throw config_error("psx: PolynomialDecaySparsity needs begin_step < end_step, frequency >= 1 and power > 0, got " +
                         std::to_string(begin_step) + ", " + std::to_string(end_step) + ", " +
                         std::to_string(frequency) + ", " + std::to_string(power));
  }
  friend bool operator==(const PolynomialDecaySparsity&, const PolynomialDecaySparsity&) = default;
  friend std::ostream& operator<<(std::ostream& os, const PolynomialDecaySparsity& s) {
    return os << "PolynomialDecaySparsity{" << s.initial_sparsity << " -> " << s.final_sparsity << ", steps "
              << s.begin_step << ".." << s.end_step << " every " << s.frequency << ", power " << s.power << '}';
  }
};

//! `O` with magnitude pruning of the variables named by `names` (glob
//! patterns, `*` and `?`; empty: every dense variable). Keeps `O`'s slots
//! plus one, the mask (1 kept, 0 pruned), which checkpoints save like any slot.
template <Optimizer O>
struct Pruned {
  O optimizer{};
  PolynomialDecaySparsity schedule{};
  std::vector<std::string> names{};

  static constexpr bool accepts_rows = psx::accepts_rows<O>();
  std::size_t slots() const noexcept { return optimizer.slots() + 1; }
  float initial_slot(std::size_t k) const { return k < optimizer.slots() ? psx::initial_slot(optimizer, k) : 1.0f; }
  void validate(const VariableMeta& v, std::size_t shards) const {
    ::psx::detail::validate_for(v, [&] { schedule.validate(); });
    validate_optimizer(optimizer, v, shards);
  }

  //! Whether variable `v` is pruned.
  bool prunes(const VariableMeta& v) const {
    if (names.empty()) return v.kind == VariableKind::dense;
    return std::any_of(names.begin(), names.end(), [&](const std::string& p) { return sync::detail::glob_match(p, v.name); });
  }

  void update(std::span<float> w, std::span<const float> g, const SlotView& s, const UpdateContext& ctx) const {
    const std::size_t inner = optimizer.slots();
    optimizer.update(w, g, s.first(inner), ctx);
    if (!ctx.variable || !prunes(*ctx.variable)) return;
    const std::span<float> mask = s[inner];
    const std::uint64_t t = ctx.global_step == 0 ? 0 : ctx.global_step - 1;
    if (!ctx.rows && schedule.prunes_at(t)) remask(w, mask, schedule.sparsity(t));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = mask[i] != 0.0f ? w[i] : 0.0f;  // +0, never -0
  }

  friend bool operator==(const Pruned&, const Pruned&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Pruned& p) {
    os << "Pruned{" << p.optimizer << ", " << p.schedule << ", names=[";
    for (std::size_t i = 0; i < p.names.size(); ++i) os << (i ? ", " : "") << p.names[i];
    return os << "]}";
  }

 private:
  // As TensorFlow Model Optimization's `_update_mask`: keeps the
  // k = max(round(n * (1 - sparsity)), 1) largest |w| (in float32, halves
  // to even) and every weight as large as the k-th (ties at the threshold
  // are kept, so equal weights are never told apart); masks the rest. A
  // NaN counts as the largest (kept; TensorFlow's comparison masks it).
  static void remask(std::span<const float> w, std::span<float> mask, double sparsity) {
    std::fill(mask.begin(), mask.end(), 1.0f);
    auto magnitude = [](float x) {
      const float a = std::fabs(x);
      return std::isnan(a) ? INFINITY : a;
    };
    const float kept = std::nearbyint(static_cast<float>(w.size()) * (1.0f - static_cast<float>(sparsity)));
    const std::size_t keep = std::max<std::size_t>(1, static_cast<std::size_t>(kept));
    if (keep >= w.size()) return;
    std::vector<float> largest(w.size());
    std::transform(w.begin(), w.end(), largest.begin(), magnitude);
    std::nth_element(largest.begin(), largest.begin() + static_cast<std::ptrdiff_t>(keep - 1), largest.end(),
                     std::greater<float>());
    const float threshold = largest[keep - 1];
    for (std::size_t i = 0; i < w.size(); ++i)
      if (magnitude(w[i]) < threshold) mask[i] = 0.0f;
  }
};

}  // namespace optim
}  // namespace v0
}  // namespace psx
