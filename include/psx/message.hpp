//! @file psx/message.hpp
//! What travels between a worker and a server: a Request naming an operation
//! and the items (variable shards) it touches, and the Completion a worker
//! waits on. A Transport moves Requests; a server handles them.
//!
//! In one process a Request carries spans of the caller's own buffers: the
//! server reads gradients from them and writes parameters into them, so
//! nothing is serialized or copied on the way. A transport between processes
//! encodes the same Request on the wire (see docs/wire.md) and decodes it into
//! spans over the received message.
#pragma once

#include <psx/errors.hpp>

#include <atomic>
#include <cassert>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {

//! The operations a server answers.
enum class Op : std::uint8_t {
  pull,       //!< copy whole shards into `Item::out`
  push,       //!< gradient for whole shards from `Item::in`
  pull_rows,  //!< copy rows `Item::ids` into `Item::out`
  push_rows,  //!< gradient rows for `Item::ids` from `Item::in`
  clock,      //!< the worker finished step `clock - 1` (carries no item)
  join,       //!< the worker (re)joins: sync waits count it again (carries no item)
  leave,      //!< the worker is done: sync waits no longer count it (carries no item)
  fail,       //!< the worker failed (`Request::reason` says how): the sync policy decides
  heartbeat,  //!< the worker is alive, waiting on some server (carries no item)
  barrier,    //!< wait until every worker has reached the same barrier (sent to every server)
  read,       //!< like pull, but never waits for the sync policy (inspection)
  save,       //!< write this server's shards into the checkpoint directory `Request::reason` (psx/checkpoint.hpp)
  restore,    //!< load this server's shards from the checkpoint directory `Request::reason`
  stats,      //!< the server's counters (ServerStats) into one item's `out` (detail::stats_floats floats)
  cancel,     //!< finish the worker's kept request `Request::call` with an error, if the server keeps it (no item)
  table_stats,   //!< one item naming a dynamic table: its counters on this server (TableStats) into `out`
  table_export,  //!< one item naming a dynamic table: a page of its rows into `out` (psx/detail/table_ops.hpp)
};

namespace detail {
// A read: executing it again changes nothing (a transport that resends may
// simply serve it again; detail::Window forgets its answer first).
inline bool is_read(Op op) noexcept {
  return op == Op::pull || op == Op::pull_rows || op == Op::read || op == Op::stats || op == Op::table_stats ||
         op == Op::table_export;
}
// An inspection: answered whatever the sync policy and the worker's state,
// and not counted as the worker's activity.
inline bool is_inspection(Op op) noexcept {
  return op == Op::read || op == Op::stats || op == Op::table_stats || op == Op::table_export;
}
}  // namespace detail

//! One shard of one variable touched by a request.
struct Item {
  std::uint32_t variable = 0;
  //! Index in the variable's `VariableInfo::shards`.
  std::uint32_t shard = 0;
  //! Row ops: global row ids of this shard's rows, in the caller's order.
  std::span<const std::uint64_t> ids;
  //! Row ops: for each id, the row of `in`/`out` it maps to; empty means
  //! `0, 1, 2, ...`.
  std::span<const std::uint32_t> positions;
  //! Push: the gradient (the shard's floats, or the caller's rows).
  std::span<const float> in;
  //! Pull: where the values go.
  std::span<float> out;
  //! Pull of a bfloat16/float16 variable's 16-bit copy: where its bits go
  //! (instead of `out`).
  std::span<std::uint16_t> out16;
};

//! Shared state of one user-level call, possibly fanned out to several
//! servers: it completes when every part has, with the first error kept.
class Completion {
 public:
  //! Called once, with the first error (or null), when the last part
  //! finished; instead of waking waiters.
  using Callback = std::function<void(std::exception_ptr)>;

  explicit Completion(std::size_t parts) : pending_(parts), finished_(parts == 0) {}
  //! A completion that calls `on_done` instead of being waited for (a
  //! transport's server side answering over the network).
  Completion(std::size_t parts, Callback on_done)
      : pending_(parts), finished_(parts == 0), on_done_(std::move(on_done)) {}

  //! One part finished; `error` is null on success. Each part finishes
  //! exactly once: a second finish would let `wait` return while another
  //! part may still write into the caller's buffers.
  void finish(std::exception_ptr error = nullptr) {
    Callback call;
    std::exception_ptr first;
    {
      std::lock_guard lock(mu_);
      assert(pending_ > 0 && "psx: a request was finished twice");
      if (error && !error_) error_ = std::move(error);
      if (pending_ == 0 || --pending_ != 0) return;
      finished_.store(true, std::memory_order_release);
      if (!on_done_) {
        cv_.notify_all();
        return;
      }
      call = std::move(on_done_);
      first = std::exchange(error_, nullptr);
    }
    call(std::move(first));
  }

