//! @file psx/concepts.hpp
//! The four customization points of `psx::ParameterServer<P, S, O, T>`.
//!
//! Index
//! | concept              | slot | decides                                          | built-ins in            |
//! | -------------------- | ---- | ------------------------------------------------ | ----------------------- |
//! | `psx::Partitioner`   | P    | which server owns which rows of which variable   | `psx/partition.hpp`     |
//! | `psx::SyncPolicy`    | S    | when a push is applied and when a pull returns   | `psx/sync.hpp`          |
//! | `psx::Optimizer`     | O    | how a server turns a gradient into parameters    | `psx/optim.hpp`         |
//! | `psx::Transport`     | T    | how requests move between workers and servers    | `psx/transport/*.hpp`   |
//!
//! Helper concepts: `psx::SyncState` (what a SyncPolicy makes, one per
//! server) and `psx::Link` (what a Transport makes, one per cluster).
//!
//! Each policy is a plain value type: copyable, holding settings only. State
//! that changes during training (sync clocks, optimizer slots, sockets) lives
//! in objects the library creates from it, so one policy value serves many
//! servers and threads. `ParameterServer` checks each slot with the
//! `psx::explain_*` functions below, whose `static_assert` messages name the
//! missing member and the signature to write.
#pragma once

#include <psx/message.hpp>
#include <psx/variable.hpp>

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <span>
#include <type_traits>
#include <vector>

