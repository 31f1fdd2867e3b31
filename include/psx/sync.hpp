//! @file psx/sync.hpp
//! Built-in sync policies: when a push is applied and when a pull may return.
//! The concept is `psx::SyncPolicy` in `psx/concepts.hpp`; docs/sync.md gives
//! each policy's definition.
#pragma once

#include <psx/concepts.hpp>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <span>

namespace psx {
inline namespace v0 {
namespace sync {

//! How a synchronous step combines the workers' gradients.
enum class Aggregate : std::uint8_t {
  mean,  //!< sum / num_workers (TensorFlow's SyncReplicasOptimizer)
  sum,   //!< the plain sum
};

inline std::ostream& operator<<(std::ostream& os, Aggregate a) {
  return os << (a == Aggregate::mean ? "mean" : "sum");
}

//! Bulk-synchronous parallel (BSP).
//!
//! Every push a worker makes between two `step()` calls is part of that
//! step's gradient. A server applies step `t` once every worker has called
//! `step()` for it (its clock passed `t`), as one update: the workers'
//! gradients added in worker order 0, 1, ..., N-1 (so runs are
//! bit-reproducible), then divided by N for `Aggregate::mean`. A pull from a
//! worker at clock `t` returns once steps `0 .. t-1` are applied, so every
//! worker reads the same parameters at the same step.
struct Synchronous {
  Aggregate aggregate = Aggregate::mean;

  struct State {
    Aggregate aggregate;
    std::size_t num_workers;

    PushAction on_push(const PushInfo& p, const ServerClock& c) const {
      // A push stamped with a step the server already applied comes from a
      // worker that never pulled that step's result: refuse rather than
      // apply it to the wrong step.
      if (p.clock < c.applied_steps) return {PushAction::Kind::reject, 1.0f};
      return {PushAction::Kind::aggregate, 1.0f};
    }
    bool may_pull(std::size_t, std::uint64_t clock, const ServerClock& c) const {
      return c.applied_steps >= clock;
    }
    bool step_complete(std::uint64_t step, const ServerClock& c) const { return c.min_clock > step; }
    void finish(std::span<float> sum, std::size_t) const {
      if (aggregate == Aggregate::sum) return;
      const float n = static_cast<float>(num_workers);
      for (float& x : sum) x /= n;
    }
  };

  State make_state(std::size_t num_workers) const { return {aggregate, num_workers}; }
  friend bool operator==(const Synchronous&, const Synchronous&) = default;
};
static_assert(SyncPolicy<Synchronous>);

//! Asynchronous parallel (ASP, Hogwild-style on a server): every push is
//! applied alone on arrival; pulls never wait.
struct Asynchronous {
  struct State {
    PushAction on_push(const PushInfo&, const ServerClock&) const { return {PushAction::Kind::apply, 1.0f}; }
    bool may_pull(std::size_t, std::uint64_t, const ServerClock&) const { return true; }
    bool step_complete(std::uint64_t, const ServerClock&) const { return true; }
    void finish(std::span<float>, std::size_t) const {}
  };

  State make_state(std::size_t) const { return {}; }
  friend bool operator==(const Asynchronous&, const Asynchronous&) = default;
};
static_assert(SyncPolicy<Asynchronous>);

}  // namespace sync
}  // namespace v0
}  // namespace psx