  //! Blocks until every part finished; rethrows the first error, once: the
  //! error moves to the waiting thread, so the exception object is never
  //! shared by two threads (a server that drops this completion later
  //! destroys nothing the waiter still reads).
  void wait() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return pending_ == 0; });
    std::exception_ptr error = std::exchange(error_, nullptr);
    lock.unlock();
    if (error) std::rethrow_exception(std::move(error));
  }

  //! Waits until every part finished or `timeout` passed; true when finished
  //! (then `wait()` returns at once).
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> timeout) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return pending_ == 0; });
  }

  //! True once every part finished (without a lock: a waiter may poll it).
  bool ready() const noexcept { return finished_.load(std::memory_order_acquire); }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::size_t pending_;
  std::atomic<bool> finished_{false};  // pending_ reached 0
  std::exception_ptr error_;
  Callback on_done_;
};

//! Number of staleness histogram buckets.
inline constexpr std::size_t staleness_buckets = 64;

//! Counters a server keeps; read from any thread (relaxed atomics: each value
//! is exact once the server is idle, and a snapshot while it works). In
//! this process: `ParameterServer::server_stats(i)`; from any worker, over
//! any transport: `Worker::server_stats()`.
struct ServerStats {
  std::uint64_t requests = 0;   //!< requests handled (a kept request counts when it arrives; cancels count)
  std::uint64_t pulls = 0;      //!< pull, pull_rows and read requests answered
  std::uint64_t pushes = 0;     //!< push and push_rows requests taken
  std::uint64_t bytes_in = 0;   //!< gradient payload received
  std::uint64_t bytes_out = 0;  //!< parameter payload answered
  std::uint64_t errors = 0;     //!< requests answered with an error
  std::uint64_t dropped = 0;    //!< gradients the sync policy dropped (late for their step)
  std::uint64_t steps = 0;      //!< steps completed (with gradients or none), summed over this server's shards
  //! `staleness[k]`: applied gradients whose staleness was k (the shard's
  //! version when applied minus the version the worker had pulled); the last
  //! bucket counts every staleness of `size() - 1` or more.
  std::vector<std::uint64_t> staleness;
  std::uint64_t parameter_bytes = 0;  //!< parameters held: float32 masters plus 16-bit copies
  std::uint64_t slot_bytes = 0;       //!< optimizer state held beside them
  //! Messages refused before they became requests (malformed, another wire
  //! version or cluster, not authenticated): transports between processes.
  std::uint64_t rejected = 0;
  //! Answers that could not be delivered because their worker was gone.
  std::uint64_t undelivered = 0;
  //! Requests a worker sent again after its connection dropped and came
  //! back (transports between processes).
  std::uint64_t retried = 0;
  //! Of those, the ones this server had already received: executed once,
  //! their answer sent again (or sent when they complete).
  std::uint64_t duplicates = 0;
  //! The server's queue: requests it holds right now, waiting on the sync
  //! policy (pulls ahead of the applied steps, barrier parts); summed over
  //! servers by `+=`.
  std::uint64_t waiting = 0;
  //! The most requests it held at once (summed over servers by `+=`: a
  //! bound of the cluster's).
  std::uint64_t waiting_max = 0;

  //! Adds `o`'s counters (summing servers).
  ServerStats& operator+=(const ServerStats& o) {
    for (std::size_t k = 0; k < counters; ++k) this->*fields[k] += o.*fields[k];
    if (staleness.size() < o.staleness.size()) staleness.resize(o.staleness.size(), 0);
    for (std::size_t k = 0; k < o.staleness.size(); ++k) staleness[k] += o.staleness[k];
    return *this;
  }
  friend bool operator==(const ServerStats&, const ServerStats&) = default;

  //! The scalar counters, in their wire order (Op::stats answers).
  static constexpr std::size_t counters = 16;
  using Counter = std::uint64_t ServerStats::*;
  static constexpr Counter fields[counters] = {
      &ServerStats::requests, &ServerStats::pulls,           &ServerStats::pushes,     &ServerStats::bytes_in,
      &ServerStats::bytes_out, &ServerStats::errors,          &ServerStats::dropped,    &ServerStats::steps,
      &ServerStats::parameter_bytes, &ServerStats::slot_bytes, &ServerStats::rejected, &ServerStats::undelivered,
      &ServerStats::waiting,         &ServerStats::waiting_max,  &ServerStats::retried,  &ServerStats::duplicates};
};