namespace psx {
inline namespace v0 {

// ---------------------------------------------------------------------------
// Vocabulary the concepts speak.
// ---------------------------------------------------------------------------

//! The optimizer state ("slots") of the parameters being updated: slot `k`
//! is a span of the same length as the parameters, element-aligned with them.
class SlotView {
 public:
  SlotView() = default;
  //! `bases[k]` points at slot k's element for parameter 0 of the shard;
  //! this view covers elements `[offset, offset + length)`.
  SlotView(float* const* bases, std::size_t count, std::size_t offset, std::size_t length) noexcept
      : bases_(bases), count_(count), offset_(offset), length_(length) {}

  //! Number of slots.
  std::size_t size() const noexcept { return count_; }
  //! Slot `k`, aligned with the parameters being updated.
  std::span<float> operator[](std::size_t k) const noexcept { return {bases_[k] + offset_, length_}; }
  //! The same view of the first `k` slots only (a wrapper's inner optimizer).
  SlotView first(std::size_t k) const noexcept { return {bases_, k < count_ ? k : count_, offset_, length_}; }

 private:
  float* const* bases_ = nullptr;
  std::size_t count_ = 0;
  std::size_t offset_ = 0;
  std::size_t length_ = 0;
};

//! What an optimizer knows about the update it applies.
struct UpdateContext {
  //! 1-based count of updates applied to this shard, this one included: the
  //! `t` of bias corrections.
  std::uint64_t step = 1;
  //! Factor on the learning rate: the sync policy's, times a schedule's
  //! (`psx::optim::Scheduled`); 1 by default.
  double lr_scale = 1.0;
  //! The variable being updated.
  const VariableMeta* variable = nullptr;
  //! 1-based training step this update belongs to: the aggregated step + 1
  //! for aggregating policies, the pushing worker's clock + 1 for a push
  //! applied on arrival. Schedules are evaluated at `global_step - 1`.
  std::uint64_t global_step = 1;
  //! True for a row push: `w`, `g` and the slots are one row, and only the
  //! pushed rows are updated (lazy semantics).
  bool rows = false;
};

//! One shard as a sync policy sees it.
struct ShardProgress {
  const VariableMeta* variable = nullptr;
  //! Updates applied to this shard so far (each apply, alone or aggregated, counts one).
  std::uint64_t version = 0;
  //! Aggregated steps this shard has completed (0, 1, 2, ...): the next step to apply.
  std::uint64_t applied_steps = 0;
};

//! A push as a sync policy sees it.
struct PushInfo {
  std::size_t worker = 0;
  //! The worker's clock when it pushed (steps it had finished).
  std::uint64_t clock = 0;
  //! The shard's `version` when this worker last pulled it (0 if never).
  std::uint64_t pulled_version = 0;
  //! The shard's `applied_steps` when this worker last pulled it (0 if never).
  std::uint64_t pulled_step = 0;
  const VariableMeta* variable = nullptr;
};

//! The aggregate of one step of one shard, as a sync policy sees it.
struct StepProgress {
  //! The step: the shard's next one to apply.
  std::uint64_t step = 0;
  //! Workers whose gradient is in the aggregate.
  std::size_t contributors = 0;
  //! Of those, the workers still training.
  std::size_t live_contributors = 0;
  //! Of those, the workers whose clock has passed `step` (they called
  //! `step()` after contributing).
  std::size_t finished_contributors = 0;
};

//! A pull as a sync policy sees it.
struct PullInfo {
  std::size_t worker = 0;
  //! The worker's clock when it pulled.
  std::uint64_t clock = 0;
  //! Whether the worker has pushed to this shard, and the step that push
  //! went to (or was dropped from).
  bool has_pushed = false;
  std::uint64_t pushed_step = 0;
};

//! A server's view of training progress, given to the sync policy.
struct ServerClock {
  //! Clock of each worker: number of `step()` calls the server has seen from it.
  std::span<const std::uint64_t> worker_clocks;
  //! Smallest clock among the workers still training (the largest clock
  //! once none is).
  std::uint64_t min_clock = 0;
  //! Workers still training: joined, not left, not lost.
  std::size_t live_workers = 0;
};

//! What a server does with a push.
struct PushAction {
  enum class Kind : std::uint8_t {
    apply,      //!< apply it now, alone, scaled by `lr_scale`
    aggregate,  //!< add it to the aggregate of step `step`, applied when that step completes (a
                //!< step holds one step() interval's pushes per worker: a later interval's push
                //!< into it is dropped and counted)
    drop,       //!< discard it and count it (a late gradient for a finished step)
    reject,     //!< refuse it: the worker gets `psx::sync_error`
  };
  Kind kind = Kind::apply;
  float lr_scale = 1.0f;
  //! For `aggregate`: the step the gradient belongs to.
  std::uint64_t step = 0;
};

//! What happens to training when a worker is lost (its function threw, or
//! it stopped answering for longer than the peer timeout).
enum class OnWorkerLost : std::uint8_t {
  fail,    //!< every waiting and later request fails with `psx::peer_lost` naming the worker
  shrink,  //!< carry on without it: the worker counts as having left
};

inline std::ostream& operator<<(std::ostream& os, OnWorkerLost o) {
  return os << (o == OnWorkerLost::fail ? "fail" : "shrink");
}

//! What a transport is told about the cluster it connects.
struct TransportContext {
  std::size_t num_servers = 1;
  std::size_t num_workers = 1;
  //! The declared variables and their placement (checks sizes of requests
  //! that arrive from other processes; both ends must agree on them).
  std::span<const VariableInfo> variables;
  //! `ClusterConfig::peer_timeout`: how long a silent peer may stay silent.
  std::chrono::milliseconds peer_timeout{0};
};

// ---------------------------------------------------------------------------
// Partitioner
// ---------------------------------------------------------------------------

namespace detail {
template <class P>
concept has_place = requires(const P& p, const VariableMeta& v, std::size_t num_servers) {
  { p.place(v, num_servers) } -> std::same_as<std::vector<Shard>>;
};
}  // namespace detail

//! Decides which server owns which rows of each variable.
//!
//! A type P is a Partitioner when:
//!  1. it is a copyable value type;
//!  2. `p.place(meta, num_servers)` (const) returns `std::vector<psx::Shard>`:
//!     shards ordered by row that tile `[0, meta.rows)` exactly, each on a
//!     server `< num_servers`. The library checks the answer and throws
//!     `psx::config_error` naming the variable when it does not tile.
//!     The answer must depend only on `meta` and `num_servers`, so every
//!     process computes the same placement.
//!
//! Optional: `place(meta, num_servers, std::span<const std::uint64_t>
//! server_bytes)`, which the cluster then calls instead, with the bytes each
//! server holds of the variables declared before (`partition::LeastLoaded`).
//!
//! @code
//! struct AllOnServerZero {
//!   std::vector<psx::Shard> place(const psx::VariableMeta& v, std::size_t) const {
//!     return {{0, 0, v.rows}};
//!   }
//! };
//! static_assert(psx::Partitioner<AllOnServerZero>);
//! @endcode
template <class P>
concept Partitioner = std::copy_constructible<P> && detail::has_place<P>;

//! Fails to compile, with a message naming the missing member, when P is not a Partitioner.
template <class P>
consteval bool explain_partitioner() {
  static_assert(std::copy_constructible<P>,
                "psx::Partitioner: the partitioner must be a copyable value type");
  static_assert(detail::has_place<P>,
                "psx::Partitioner: missing member "
                "`std::vector<psx::Shard> place(const psx::VariableMeta& v, std::size_t num_servers) const`");
  return true;
}

// ---------------------------------------------------------------------------
// SyncPolicy
// ---------------------------------------------------------------------------

namespace detail {
template <class St>
concept has_on_push = requires(St& st, const PushInfo& p, const ShardProgress& s, const ServerClock& c) {
  { st.on_push(p, s, c) } -> std::same_as<PushAction>;
};
template <class St>
concept has_may_pull = requires(const St& st, const PullInfo& p, const ShardProgress& s, const ServerClock& c) {
  { st.may_pull(p, s, c) } -> std::same_as<bool>;
};
template <class St>
concept has_step_complete = requires(const St& st, const StepProgress& step, const ShardProgress& s,
                                     const ServerClock& c) {
  { st.step_complete(step, s, c) } -> std::same_as<bool>;
};
template <class St>
concept has_finish = requires(const St& st, std::span<float> sum, const StepProgress& p, const ShardProgress& s,
                              const ServerClock& c) { st.finish(sum, p, s, c); };
template <class St>
concept has_on_worker_lost = requires(const St& st, std::size_t worker, const ServerClock& c) {
  { st.on_worker_lost(worker, c) } -> std::same_as<OnWorkerLost>;
};
template <class S>
concept has_make_state = requires(const S& s, std::size_t num_workers) { s.make_state(num_workers); };

// Optional: a step() that pushed nothing to a shard counts as an empty
// contribution to that shard's next step (SyncReplicas).
template <class St>
concept counts_empty_steps = requires {
  { St::counts_empty_steps } -> std::convertible_to<bool>;
} && St::counts_empty_steps;
// The same decided per variable (a state that routes variables to several
// policies: sync::Hybrid).
template <class St>
concept counts_empty_for = requires(const St& st, const VariableMeta& v) {
  { st.counts_empty(v) } -> std::same_as<bool>;
};
// Whether state `st` counts empty steps for variable `v`.
template <class St>
bool counts_empty(const St& st, const VariableMeta& v) {
  if constexpr (counts_empty_for<St>) return st.counts_empty(v);
  else return counts_empty_steps<St>;
}

// Optional: delay compensation (DC-ASGD). A state that provides both keeps,
// per worker, a copy of the parameters it last pulled.
template <class St>
concept has_compensation = requires(const St& st, const VariableMeta& v, std::span<float> g,
                                    std::span<const float> now, std::span<const float> pulled) {
  { st.compensates(v) } -> std::same_as<bool>;
  st.compensate(v, g, now, pulled);
};
}  // namespace detail

//! The per-server object a SyncPolicy makes. The server calls it from its own
//! thread only, so it needs no locking. Every call sees the shard concerned
//! (`psx::ShardProgress`) and the server's clocks (`psx::ServerClock`).
//!
//!  1. `on_push(push, shard, clock) -> psx::PushAction`: apply the push now,
//!     add it to the aggregate of a step, drop it (counted), or reject it.
//!  2. `may_pull(pull, shard, clock) const -> bool`: may this pull be answered
//!     now? If not, the server keeps it and asks again whenever progress
//!     changes; nothing blocks.
//!  3. `step_complete(step, shard, clock) const -> bool`: may the aggregate of
//!     the shard's next step (`psx::StepProgress`: the step, how many workers'
//!     gradients are in it, how many of those are still training) be applied
//!     now? A step may complete with none.
//!  4. `finish(sum, step, shard, clock) const`: turns a step's sum of
//!     contributions, added in worker order, into the gradient to apply
//!     (a mean divides, a sum does nothing).
//!  5. `on_worker_lost(worker, clock) const -> psx::OnWorkerLost`: carry on
//!     without a lost worker, or fail with `psx::peer_lost`.
//!
//! Optional: `compensates(variable) const -> bool` and
//! `compensate(variable, g, w_now, w_pulled) const` rewrite a gradient from the
//! parameters the worker read (delay compensation, see `sync::Asynchronous`);
//! `static constexpr bool counts_empty_steps = true`: a worker's `step()`
//! that pushed nothing to a shard adds an empty contribution to the first
//! step of that shard it is not yet in (it counts in `StepProgress` and in
//! a mean, adds no gradient), for policies that complete steps by counting
//! contributions (see `sync::SyncReplicas`); or, decided per variable,
//! `counts_empty(variable) const -> bool` (see `sync::Hybrid`).
template <class St>
concept SyncState = detail::has_on_push<St> && detail::has_may_pull<St> && detail::has_step_complete<St> &&
                    detail::has_finish<St> && detail::has_on_worker_lost<St>;

//! Decides when a push is applied and when a pull may return.
//!
//! A type S is a SyncPolicy when:
//!  1. it is a copyable value type;
//!  2. `s.make_state(num_workers)` (const) returns a `psx::SyncState`, one per server.
//!
//! @code
//! struct ApplyOnArrival {
//!   struct State {
//!     psx::PushAction on_push(const psx::PushInfo&, const psx::ShardProgress&, const psx::ServerClock&) {
//!       return {};
//!     }
//!     bool may_pull(const psx::PullInfo&, const psx::ShardProgress&, const psx::ServerClock&) const {
//!       return true;
//!     }
//!     bool step_complete(const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const {
//!       return false;
//!     }
//!     void finish(std::span<float>, const psx::StepProgress&, const psx::ShardProgress&,
//!                 const psx::ServerClock&) const {}
//!     psx::OnWorkerLost on_worker_lost(std::size_t, const psx::ServerClock&) const {
//!       return psx::OnWorkerLost::shrink;
//!     }
//!   };
//!   State make_state(std::size_t) const { return {}; }
//! };
//! static_assert(psx::SyncPolicy<ApplyOnArrival>);
//! @endcode
template <class S>
concept SyncPolicy = std::copy_constructible<S> && detail::has_make_state<S> &&
                     SyncState<decltype(std::declval<const S&>().make_state(std::size_t{}))>;

//! Fails to compile, with a message naming the missing member, when S is not a SyncPolicy.
template <class S>
consteval bool explain_sync_policy() {
  static_assert(std::copy_constructible<S>, "psx::SyncPolicy: the policy must be a copyable value type");
  static_assert(detail::has_make_state<S>,
                "psx::SyncPolicy: missing member `State make_state(std::size_t num_workers) const`");
  if constexpr (detail::has_make_state<S>) {
    using St = decltype(std::declval<const S&>().make_state(std::size_t{}));
    static_assert(detail::has_on_push<St>,
                  "psx::SyncPolicy: the state is missing `psx::PushAction on_push(const psx::PushInfo&, "
                  "const psx::ShardProgress&, const psx::ServerClock&)`");
    static_assert(detail::has_may_pull<St>,
                  "psx::SyncPolicy: the state is missing `bool may_pull(const psx::PullInfo&, "
                  "const psx::ShardProgress&, const psx::ServerClock&) const`");
    static_assert(detail::has_step_complete<St>,
                  "psx::SyncPolicy: the state is missing `bool step_complete(const psx::StepProgress&, "
                  "const psx::ShardProgress&, const psx::ServerClock&) const`");
    static_assert(detail::has_finish<St>,
                  "psx::SyncPolicy: the state is missing `void finish(std::span<float> sum, "
                  "const psx::StepProgress&, const psx::ShardProgress&, const psx::ServerClock&) const`");
    static_assert(detail::has_on_worker_lost<St>,
                  "psx::SyncPolicy: the state is missing `psx::OnWorkerLost on_worker_lost(std::size_t worker, "
                  "const psx::ServerClock&) const`");
  }
  return true;
}

// ---------------------------------------------------------------------------
// Optimizer
// ---------------------------------------------------------------------------

namespace detail {
template <class O>
concept has_slots = requires(const O& o) {
  { o.slots() } -> std::convertible_to<std::size_t>;
};
template <class O>
concept has_update = requires(const O& o, std::span<float> w, std::span<const float> g,
                              const SlotView& s, const UpdateContext& ctx) { o.update(w, g, s, ctx); };
template <class O>
concept has_initial_slot = requires(const O& o, std::size_t k) {
  { o.initial_slot(k) } -> std::convertible_to<float>;
};
template <class O>
concept has_validate = requires(const O& o, const VariableMeta& v, std::size_t shards) { o.validate(v, shards); };
}  // namespace detail

//! The value slot `k` of optimizer `o` starts from (0 unless `o` says).
template <class O>
float initial_slot(const O& o, std::size_t k) {
  if constexpr (detail::has_initial_slot<O>) return static_cast<float>(o.initial_slot(k));
  else return 0.0f;
}

//! Whether optimizer type O applies row pushes (true unless O says
//! `static constexpr bool accepts_rows = false`, as LAMB does).
template <class O>
constexpr bool accepts_rows() {
  if constexpr (requires { O::accepts_rows; }) return O::accepts_rows;
  else return true;
}

//! Lets optimizer `o` refuse variable `v`, split into `shards` shards
//! (throws psx::config_error); accepts everything unless `o` says.
template <class O>
void validate_optimizer(const O& o, const VariableMeta& v, std::size_t shards) {
  if constexpr (detail::has_validate<O>) o.validate(v, shards);
}

//! Turns gradients into new parameters on a server.
//!
//! A type O is an Optimizer when:
//!  1. it is a copyable value type (hyper-parameters only);
//!  2. `o.slots()` (const) returns how many floats of state it keeps per
//!     parameter; the server allocates them beside the shard, zeroed;
//!  3. `o.update(w, g, slots, ctx)` (const) updates parameters `w` in place
//!     from gradient `g` (same length) and `slots.size() == o.slots()` state
//!     spans aligned with `w`. Dense pushes call it once per shard; row
//!     pushes once per touched row, with `w`, `g` and the slots being that row
//!     and `ctx.rows` set.
//!
//! Optional members:
//!  - `float initial_slot(std::size_t k) const`: the value slot k starts from
//!    (0 without it), e.g. Adagrad's initial accumulator;
//!  - `void validate(const psx::VariableMeta& v, std::size_t shards) const`:
//!    throws psx::config_error to refuse a variable at `declare`, e.g. LAMB
//!    refusing a variable split across servers;
//!  - `static constexpr bool accepts_rows = false`: the server refuses row
//!    pushes (LAMB).
//!
//! `update` may assume that `w`, `g` and the slots do not overlap (the
//! built-ins' loops use restrict pointers); the server never passes
//! overlapping spans.
//!
//! @code
//! struct PlainSGD {
//!   float lr = 0.01f;
//!   std::size_t slots() const { return 0; }
//!   void update(std::span<float> w, std::span<const float> g, const psx::SlotView&,
//!               const psx::UpdateContext& ctx) const {
//!     for (std::size_t i = 0; i < w.size(); ++i) w[i] -= static_cast<float>(lr * ctx.lr_scale) * g[i];
//!   }
//! };
//! static_assert(psx::Optimizer<PlainSGD>);
//! @endcode
template <class O>
concept Optimizer = std::copy_constructible<O> && detail::has_slots<O> && detail::has_update<O>;

//! Fails to compile, with a message naming the missing member, when O is not an Optimizer.
template <class O>
consteval bool explain_optimizer() {
  static_assert(std::copy_constructible<O>, "psx::Optimizer: the optimizer must be a copyable value type");
  static_assert(detail::has_slots<O>, "psx::Optimizer: missing member `std::size_t slots() const`");
  static_assert(detail::has_update<O>,
                "psx::Optimizer: missing member `void update(std::span<float> w, std::span<const float> g, "
                "const psx::SlotView& slots, const psx::UpdateContext& ctx) const`");
  return true;
}

// ---------------------------------------------------------------------------
// Transport
// ---------------------------------------------------------------------------

namespace detail {
template <class L>
concept has_send = requires(L& l, std::size_t server, Request&& r) { l.send(server, std::move(r)); };
template <class L>
concept has_serve = requires(L& l, std::size_t server, RequestHandler& h) { l.serve(server, h); };
template <class L>
concept has_close = requires(L& l) {
  { l.close() } noexcept;
};
template <class T>
concept has_connect = requires(const T& t, const TransportContext& ctx) {
  typename T::link_type;
  { t.connect(ctx) } -> std::same_as<std::unique_ptr<typename T::link_type>>;
};
}  // namespace detail

//! The per-cluster object a Transport makes.
//!
//!  1. `send(server, request)`: delivers `request` to server `server`; requests
//!     from one worker to one server arrive in the order they were sent.
//!     Throws `psx::shutdown_error` once closed. Thread-safe.
//!  2. `serve(server, handler)`: runs server `server`'s receive loop in the
//!     calling thread, handing each request to `handler` and calling
//!     `handler.tick(now)` whenever `handler.next_tick()` has passed, until
//!     `close()`; then calls `handler.drain(...)` and returns.
//!  3. `close() noexcept`: stops every loop; requests not yet handled finish
//!     with `psx::shutdown_error`. Idempotent.
//!
//! Optional, for links between processes: `bool local_server(std::size_t)
//! const` and `bool local_worker(std::size_t) const` (which servers and
//! workers this process runs; without them, all), `std::string
//! wait_stopped()` (a process without workers serves until it returns) and
//! `std::chrono::milliseconds start_grace() const noexcept` (how long a
//! server waits for a worker's first message before a peer timeout can
//! declare it lost; without it, the peer timeout alone).
//!
//! Optional, for links that take part while a caller waits (a simulated
//! cluster runs its events on the waiting threads, an in-process one lets
//! them handle idle servers' requests): `void await(std::size_t worker,
//! psx::Completion& done)` returns once `done` is ready, or earlier when
//! the caller may simply wait for it (or throws when it never will be;
//! `worker >= num_workers` for a thread that is not a worker); a request
//! with `caller_waits` set is followed by its sender's `await`. And `void
//! worker_begins(std::size_t)` /
//! `void worker_ends(std::size_t)`, called by `ParameterServer::run` before
//! any worker starts and as each worker's function ends.
template <class L>
concept Link = detail::has_send<L> && detail::has_serve<L> && detail::has_close<L>;

//! Moves requests between workers and servers.
//!
//! A type T is a Transport when:
//!  1. it is a copyable value type (settings only);
//!  2. it names its link type `T::link_type`, a `psx::Link`;
//!  3. `t.connect(ctx)` (const) returns `std::unique_ptr<T::link_type>`.
//!
//! `psx::transport::InProcess` is the reference implementation.
template <class T>
concept Transport = std::copy_constructible<T> && detail::has_connect<T> && Link<typename T::link_type>;

//! Fails to compile, with a message naming the missing member, when T is not a Transport.
template <class T>
consteval bool explain_transport() {
  static_assert(std::copy_constructible<T>, "psx::Transport: the transport must be a copyable value type");
  static_assert(detail::has_connect<T>,
                "psx::Transport: missing `using link_type = ...;` and "
                "`std::unique_ptr<link_type> connect(const psx::TransportContext&) const`");
  if constexpr (detail::has_connect<T>) {
    using L = typename T::link_type;
    static_assert(detail::has_send<L>,
                  "psx::Transport: the link is missing `void send(std::size_t server, psx::Request&& r)`");
    static_assert(detail::has_serve<L>,
                  "psx::Transport: the link is missing "
                  "`void serve(std::size_t server, psx::RequestHandler& handler)`");
    static_assert(detail::has_close<L>, "psx::Transport: the link is missing `void close() noexcept`");
  }
  return true;
}

}  // namespace v0
}  // namespace psx
