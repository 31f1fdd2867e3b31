//! @file psx/sync.hpp
//! Built-in sync policies: when a push is applied and when a pull may return.
//! The concept is `psx::SyncPolicy` in `psx/concepts.hpp`; docs/sync.md gives
//! each policy's definition, guarantees and references.
#pragma once

#include <psx/concepts.hpp>
#include <psx/errors.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace psx {
inline namespace v0 {
namespace sync {

//! How an aggregated step combines the workers' gradients.
enum class Aggregate : std::uint8_t {
  mean,  //!< the sum divided by the number of gradients it stands for (see each policy)
  sum,   //!< the plain sum
};

inline std::ostream& operator<<(std::ostream& os, Aggregate a) { return os << (a == Aggregate::mean ? "mean" : "sum"); }

//! A staleness bound that never makes a pull wait.
inline constexpr std::size_t unbounded = std::numeric_limits<std::size_t>::max();

namespace detail {

// Steps applied per completed clock, in worker order: shared by Synchronous
// (K = 0) and BoundedStaleness (any K).
struct ClockedSteps {
  std::uint64_t bound;  // how many steps a reader may be ahead of the applied ones
  Aggregate aggregate;
  OnWorkerLost lost;

  PushAction on_push(const PushInfo& p, const ShardProgress& s, const ServerClock&) const {
    // A push stamped with a step the shard already applied comes from a worker
    // that did not wait for that step: refuse rather than apply it to the wrong one.
    if (p.clock < s.applied_steps) return {PushAction::Kind::reject, 1.0f, 0};
    return {PushAction::Kind::aggregate, 1.0f, p.clock};
  }
  bool may_pull(const PullInfo& p, const ShardProgress& s, const ServerClock&) const {
    return p.clock <= s.applied_steps || p.clock - s.applied_steps <= bound;
  }
  bool step_complete(const StepProgress& p, const ShardProgress&, const ServerClock& c) const {
    return c.min_clock > p.step;
  }
  void finish(std::span<float> sum, const StepProgress& p, const ShardProgress&, const ServerClock& c) const {
    if (aggregate == Aggregate::sum) return;
    // The mean over the workers that took part in the step: those that
    // finished it, whether or not they are still training, and those whose
    // gradient is in it though they left or were lost before finishing it.
    std::size_t finished = 0;
    for (std::uint64_t clock : c.worker_clocks) finished += clock > p.step;
    const std::size_t n = finished + (p.contributors - p.finished_contributors);
    const float d = static_cast<float>(n > 0 ? n : 1);
    for (float& x : sum) x /= d;
  }
  OnWorkerLost on_worker_lost(std::size_t, const ServerClock&) const { return lost; }
};

// '*' matches any run of characters, '?' any one character.
inline bool glob_match(std::string_view pattern, std::string_view name) {
  std::size_t p = 0, n = 0, star = std::string_view::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace detail

//! Bulk-synchronous parallel (BSP).
//!
//! The pushes a worker makes between two `step()` calls are its gradient for
//! that step. A server applies step `t` once every worker still training has
//! called `step()` for it, as one update: the workers' gradients added in
//! worker order 0, 1, ..., N-1 (bit-reproducible), then, for
//! `Aggregate::mean`, divided by the number of workers that took part in the
//! step: N, unless some left or were lost before it (a worker that pushed
//! and then left without calling `step()` counts). A pull from
//! a worker at clock `t` returns once steps `0 .. t-1` are applied.
struct Synchronous {
  Aggregate aggregate = Aggregate::mean;
  //! `fail`: a lost worker stops training with `psx::peer_lost`;
  //! `shrink`: the others carry on without it (the mean divides by fewer).
  OnWorkerLost on_worker_lost = OnWorkerLost::fail;

  detail::ClockedSteps make_state(std::size_t) const { return {0, aggregate, on_worker_lost}; }
  friend bool operator==(const Synchronous&, const Synchronous&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Synchronous& p) {
    return os << "Synchronous{" << p.aggregate << ", on_worker_lost=" << p.on_worker_lost << '}';
  }
};
static_assert(SyncPolicy<Synchronous>);

//! Stale synchronous parallel (SSP, Ho et al. 2013) with staleness bound K.
//!
//! A worker at clock `c` may read once every worker still training has
//! reached clock `c - K`: what it reads includes every update of steps
//! `0 .. c-K-1`. Updates are applied as in `Synchronous`, one aggregate per
//! step in worker order, when every worker finished the step; so `K = 0` is
//! BSP bit for bit, and with `K = sync::unbounded` no pull ever waits. Every
//! applied gradient's staleness (shard version when applied minus the
//! version the worker had read) is at most K, and is recorded in the
//! server's histogram (`ServerStats::staleness`).
template <std::size_t K>
struct BoundedStaleness {
  static constexpr std::size_t staleness_bound = K;
  Aggregate aggregate = Aggregate::mean;
  OnWorkerLost on_worker_lost = OnWorkerLost::fail;

  detail::ClockedSteps make_state(std::size_t) const {
    return {K == unbounded ? std::numeric_limits<std::uint64_t>::max() : std::uint64_t{K}, aggregate,
            on_worker_lost};
  }
  friend bool operator==(const BoundedStaleness&, const BoundedStaleness&) = default;
  friend std::ostream& operator<<(std::ostream& os, const BoundedStaleness& p) {
    os << "BoundedStaleness<";
    if (K == unbounded) os << "unbounded";
    else os << K;
    return os << ">{" << p.aggregate << ", on_worker_lost=" << p.on_worker_lost << '}';
  }
};
static_assert(SyncPolicy<BoundedStaleness<2>>);

//! Synchronous replicas with backup workers: each step applies the first M
//! gradients of the N workers (TensorFlow's SyncReplicasOptimizer with
//! `replicas_to_aggregate = M`).
//!
//! A gradient belongs to the step the worker read (the shard's step count at
//! its last pull). A shard applies step `t` as soon as M workers have
//! contributed to it, in worker order, divided by the number of
//! contributions for `Aggregate::mean` (M, or fewer when a step completes
//! with the workers that remain, below).
//! Gradients that arrive for a step already applied are dropped and counted
//! (`ServerStats::dropped`), never applied to another step. A worker that
//! contributed to step `t` reads again once `t` is applied. A lost worker
//! (one that failed) is tolerated while M others remain; otherwise training
//! fails with `psx::peer_lost`. Workers that finish and leave lower the
//! requirement instead: a step also completes once every worker still
//! training is in it, so unequal step counts end cleanly; and once a worker
//! is gone, a worker that no live worker is behind reads at once, which
//! breaks any cycle of waits on different shards' steps (its next push to a
//! step it is already in is dropped; a worker stalled mid-training needs a
//! peer timeout to count as gone: docs/sync.md). A worker's
//! `step()` that pushed nothing to a shard counts there as an empty
//! contribution (in M and in the mean), so a sparse step that skips a shard
//! never leaves that shard waiting for it.
template <std::size_t M>
struct SyncReplicas {
  static_assert(M >= 1, "SyncReplicas<M>: a step needs at least one gradient");
  static constexpr std::size_t replicas_to_aggregate = M;
  Aggregate aggregate = Aggregate::mean;

  struct State {
    Aggregate aggregate;
    // A step() that skipped a shard still counts there (else, with M = N, a
    // shard that a worker's sparse step did not touch would wait for it).
    static constexpr bool counts_empty_steps = true;

    PushAction on_push(const PushInfo& p, const ShardProgress& s, const ServerClock&) const {
      if (p.pulled_step < s.applied_steps) return {PushAction::Kind::drop, 1.0f, 0};
      return {PushAction::Kind::aggregate, 1.0f, p.pulled_step};
    }
    bool may_pull(const PullInfo& p, const ShardProgress& s, const ServerClock& c) const {
      if (!p.has_pushed || s.applied_steps > p.pushed_step) return true;
      // Each shard counts its own steps, so one worker may be in the step
      // a shard waits for while the workers that step needs wait for steps
      // of other shards. Once a worker has left or was lost, such waits can
      // close into a cycle; so then a worker that no live worker is behind
      // reads at once, and its next push to a step it is already in is
      // dropped (Server): the slowest worker always moves, which breaks any
      // cycle. The rule is local, so it also fires when nothing is stuck.
      const bool someone_gone = c.live_workers < c.worker_clocks.size();
      return someone_gone && p.clock <= c.min_clock;
    }
    bool step_complete(const StepProgress& p, const ShardProgress&, const ServerClock& c) const {
      // Once workers that finished their steps have left, fewer than M may
      // remain: then a step also completes when every remaining one is in it.
      return p.contributors >= M || (p.contributors > 0 && p.live_contributors == c.live_workers);
    }
    void finish(std::span<float> sum, const StepProgress& p, const ShardProgress&, const ServerClock&) const {
      if (aggregate == Aggregate::sum || p.contributors == 0) return;
      const float n = static_cast<float>(p.contributors);
      for (float& x : sum) x /= n;
    }
    OnWorkerLost on_worker_lost(std::size_t, const ServerClock& c) const {
      // `c` still counts the lost worker.
      return c.live_workers > M ? OnWorkerLost::shrink : OnWorkerLost::fail;
    }
  };

  State make_state(std::size_t num_workers) const {
    if (num_workers < M)
      throw config_error("psx: SyncReplicas<" + std::to_string(M) + "> needs at least " + std::to_string(M) +
                         " workers, the cluster has " + std::to_string(num_workers));
    return {aggregate};
  }
  friend bool operator==(const SyncReplicas&, const SyncReplicas&) = default;
  friend std::ostream& operator<<(std::ostream& os, const SyncReplicas& p) {
    return os << "SyncReplicas<" << M << ">{" << p.aggregate << '}';
  }
};
static_assert(SyncPolicy<SyncReplicas<2>>);

//! Asynchronous parallel (ASP): every push is applied alone on arrival and
//! pulls never wait. A lost worker is simply no longer heard from.
//!
//! Options from the asynchronous-SGD literature, both off by default:
//! - `staleness_scaled_lr`: the learning rate of a gradient of staleness `s`
//!   (updates applied to the shard since the worker read it) is
//!   `lr / (1 + s)` (Zhang et al. 2016, "Staleness-aware async-SGD").
//! - `delay_compensation = lambda > 0`: DC-ASGD (Zheng et al. 2017): the
//!   gradient applied is `g + lambda * g * g * (w_now - w_read)` elementwise,
//!   `w_read` being the values the worker last pulled (the server keeps a copy
//!   per worker).
struct Asynchronous {
  bool staleness_scaled_lr = false;
  float delay_compensation = 0.0f;

  struct State {
    bool scaled;
    float lambda;

    PushAction on_push(const PushInfo& p, const ShardProgress& s, const ServerClock&) const {
      const std::uint64_t staleness = s.version > p.pulled_version ? s.version - p.pulled_version : 0;
      return {PushAction::Kind::apply, scaled ? 1.0f / (1.0f + static_cast<float>(staleness)) : 1.0f, 0};
    }
    bool may_pull(const PullInfo&, const ShardProgress&, const ServerClock&) const { return true; }
    bool step_complete(const StepProgress&, const ShardProgress&, const ServerClock&) const { return false; }
    void finish(std::span<float>, const StepProgress&, const ShardProgress&, const ServerClock&) const {}
    OnWorkerLost on_worker_lost(std::size_t, const ServerClock&) const { return OnWorkerLost::shrink; }

    bool compensates(const VariableMeta&) const { return lambda > 0.0f; }
    void compensate(const VariableMeta&, std::span<float> g, std::span<const float> now,
                    std::span<const float> pulled) const {
      for (std::size_t i = 0; i < g.size(); ++i) g[i] += lambda * g[i] * g[i] * (now[i] - pulled[i]);
    }
  };

  State make_state(std::size_t) const { return {staleness_scaled_lr, delay_compensation}; }
  friend bool operator==(const Asynchronous&, const Asynchronous&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Asynchronous& p) {
    return os << "Asynchronous{staleness_scaled_lr=" << (p.staleness_scaled_lr ? "true" : "false")
              << ", delay_compensation=" << p.delay_compensation << '}';
  }
};
static_assert(SyncPolicy<Asynchronous>);

//! Two policies in one: each variable follows `First` unless its name matches
//! one of `second_names` (glob patterns, `*` and `?`) or its
//! `VariableSpec::sync_group` equals `second_group` (when not empty); then it
//! follows `Second`. E.g. embeddings asynchronous, dense layers synchronous:
//!
//! @code
//! psx::sync::Hybrid<psx::sync::Synchronous, psx::sync::Asynchronous> h{.second_names = {"embedding/*"}};
//! @endcode
//!
//! A lost worker fails training if either policy says so.
template <class First, class Second>
struct Hybrid {
  First first{};
  Second second{};
  std::vector<std::string> second_names{};
  std::string second_group{};

  struct State {
    using FirstState = decltype(std::declval<const First&>().make_state(std::size_t{}));
    using SecondState = decltype(std::declval<const Second&>().make_state(std::size_t{}));
    FirstState a;
    SecondState b;
    std::vector<std::string> names;
    std::string group;
    mutable std::vector<signed char> route;  // by variable id: -1 unknown, 0 first, 1 second

    bool second(const VariableMeta& v) const {
      if (v.id >= route.size()) route.resize(v.id + 1, -1);
      if (route[v.id] < 0) {
        bool match = !group.empty() && v.sync_group == group;
        for (const auto& pattern : names) match = match || detail::glob_match(pattern, v.name);
        route[v.id] = match ? 1 : 0;
      }
      return route[v.id] == 1;
    }

    PushAction on_push(const PushInfo& p, const ShardProgress& s, const ServerClock& c) {
      return second(*s.variable) ? b.on_push(p, s, c) : a.on_push(p, s, c);
    }
    bool may_pull(const PullInfo& p, const ShardProgress& s, const ServerClock& c) const {
      return second(*s.variable) ? b.may_pull(p, s, c) : a.may_pull(p, s, c);
    }
    bool step_complete(const StepProgress& p, const ShardProgress& s, const ServerClock& c) const {
      return second(*s.variable) ? b.step_complete(p, s, c) : a.step_complete(p, s, c);
    }
    void finish(std::span<float> sum, const StepProgress& p, const ShardProgress& s, const ServerClock& c) const {
      if (second(*s.variable)) b.finish(sum, p, s, c);
      else a.finish(sum, p, s, c);
    }
    OnWorkerLost on_worker_lost(std::size_t w, const ServerClock& c) const {
      const bool fail = a.on_worker_lost(w, c) == OnWorkerLost::fail || b.on_worker_lost(w, c) == OnWorkerLost::fail;
      return fail ? OnWorkerLost::fail : OnWorkerLost::shrink;
    }
    // A SyncReplicas variable needs the empty steps counted, the others must
    // not have them (they would count in a Synchronous mean).
    bool counts_empty(const VariableMeta& v) const {
      return second(v) ? psx::detail::counts_empty(b, v) : psx::detail::counts_empty(a, v);
    }
    bool compensates(const VariableMeta& v) const {
      if (second(v)) {
        if constexpr (psx::detail::has_compensation<SecondState>) return b.compensates(v);
      } else {
        if constexpr (psx::detail::has_compensation<FirstState>) return a.compensates(v);
      }
      return false;
    }
    void compensate(const VariableMeta& v, std::span<float> g, std::span<const float> now,
                    std::span<const float> pulled) const {
      if (second(v)) {
        if constexpr (psx::detail::has_compensation<SecondState>) b.compensate(v, g, now, pulled);
      } else {
        if constexpr (psx::detail::has_compensation<FirstState>) a.compensate(v, g, now, pulled);
      }
    }
  };

  State make_state(std::size_t num_workers) const {
    return {first.make_state(num_workers), second.make_state(num_workers), second_names, second_group, {}};
  }
  friend bool operator==(const Hybrid&, const Hybrid&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Hybrid& p) {
    os << "Hybrid{" << p.first << ", " << p.second << " for";
    for (const auto& n : p.second_names) os << " '" << n << '\'';
    if (!p.second_group.empty()) os << " group '" << p.second_group << '\'';
    return os << '}';
  }
};

}  // namespace sync
}  // namespace v0
}  // namespace psx