namespace detail {

// An Op::stats answer: the counters then the staleness buckets, each
// 64-bit value as the bits of two floats (the transports move floats).
inline constexpr std::size_t stats_floats = 2 * (ServerStats::counters + staleness_buckets);

inline void put_stats(const ServerStats& st, std::span<float> out) noexcept {
  auto put = [&](std::size_t k, std::uint64_t v) { std::memcpy(out.data() + 2 * k, &v, sizeof v); };
  for (std::size_t k = 0; k < ServerStats::counters; ++k) put(k, st.*ServerStats::fields[k]);
  for (std::size_t k = 0; k < staleness_buckets; ++k)
    put(ServerStats::counters + k, k < st.staleness.size() ? st.staleness[k] : 0);
}

inline ServerStats get_stats(std::span<const float> in) noexcept {
  auto get = [&](std::size_t k) {
    std::uint64_t v;
    std::memcpy(&v, in.data() + 2 * k, sizeof v);
    return v;
  };
  ServerStats st;
  for (std::size_t k = 0; k < ServerStats::counters; ++k) st.*ServerStats::fields[k] = get(k);
  st.staleness.resize(staleness_buckets);
  for (std::size_t k = 0; k < staleness_buckets; ++k) st.staleness[k] = get(ServerStats::counters + k);
  return st;
}

}  // namespace detail

//! One message from a worker to one server.
struct Request {
  Op op = Op::pull;
  std::uint32_t worker = 0;
  //! The worker's clock (number of `step()` calls) when it sent this.
  std::uint64_t clock = 0;
  std::vector<Item> items;
  //! Names a pull among its worker's calls, so that `Op::cancel` (which
  //! carries the same worker and number) can name it; 0: not cancellable.
  //! Numbered by the cluster's workers in a process (`transport::Zmq`'s
  //! servers see its call id instead, of every request that wants an answer).
  std::uint64_t call = 0;
  //! For `Op::fail`: what happened to the worker. For `Op::save` and
  //! `Op::restore`: the checkpoint directory (`clock` is then the step).
  std::string reason;
  //! Finished by the server once the request is answered; may be null for
  //! fire-and-forget messages (clock ticks).
  std::shared_ptr<Completion> done;
  //! The sender waits for `done` right after sending this, its call's last
  //! request (a blocking call): a transport may leave it for the waiting
  //! thread to handle instead of waking a server thread for it
  //! (`InProcess::waiters_serve`). A hint; it changes no answer.
  bool caller_waits = false;

  void finish(std::exception_ptr error = nullptr) const {
    if (done) done->finish(std::move(error));
  }
};

//! The server side of a transport: what `Link::serve` hands requests to.
class RequestHandler {
 public:
  using clock_type = std::chrono::steady_clock;

  //! Answers `r` now or keeps it until the sync policy lets it through.
  //! Errors finish the request; nothing escapes.
  virtual void handle(Request&& r) noexcept = 0;
  //! Makes the error of one request; called once per request so that no two
  //! requests (and so no two threads) share an exception object.
  using ErrorFactory = std::function<std::exception_ptr()>;

  //! The link is closing: finish every request still kept with an error
  //! from `make_error`.
  virtual void drain(const ErrorFactory& make_error) noexcept = 0;
  //! When the loop must call `tick` next even if no request comes
  //! (`time_point::max()`: never).
  virtual clock_type::time_point next_tick() const noexcept = 0;
  //! Periodic work (timeouts); called by the loop at or after `next_tick()`.
  virtual void tick(clock_type::time_point now) noexcept = 0;

  //! What a transport between processes tells its server about messages
  //! that never became requests, so that they are counted.
  enum class LinkEvent : std::uint8_t {
    rejected,     //!< malformed, of another version or cluster, or unauthenticated
    undelivered,  //!< an answer whose worker was gone when it was sent
    retried,      //!< a request sent again after a reconnect
    duplicate,    //!< a request sent again that had been received already (executed once)
  };
  virtual void link_event(LinkEvent e) noexcept = 0;
  //! Where worker `w` stands: a server told to stop stops when no worker
  //! it heard from is active, and a chief that left is done, not lost.
  enum class WorkerState : std::uint8_t {
    active,  //!< training (or not yet heard from)
    left,    //!< its function returned (Worker::leave)
    lost,    //!< it failed, or went silent for the peer timeout
  };
  virtual WorkerState worker_state(std::size_t w) const noexcept = 0;
  //! Why training failed here for good (the sync policy gave up on a lost
  //! worker), or empty: a transport between processes then refuses new
  //! worker processes with it, and they wait for the server a supervisor
  //! restarts in its place.
  virtual std::string training_failure() const { return {}; }

 protected:
  ~RequestHandler() = default;
};

}  // namespace v0
}  // namespace psx
