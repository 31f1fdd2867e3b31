//! @file psx/gradients.hpp
//! The worker-side gradient pipeline, applied before a push: gradient
//! clipping with TensorFlow's semantics (`tf.clip_by_value`,
//! `tf.clip_by_norm`, `tf.linalg.global_norm`, `tf.clip_by_global_norm`) as
//! free functions on float spans, and `psx::GradientPipeline`, which
//! accumulates the gradients of k micro-batches, clips the result and pushes
//! it. See docs/gradients.md.
#pragma once

#include <psx/detail/span.hpp>
#include <psx/errors.hpp>
#include <psx/worker.hpp>

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {

namespace detail {

// The shortest text that reads back as `x`: 6.5 prints "6.5", not "6.500000".
inline std::string float_text(float x) {
  char buf[32];
  const auto end = std::to_chars(buf, buf + sizeof buf, x).ptr;
  return std::string(buf, end);
}

// "1 row", "2 rows"; "1 micro-batch", "2 micro-batches".
inline std::string noun_count(std::size_t n, std::string_view noun) {
  const bool es = noun.ends_with("ch");
  return std::to_string(n) + " " + std::string(noun) + (n == 1 ? "" : es ? "es" : "s");
}

// Accumulated in double: a float sum of squares overflows once an element passes 1.8e19, and
// stops growing once the sum is 2^24 times the next term.
inline double sum_of_squares(std::span<const float> g) noexcept {
  double s = 0.0;
  for (const float x : g) s += static_cast<double>(x) * static_cast<double>(x);
  return s;
}

inline void scale_by(std::span<float> g, double factor) noexcept {
  for (float& x : g) x = static_cast<float>(static_cast<double>(x) * factor);
}

inline void check_clip_value(float lo, float hi, std::string_view who) {
  const std::string call = std::string(who) + "clip_by_value(" + float_text(lo) + ", " + float_text(hi) + ")";
  if (std::isnan(lo) || std::isnan(hi)) throw config_error(call + ": the bounds must not be NaN");
  if (lo > hi) throw config_error(call + ": lo must be <= hi");
}

// `call` is the function's name: "clip_by_norm" or "clip_by_global_norm".
inline void check_clip_norm(float clip_norm, std::string_view call, std::string_view who) {
  const auto fail = [&](std::string_view why) {
    throw config_error(std::string(who) + std::string(call) + "(" + float_text(clip_norm) + "): " + std::string(why));
  };
  if (!(clip_norm > 0.0f)) fail("the norm must be > 0");
  // TF would turn every element into NaN (inf * 0); leaving the stage out is what was meant.
  if (std::isinf(clip_norm)) fail("the norm must be finite (leave the stage out not to clip)");
}

// The factor clip_by_norm and clip_by_global_norm multiply by:
// clip_norm / max(norm, clip_norm), exactly 1 when nothing is clipped.
inline double clip_factor(double norm, float clip_norm) noexcept {
  return norm <= clip_norm ? 1.0 : clip_norm / norm;  // NaN norm: NaN
}

}  // namespace detail

//! Clamps every element of `g` to `[lo, hi]`, like `tf.clip_by_value`
//! (`min(max(g, lo), hi)`); NaN elements stay NaN. Throws
//! `psx::config_error` when `lo > hi` or a bound is NaN.
inline void clip_by_value(std::span<float> g, float lo, float hi) {
  detail::check_clip_value(lo, hi, "psx: ");
  for (float& x : g) x = x < lo ? lo : hi < x ? hi : x;
}

//! Rescales `g` so that its l2 norm is at most `clip_norm`, like
//! `tf.clip_by_norm`: `g * clip_norm / max(l2norm(g), clip_norm)`, so `g` is
//! left exactly as it is when its norm is `<= clip_norm`. Returns the norm
//! before clipping (the sum of squares is accumulated in double, and the
//! clipping done with it; the float returned is +inf for a norm above
//! FLT_MAX, as of `{3e38, 3e38}`, whose clipping is still right). As in TF,
//! an infinite norm makes finite elements 0 and infinite ones NaN, and a NaN
//! norm makes every element NaN. Throws `psx::config_error` unless
//! `clip_norm` is finite and `> 0`.
inline float clip_by_norm(std::span<float> g, float clip_norm) {
  detail::check_clip_norm(clip_norm, "clip_by_norm", "psx: ");
  const double norm = std::sqrt(detail::sum_of_squares(g));
  if (const double f = detail::clip_factor(norm, clip_norm); f != 1.0) detail::scale_by(g, f);
  return static_cast<float>(norm);
}

//! The l2 norm of all tensors together, like `tf.linalg.global_norm`:
//! `sqrt(sum over tensors of l2norm(t)^2)`, accumulated in double (+inf
//! when it is above FLT_MAX).
inline float global_norm(std::span<const std::span<const float>> grads) noexcept {
  double sum = 0.0;
  for (const auto g : grads) sum += detail::sum_of_squares(g);
  return static_cast<float>(std::sqrt(sum));
}
//! `global_norm({a, b, ...})`.
inline float global_norm(std::initializer_list<std::span<const float>> grads) noexcept {
  return global_norm(std::span(grads.begin(), grads.size()));
}

//! Rescales every tensor of `grads` by `clip_norm / max(global_norm, clip_norm)`,
//! like `tf.clip_by_global_norm` (Pascanu et al., 2013): nothing changes when
//! the global norm is `<= clip_norm`. Returns the global norm before
//! clipping (in double; the float returned is +inf above FLT_MAX, while the
//! clipping is right). As in TF, when the global norm is infinite or NaN every element
//! of every tensor becomes NaN, to signal the error. Throws
//! `psx::config_error` unless `clip_norm` is finite and `> 0`.
inline float clip_by_global_norm(std::span<const std::span<float>> grads, float clip_norm) {
  detail::check_clip_norm(clip_norm, "clip_by_global_norm", "psx: ");
  double sum = 0.0;
  for (const auto g : grads) sum += detail::sum_of_squares(g);
  const double norm = std::sqrt(sum);
  // A non-finite norm makes every element NaN, as in TF: `scale + (norm - norm)`.
  const double f = std::isfinite(norm) ? detail::clip_factor(norm, clip_norm) : std::nan("");
  if (f != 1.0)
    for (const auto g : grads) detail::scale_by(g, f);
  return static_cast<float>(norm);
}
//! `clip_by_global_norm({a, b, ...}, clip_norm)`.
inline float clip_by_global_norm(std::initializer_list<std::span<float>> grads, float clip_norm) {
  return clip_by_global_norm(std::span(grads.begin(), grads.size()), clip_norm);
}

//! What `GradientPipeline::accumulate` pushes: the mean of the k micro-batch
//! gradients (their sum divided by k), or their sum.
enum class Accumulate { mean, sum };

inline std::ostream& operator<<(std::ostream& os, Accumulate a) {
  return os << (a == Accumulate::mean ? "mean" : "sum");
}

//! One sparse gradient of a micro-batch: row `j` of `grads` (row-major, the
//! variable's row width) is the gradient of row `ids[j]`, as in `Worker::push_rows`.
struct RowsGrad {
  std::string_view name;
  std::span<const std::uint64_t> ids;
  std::span<const float> grads;
};

//! The worker-side gradient pipeline: gradient accumulation over k
//! micro-batches, then clipping stages, then the push.
//!
//! Each `push(worker, dense, rows)` hands it one micro-batch. The pipeline
//! sums the gradients into buffers it owns (variables in first-come order;
//! sparse gradients by concatenating ids and rows, as TF's `IndexedSlices`
//! do, and the servers sum repeated ids) and on every k-th call pushes the
//! sum, divided by k for `Accumulate::mean`, after running the clipping
//! stages on it in the order they were added. A variable missing from a
//! micro-batch counts as a zero gradient there. A frozen variable's gradients
//! are dropped: neither accumulated, nor counted in a norm, nor pushed (as
//! if left out of TF's trainable variables).
//!
//! Without any stage (the default, k = 1) every call is forwarded as it
//! is, without a copy. The buffers are reused: in steady state, accumulating
//! dense gradients allocates nothing. Copying a pipeline copies its
//! configuration and what it has accumulated. Use it from one thread.
//!
//! @code
//! psx::GradientPipeline pipe;
//! pipe.accumulate(4).clip_by_global_norm(5.0f);
//! if (pipe.push(w, {{"w", grad}})) w.step();
//! @endcode
class GradientPipeline {
 public:
  //! Pushes every k-th micro-batch the mean (or sum) of the last k; throws
  //! `psx::config_error` when `k == 0`, or while micro-batches are pending
  //! (`pending() > 0`: push them or `reset()` first).
  GradientPipeline& accumulate(std::size_t k, Accumulate mode = Accumulate::mean) {
    const std::string call = "psx: GradientPipeline: accumulate(" + std::to_string(k) + ")";
    if (k == 0) throw config_error(call + ": k must be >= 1");
    if (pending_ != 0)
      throw config_error(call + " with " + detail::noun_count(pending_, "micro-batch") +
                         " pending: push or reset() first");
    k_ = k;
    mode_ = mode;
    return *this;
  }
  //! Adds a stage clamping every element of every variable to `[lo, hi]`
  //! (`psx::clip_by_value`).
  GradientPipeline& clip_by_value(float lo, float hi) {
    detail::check_clip_value(lo, hi, prefix);
    stages_.push_back({Stage::value, lo, hi});
    return *this;
  }
  //! Adds a stage clipping each variable's gradient to l2 norm `clip_norm`
  //! on its own (`psx::clip_by_norm`).
  GradientPipeline& clip_by_norm(float clip_norm) {
    detail::check_clip_norm(clip_norm, "clip_by_norm", prefix);
    stages_.push_back({Stage::norm, clip_norm, 0.0f});
    return *this;
  }
  //! Adds a stage clipping the gradients of all the variables of the push
  //! to global norm `clip_norm` together (`psx::clip_by_global_norm`).
  GradientPipeline& clip_by_global_norm(float clip_norm) {
    detail::check_clip_norm(clip_norm, "clip_by_global_norm", prefix);
    stages_.push_back({Stage::global_norm, clip_norm, 0.0f});
    return *this;
  }
  //! Drops the gradients of variable `name` from now on, including what was
  //! accumulated for it and not pushed yet.
  GradientPipeline& freeze(std::string name) {
    if (auto it = dense_index_.find(name); it != dense_index_.end()) dense_[it->second].active = false;
    if (auto it = rows_index_.find(name); it != rows_index_.end()) rows_[it->second].active = false;
    frozen_.insert(std::move(name));
    return *this;
  }
  //! Takes the gradients of `name` again.
  GradientPipeline& unfreeze(std::string_view name) {
    if (auto it = frozen_.find(name); it != frozen_.end()) frozen_.erase(it);
    return *this;
  }
  //! True if `freeze(name)` was called and `unfreeze(name)` not since.
  bool frozen(std::string_view name) const { return frozen_.find(name) != frozen_.end(); }

  //! Takes one micro-batch; returns true when this call pushed (every k-th
  //! call), false when it only accumulated. The dense gradients go as one
  //! batched `Worker::push_async`, each sparse one as a `push_rows_async`,
  //! and the call returns once all are done.
  //!
  //! Every gradient is checked against its variable first (name, size, row
  //! ids, trainable), with the worker's typed errors (`psx::shape_error`
  //! naming the variable and both sizes, ...): a micro-batch that fails
  //! leaves the pipeline as it was. If the push itself fails, what was
  //! accumulated is dropped (`pending()` is 0) and the error propagates.
  bool push(Worker& w, std::span<const PushItem> dense, std::span<const RowsGrad> rows = {}) {
    check(w, dense, rows);
    if (forwards()) {
      forward(w, dense, rows);
      return true;
    }
    add(dense, rows);
    if (++pending_ < k_) return false;
    flush(w);
    return true;
  }
  //! `push(w, {{"w", grad_w}, {"b", grad_b}}, {{"emb", ids, grad_rows}})`.
  bool push(Worker& w, std::initializer_list<PushItem> dense, std::initializer_list<RowsGrad> rows = {}) {
    return push(w, std::span(dense.begin(), dense.size()), std::span(rows.begin(), rows.size()));
  }

  //! The global norm of the last pushed gradient, after accumulation and
  //! before clipping, over the variables not frozen; NaN before the first push.
  float last_global_norm() const noexcept { return last_norm_; }
  //! Micro-batches accumulated since the last push.
  std::size_t pending() const noexcept { return pending_; }
  //! Drops what has been accumulated (the configuration stays).
  void reset() noexcept {
    for (auto& d : dense_) d.active = false;
    for (auto& r : rows_) r.active = false;
    pending_ = 0;
  }

  //! Prints the configuration, e.g.
  //! `GradientPipeline{accumulate(4, mean), clip_by_global_norm(5), frozen: [bias]}`.
  friend std::ostream& operator<<(std::ostream& os, const GradientPipeline& p) {
    os << "GradientPipeline{accumulate(" << p.k_ << ", " << p.mode_ << ')';
    for (const Stage& s : p.stages_) {
      if (s.kind == Stage::value) os << ", clip_by_value(" << detail::float_text(s.a) << ", ";
      else os << (s.kind == Stage::norm ? ", clip_by_norm(" : ", clip_by_global_norm(");
      os << detail::float_text(s.kind == Stage::value ? s.b : s.a) << ')';
    }
    if (!p.frozen_.empty()) {
      const char* sep = ", frozen: [";
      for (const auto& n : p.frozen_) os << std::exchange(sep, ", ") << n;
      os << ']';
    }
    return os << '}';
  }

 private:
  static constexpr std::string_view prefix = "psx: GradientPipeline: ";

  struct Stage {
    enum Kind { value, norm, global_norm } kind;
    float a, b;  // clip_by_value: lo, hi; the norms: clip_norm
  };
  // The sum of one dense variable's gradients; `active` once this window has one.
  struct DenseSum {
    std::string name;
    std::vector<float> sum;
    bool active = false;
  };
  // The concatenated rows of one sparse variable in this window.
  struct RowsSum {
    std::string name;
    std::vector<std::uint64_t> ids;
    std::vector<float> grads;
    bool active = false;
  };
  // Per-push lists: not part of a pipeline's value, so a copy starts empty.
  struct Scratch {
    Scratch() = default;
    Scratch(const Scratch&) {}
    Scratch& operator=(const Scratch&) { return *this; }
    std::vector<PushItem> items;
    std::vector<RowsGrad> rows;
    std::vector<std::span<float>> spans;
    std::vector<Handle> handles;
  };

  bool forwards() const noexcept { return k_ == 1 && stages_.empty(); }

  std::string where() const {
    return std::string(prefix) + "micro-batch " + std::to_string(pending_ + 1) + " of " + std::to_string(k_) + ": ";
  }
  static constexpr std::string_view unchanged = "; nothing of this micro-batch was accumulated";

  // Everything the worker would refuse at the push, refused now, before
  // anything of the micro-batch is accumulated.
  void check(Worker& w, std::span<const PushItem> dense, std::span<const RowsGrad> rows) const {
    for (const PushItem& item : dense)
      if (!frozen(item.name)) check_dense(variable(w, item.name), item.grad.size());
    for (const RowsGrad& r : rows)
      if (!frozen(r.name)) check_rows(variable(w, r.name), r);
  }

  // The worker's unknown_variable, saying which micro-batch and that nothing was accumulated.
  const VariableInfo& variable(Worker& w, std::string_view name) const {
    try {
      return w.variable(name);
    } catch (const unknown_variable& e) {
      throw unknown_variable(where() + std::string(detail::without_psx_prefix(e.what())) + std::string(unchanged));
    }
  }

  void check_dense(const VariableInfo& v, std::size_t got) const {
    check_trainable(v);
    if (v.meta.kind == VariableKind::dynamic)
      throw shape_error(where() + "a dense gradient for '" + v.meta.name +
                        "', a dynamic table: it has no whole value; give its rows by id (RowsGrad)" +
                        std::string(unchanged));
    if (got == v.meta.size()) return;
    const DenseSum* acc = find(dense_, dense_index_, v.meta.name);
    const std::string expected = acc && acc->active ? "the one accumulated so far has " : "the variable has ";
    throw shape_error(where() + "the gradient of '" + v.meta.name + "' has " + detail::floats(got) + ", " +
                      expected + detail::floats(v.meta.size()) + " (shape " + detail::shape_string(v.meta.shape) +
                      ")" + std::string(unchanged));
  }

  void check_rows(const VariableInfo& v, const RowsGrad& r) const {
    check_trainable(v);
    const std::size_t width = v.meta.row_width;
    if (r.grads.size() != r.ids.size() * width)
      throw shape_error(where() + detail::noun_count(r.ids.size(), "row") + " of '" + v.meta.name + "' (row width " +
                        std::to_string(width) + (r.ids.size() == 1 ? ") needs " : ") need ") +
                        detail::floats(r.ids.size() * width) +
                        ", the gradient has " + detail::floats(r.grads.size()) + std::string(unchanged));
    if (v.meta.kind == VariableKind::dynamic) return;  // any 64-bit id
    for (std::size_t j = 0; j < r.ids.size(); ++j)
      if (r.ids[j] >= v.meta.rows)
        throw row_out_of_range(where() + "row id " + std::to_string(r.ids[j]) + " at position " +
                               std::to_string(j) + " of '" + v.meta.name + "' (" + std::to_string(v.meta.rows) +
                               " rows) is out of range" + std::string(unchanged));
  }

  void check_trainable(const VariableInfo& v) const {
    if (!v.trainable)
      throw frozen_variable(where() + "a gradient for '" + v.meta.name +
                            "', which the servers hold frozen (trainable = false); freeze(\"" + v.meta.name +
                            "\") drops it in the pipeline" + std::string(unchanged));
  }

  template <class Sum>
  static const Sum* find(const std::vector<Sum>& sums, const std::map<std::string, std::size_t, std::less<>>& index,
                         std::string_view name) {
    const auto it = index.find(name);
    return it == index.end() ? nullptr : &sums[it->second];
  }
  template <class Sum>
  static Sum& slot(std::vector<Sum>& sums, std::map<std::string, std::size_t, std::less<>>& index,
                   std::string_view name) {
    if (const auto it = index.find(name); it != index.end()) return sums[it->second];
    index.emplace(std::string(name), sums.size());
    Sum& added = sums.emplace_back();
    added.name = name;
    return added;
  }

  void add(std::span<const PushItem> dense, std::span<const RowsGrad> rows) {
    for (const PushItem& item : dense) {
      if (frozen(item.name)) continue;
      DenseSum& d = slot(dense_, dense_index_, item.name);
      if (!d.active) d.sum.assign(item.grad.begin(), item.grad.end());
      else
        for (std::size_t i = 0; i < d.sum.size(); ++i) d.sum[i] += item.grad[i];
      d.active = true;
    }
    for (const RowsGrad& r : rows) {
      if (frozen(r.name)) continue;
      RowsSum& s = slot(rows_, rows_index_, r.name);
      if (!s.active) {
        s.ids.clear();
        s.grads.clear();
      }
      s.ids.insert(s.ids.end(), r.ids.begin(), r.ids.end());
      s.grads.insert(s.grads.end(), r.grads.begin(), r.grads.end());
      s.active = true;
    }
  }

  // The buffers this window pushes (freeze() deactivates a variable's).
  void collect() {
    scratch_.spans.clear();
    for (auto& d : dense_)
      if (d.active) scratch_.spans.emplace_back(d.sum);
    for (auto& r : rows_)
      if (r.active) scratch_.spans.emplace_back(r.grads);
  }

  void run_stages() {
    for (const Stage& s : stages_) {
      if (s.kind == Stage::global_norm) {
        psx::clip_by_global_norm(std::span<const std::span<float>>(scratch_.spans), s.a);
        continue;
      }
      for (const auto g : scratch_.spans) {
        if (s.kind == Stage::value) psx::clip_by_value(g, s.a, s.b);
        else psx::clip_by_norm(g, s.a);
      }
    }
  }

  void flush(Worker& w) {
    // Whatever happens from here on, the next micro-batch starts a new window.
    struct Restart {
      GradientPipeline& p;
      ~Restart() { p.reset(); }
    } restart{*this};
    collect();
    if (mode_ == Accumulate::mean && k_ > 1)
      for (const auto g : scratch_.spans)
        for (float& x : g) x /= static_cast<float>(k_);
    double sum = 0.0;
    for (const auto g : scratch_.spans) sum += detail::sum_of_squares(g);
    last_norm_ = static_cast<float>(std::sqrt(sum));
    run_stages();

    scratch_.items.clear();
    scratch_.rows.clear();
    for (const auto& d : dense_)
      if (d.active) scratch_.items.push_back({d.name, d.sum});
    for (const auto& r : rows_)
      if (r.active) scratch_.rows.push_back({r.name, r.ids, r.grads});
    send(w, scratch_.items, scratch_.rows);
  }

  // k = 1 without stages: the caller's buffers go as they are.
  void forward(Worker& w, std::span<const PushItem> dense, std::span<const RowsGrad> rows) {
    scratch_.items.clear();
    scratch_.rows.clear();
    double sum = 0.0;
    for (const PushItem& item : dense)
      if (!frozen(item.name)) {
        scratch_.items.push_back(item);
        sum += detail::sum_of_squares(item.grad);
      }
    for (const RowsGrad& r : rows)
      if (!frozen(r.name)) {
        scratch_.rows.push_back(r);
        sum += detail::sum_of_squares(r.grads);
      }
    last_norm_ = static_cast<float>(std::sqrt(sum));
    send(w, scratch_.items, scratch_.rows);
  }

  // Sends everything, then waits for all of it, even after an error: the
  // servers read the buffers until then.
  void send(Worker& w, std::span<const PushItem> items, std::span<const RowsGrad> rows) {
    auto& handles = scratch_.handles;
    handles.clear();
    try {
      if (!items.empty()) handles.push_back(w.push_async(items));
      for (const RowsGrad& r : rows) handles.push_back(w.push_rows_async(r.name, r.ids, r.grads));
    } catch (...) {
      handles.clear();  // each Handle waits in its destructor
      throw;
    }
    std::exception_ptr first;
    for (Handle& h : handles) {
      try {
        h.wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    handles.clear();
    if (first) std::rethrow_exception(first);
  }

  std::size_t k_ = 1;
  Accumulate mode_ = Accumulate::mean;
  std::vector<Stage> stages_;
  std::set<std::string, std::less<>> frozen_;
  std::vector<DenseSum> dense_;
  std::map<std::string, std::size_t, std::less<>> dense_index_;
  std::vector<RowsSum> rows_;
  std::map<std::string, std::size_t, std::less<>> rows_index_;
  std::size_t pending_ = 0;
  float last_norm_ = std::numeric_limits<float>::quiet_NaN();
  Scratch scratch_;
};

}  // namespace v0
}  // namespace psx
