//! @file psx/worker.hpp
//! The worker API: pull parameters, push gradients, advance the clock.
//!
//! Buffers go in and out as `std::span<float>`, or as any tensor type with a
//! `psx::tensor_traits` specialization (`psx/eigen.hpp`, `psx/xtensor.hpp`),
//! read and written in place. Every call checks the variable name, sizes and
//! row ids before anything is sent, and throws a typed `psx::` exception
//! naming the variable and the sizes.
#pragma once

#include <psx/cluster.hpp>
#include <psx/detail/table_ops.hpp>
#include <psx/embedding.hpp>
#include <psx/errors.hpp>
#include <psx/message.hpp>
#include <psx/variable.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {

//! Customization point for tensor types psx accepts in place of a span.
//! A specialization provides:
//!  1. `static std::span<float> data(T&)` and `static std::span<const float> data(const T&)`:
//!     the elements, row-major and contiguous;
//!  2. `static std::vector<std::size_t> shape(const T&)`: the extents.
//! psx compares the shape with the variable's (see `Worker::pull`).
template <class T>
struct tensor_traits;

//! A type with a `psx::tensor_traits` specialization.
template <class T>
concept TensorLike = requires(T& t, const T& ct) {
  { tensor_traits<T>::data(t) } -> std::convertible_to<std::span<float>>;
  { tensor_traits<T>::data(ct) } -> std::convertible_to<std::span<const float>>;
  { tensor_traits<T>::shape(ct) } -> std::convertible_to<std::vector<std::size_t>>;
};

//! One variable of a batched pull: where its values go.
struct PullItem {
  std::string_view name;
  std::span<float> out;
};

//! One variable of a batched push: its gradient.
struct PushItem {
  std::string_view name;
  std::span<const float> grad;
};

//! Waits for an asynchronous call. The buffers the call reads or fills must
//! stay alive until `wait()` returns; a Handle that is destroyed without
//! `wait()` (or assigned over) lets its call go: a pull that a server still
//! keeps for the sync policy (one waiting for other workers' steps) is
//! cancelled there, then the destructor waits for every part to finish (and
//! drops the result and the error), so a buffer is never written after its
//! owner let go of the handle. So a worker whose function throws (or
//! returns) with a pull in flight that waits for a worker that waits for
//! this one (a barrier, the next step) does not wait for ever in the
//! unwinding: the pull ends, the function ends, and the worker counts as
//! lost (or gone) for the sync policy. A Handle may outlive its cluster (the
//! cluster's shutdown finishes every call); a Worker may not.
class Handle {
 public:
  //! Sent while a wait lasts, every `heartbeat_every`, so that servers the
  //! call does not involve still hear from the worker (peer timeouts).
  using Heartbeat = std::function<void()>;
  //! Waits for the completion in the transport's own way (a simulated
  //! cluster runs its events meanwhile); may throw when it never will be
  //! ready. Without one, the completion is waited for plainly.
  using Waiter = std::function<void(Completion&)>;
  //! Asks the servers to let the call go (Op::cancel) when the handle is
  //! dropped before the call finished; best effort, never throws out.
  using Cancel = std::function<void()>;

  Handle() = default;
  explicit Handle(std::shared_ptr<Completion> done, Waiter waiter = {}, Heartbeat heartbeat = {},
                  std::chrono::milliseconds heartbeat_every = {}, Cancel cancel = {}) noexcept
      : done_(std::move(done)),
        waiter_(std::move(waiter)),
        heartbeat_(std::move(heartbeat)),
        cancel_(std::move(cancel)),
        every_(heartbeat_every) {}
  Handle(Handle&&) noexcept = default;
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      settle();
      done_ = std::move(other.done_);
      waiter_ = std::move(other.waiter_);
      heartbeat_ = std::move(other.heartbeat_);
      cancel_ = std::move(other.cancel_);
      every_ = other.every_;
    }
    return *this;
  }
  ~Handle() { settle(); }

  //! Blocks until the call finished; rethrows its error.
  void wait() {
    if (!done_) return;
    auto done = std::move(done_);
    block(*done);
  }
  //! True once the call finished (or for an empty handle). Only looks: in a
  //! simulated cluster (transport::Simulated) time moves while workers
  //! wait, so a worker polling `ready()` never sees its answer; `wait()`.
  bool ready() const { return !done_ || done_->ready(); }

 private:
  // Waits as wait() does, heartbeats included (a handle dropped unwaited
  // sent none, and another server declared its worker lost meanwhile).
  void settle() noexcept {
    if (!done_) return;
    auto done = std::move(done_);
    if (cancel_ && !done->ready()) {
      try {
        cancel_();
      } catch (...) {  // then the call runs its course, waited for below
      }
    }
    try {
      block(*done);
    } catch (...) {  // nobody asked for the result (or it can never come)
    }
  }
  void block(Completion& done) const {
    if (waiter_) waiter_(done);
    if (heartbeat_ && every_.count() > 0)
      while (!done.wait_for(every_)) heartbeat_();
    done.wait();
  }
  std::shared_ptr<Completion> done_;
  Waiter waiter_;
  Heartbeat heartbeat_;
  Cancel cancel_;
  std::chrono::milliseconds every_{0};
};

namespace detail {

struct ClusterCore;
// The cluster and worker whose function the calling thread runs in
// ParameterServer::run (none: another thread).
struct RunningWorker {
  const ClusterCore* core = nullptr;
  std::size_t index = 0;
};
inline thread_local RunningWorker running_worker;

// A worker's pipelined pushes (Worker::pipeline_pushes): sent and not yet
// acknowledged, oldest first, each with the copy of what it sends.
struct PushPipeline {
  struct Entry {
    std::vector<float> grads;
    std::vector<std::uint64_t> ids;
    Handle handle;  // last: destroyed first, it waits for the call before the copies go
  };
  std::size_t depth = 0;  // 0: pushes wait for their acknowledgement
  std::deque<Entry> entries;
};

// What every worker of a cluster shares: the variables and the way to the servers.
struct ClusterCore {
  ClusterConfig config;
  std::vector<VariableInfo> variables;
  std::map<std::string, std::uint32_t, std::less<>> by_name;
  std::function<void(std::size_t, Request&&)> send;
  std::atomic<bool> stopped{false};
  std::vector<std::uint64_t> clocks;  // one per worker, touched only by that worker's thread
  std::vector<std::uint8_t> rejoined;  // per worker: its run() joined a job that went on without it
  std::vector<PushPipeline> pipelines;  // per worker, touched only by that worker's thread
  std::atomic<std::uint64_t> calls{0};  // numbers the cancellable pulls (Request::call)
  // Set when the link has the optional members of the same names (a
  // simulated cluster): how a worker (or, with an index >= num_workers,
  // another thread) waits, and which workers `run` is running.
  std::function<void(std::size_t, Completion&)> await;
  std::function<void(std::size_t)> worker_begins;
  std::function<void(std::size_t)> worker_ends;
  // Expires with the cluster: a Handle that outlives it does not wait
  // through it (its shutdown finished every call).
  std::shared_ptr<const bool> alive = std::make_shared<const bool>(true);

  // Waits for `done` on behalf of worker `w`; rethrows its error.
  void wait(std::size_t w, Completion& done) const {
    if (await) await(w, done);
    done.wait();
  }

  const VariableInfo& find(std::string_view name, std::string_view op, std::size_t worker) const {
    if (const VariableInfo* v = try_find(name)) return *v;
    unknown(name, "worker " + std::to_string(worker) + ": " + std::string(op));
  }

  const VariableInfo* try_find(std::string_view name) const noexcept {
    auto it = by_name.find(name);
    return it != by_name.end() ? &variables[it->second] : nullptr;
  }

  // Throws unknown_variable for `name`, said by `where` ("worker 2: pull").
  [[noreturn]] void unknown(std::string_view name, const std::string& where) const {
    std::string known;
    std::size_t listed = 0;
    for (const auto& [n, id] : by_name) {
      if (listed++ == 8) {
        known += ", ...";
        break;
      }
      known += (known.empty() ? "" : ", ") + n;
    }
    throw unknown_variable("psx: " + where + " of unknown variable '" + std::string(name) + "' (declared: " +
                           (known.empty() ? "none" : known) + ")");
  }
};

// Tells every server that worker `w` left, failed, or is alive; nobody waits
// for the answer, and a cluster that shut down is not told.
inline void announce(ClusterCore& core, std::size_t w, Op op, const std::string& reason = {}) noexcept {
  for (std::size_t s = 0; s < core.config.num_servers; ++s) {
    try {
      Request r;
      r.op = op;
      r.worker = static_cast<std::uint32_t>(w);
      r.clock = core.clocks[w];
      r.reason = reason;
      core.send(s, std::move(r));
    } catch (...) {  // shut down: nobody is listening
    }
  }
}

// A completion that also owns the id and position lists its requests point into.
struct RowsCompletion : Completion {
  using Completion::Completion;
  std::vector<std::uint64_t> ids;
  std::vector<std::uint32_t> positions;
};

inline std::string floats(std::size_t n) { return std::to_string(n) + (n == 1 ? " float" : " floats"); }

}  // namespace detail

template <class P, class S, class O, class T, class Storage>
class ParameterServer;

namespace detail {
struct WorkerAccess;
}

//! One worker's handle on the cluster. Use it from one thread at a time.
class Worker {
  template <class P, class S, class O, class T, class Storage>
  friend class ParameterServer;

 public:
  Worker(detail::ClusterCore& core, std::size_t index) noexcept : core_(&core), index_(index) {}

  //! This worker's index in `[0, num_workers())`.
  std::size_t index() const noexcept { return index_; }
  std::size_t num_workers() const noexcept { return core_->config.num_workers; }
  std::size_t num_servers() const noexcept { return core_->config.num_servers; }
  //! Worker 0 is the chief: it counts the global step and saves.
  bool is_chief() const noexcept { return index_ == 0; }
  //! Number of `step()` calls so far.
  std::uint64_t clock() const noexcept { return core_->clocks[index_]; }
  //! Whether this worker joined a job that had gone on without it: a
  //! restarted process of a worker the servers had lost, under a policy
  //! that let the others train on (`Asynchronous`, `shrink`). `run` then
  //! starts it at the clock of the slowest server, not at 0, and the
  //! collectives of a job's start (`CheckpointManager::restore_or_init`)
  //! are not for it: the others made them long ago.
  bool rejoined() const noexcept { return core_->rejoined[index_] != 0; }
  //! The variable declared as `name`; throws `psx::unknown_variable`.
  const VariableInfo& variable(std::string_view name) const { return core_->find(name, "lookup", index_); }

  //! This worker's share of a data set of `total` examples.
  ShardRange shard(std::size_t total) const noexcept { return {total, num_workers(), index_}; }

  // -- dense -----------------------------------------------------------------

  //! Copies the whole variable `name` into `out` (row-major, exactly its size).
  void pull(std::string_view name, std::span<float> out) {
    blocking([&] { return pull_async(name, out); });
  }
  Handle pull_async(std::string_view name, std::span<float> out) {
    const PullItem item{name, out};
    return pull_async(std::span<const PullItem>(&item, 1));
  }
  //! Pulls several variables: one message per server, whatever their number.
  void pull(std::initializer_list<PullItem> items) {
    blocking([&] { return pull_async(std::span(items.begin(), items.size())); });
  }
  Handle pull_async(std::span<const PullItem> items) {
    return send_dense(Op::pull, items.size(), [&](std::size_t i) { return std::pair{items[i].name, items[i].out.size()}; },
                      [&](std::size_t i, Item& item, std::size_t first, std::size_t n) {
                        item.out = items[i].out.subspan(first, n);
                      });
  }

  //! Copies the 16-bit copy of a bfloat16 or float16 variable (mixed
  //! precision) into `out`; `T` must be the variable's dtype (psx::shape_error
  //! otherwise). A float pull of such a variable returns its float32 master.
  template <class T>
    requires std::same_as<T, bfloat16> || std::same_as<T, float16>
  void pull(std::string_view name, std::span<T> out) {
    blocking([&] { return pull_async(name, out); });
  }
  template <class T>
    requires std::same_as<T, bfloat16> || std::same_as<T, float16>
  Handle pull_async(std::string_view name, std::span<T> out) {
    check_dtype(name, T::dtype, "pull");
    const auto bits = as_bits(out);
    return send_dense(Op::pull, 1, [&](std::size_t) { return std::pair{name, out.size()}; },
                      [&](std::size_t, Item& item, std::size_t first, std::size_t n) {
                        item.out16 = bits.subspan(first, n);
                      });
  }

  //! Pushes a gradient for the whole variable `name` (row-major, exactly its size).
  //! Waits for the servers' acknowledgement unless pushes are pipelined
  //! (`pipeline_pushes`).
  void push(std::string_view name, std::span<const float> grad) {
    if (pipelined())
      return pipelined_push([&](detail::PushPipeline::Entry& e) {
        e.grads.assign(grad.begin(), grad.end());
        return push_async(name, e.grads);
      });
    blocking([&] { return push_async(name, grad); });
  }
  Handle push_async(std::string_view name, std::span<const float> grad) {
    const PushItem item{name, grad};
    return push_async(std::span<const PushItem>(&item, 1));
  }
  //! Pushes several variables: one message per server, whatever their number.
  void push(std::initializer_list<PushItem> items) { push(std::span<const PushItem>(items.begin(), items.size())); }
  void push(std::span<const PushItem> items) {
    if (pipelined())
      return pipelined_push([&](detail::PushPipeline::Entry& e) {
        std::size_t n = 0;
        for (const PushItem& item : items) n += item.grad.size();
        e.grads.reserve(n);
        std::vector<PushItem> copies;
        copies.reserve(items.size());
        for (const PushItem& item : items) {
          const std::size_t at = e.grads.size();
          e.grads.insert(e.grads.end(), item.grad.begin(), item.grad.end());
          copies.push_back({item.name, std::span<const float>(e.grads).subspan(at, item.grad.size())});
        }
        return push_async(std::span<const PushItem>(copies));
      });
    blocking([&] { return push_async(items); });
  }
  Handle push_async(std::span<const PushItem> items) {
    return send_dense(Op::push, items.size(), [&](std::size_t i) { return std::pair{items[i].name, items[i].grad.size()}; },
                      [&](std::size_t i, Item& item, std::size_t first, std::size_t n) {
                        item.in = items[i].grad.subspan(first, n);
                      });
  }

  //! Pulls into a tensor (`psx::tensor_traits`): its shape must be the
  //! variable's, or [rows, row width], or flat with the same element count.
  template <TensorLike T>
  void pull(std::string_view name, T& tensor) {
    check_tensor(name, tensor_shape(name, tensor, "pull"), "pull");
    pull(name, std::span<float>(tensor_traits<T>::data(tensor)));
  }
  //! Pushes a gradient held in a tensor (same shape rule as `pull`).
  template <TensorLike T>
  void push(std::string_view name, const T& tensor) {
    check_tensor(name, tensor_shape(name, tensor, "push"), "push");
    push(name, std::span<const float>(tensor_traits<T>::data(tensor)));
  }

  // -- rows (sparse) ---------------------------------------------------------

  //! Copies rows `ids` of `name` into `out`: row `ids[j]` goes to
  //! `out[j * width, (j + 1) * width)`. Repeated ids are copied each time.
  void pull_rows(std::string_view name, std::span<const std::uint64_t> ids, std::span<float> out) {
    blocking([&] { return pull_rows_async(name, ids, out); });
  }
  Handle pull_rows_async(std::string_view name, std::span<const std::uint64_t> ids, std::span<float> out) {
    return send_rows(Op::pull_rows, name, ids, {}, out, {});
  }
  //! Copies rows of a bfloat16 or float16 variable's 16-bit copy; `T` must be
  //! the variable's dtype.
  template <class T>
    requires std::same_as<T, bfloat16> || std::same_as<T, float16>
  void pull_rows(std::string_view name, std::span<const std::uint64_t> ids, std::span<T> out) {
    blocking([&] { return pull_rows_async(name, ids, out); });
  }
  template <class T>
    requires std::same_as<T, bfloat16> || std::same_as<T, float16>
  Handle pull_rows_async(std::string_view name, std::span<const std::uint64_t> ids, std::span<T> out) {
    check_dtype(name, T::dtype, "pull_rows");
    return send_rows(Op::pull_rows, name, ids, {}, {}, as_bits(out));
  }

  //! Pushes gradient rows: row `j` of `grads` is the gradient of row `ids[j]`.
  //! Repeated ids are summed. Waits for the servers' acknowledgement unless
  //! pushes are pipelined (`pipeline_pushes`).
  void push_rows(std::string_view name, std::span<const std::uint64_t> ids, std::span<const float> grads) {
    if (pipelined())
      return pipelined_push([&](detail::PushPipeline::Entry& e) {
        e.ids.assign(ids.begin(), ids.end());
        e.grads.assign(grads.begin(), grads.end());
        return push_rows_async(name, e.ids, e.grads);
      });
    blocking([&] { return push_rows_async(name, ids, grads); });
  }

  // -- pipelined pushes ------------------------------------------------------

  //! Pipelines this worker's pushes: from now on `push` and `push_rows`
  //! copy the gradient (and the ids), send it and return without waiting
  //! for the servers' acknowledgement, which comes meanwhile (a server
  //! answers one worker's requests in order, so the next pull's answer
  //! comes after it), while at most `depth` pushes are unacknowledged: a
  //! push beyond that waits for the oldest. A step is then one round trip
  //! (its pulls) instead of two. A pipelined push that failed (refused by
  //! the sync policy, a wrong shape a server found, a server lost) has its
  //! error thrown, unchanged, by this worker's next call (its message names
  //! the push's variable and server), before that call sends anything;
  //! `flush()` waits for all of them. `depth` 0 (the default) makes pushes
  //! wait again (after waiting for those in flight). The `_async` forms
  //! are not affected: their handles say when they are done.
  void pipeline_pushes(std::size_t depth) {
    check_running("pipeline_pushes");
    detail::PushPipeline& p = pipeline();
    p.depth = depth;
    while (p.entries.size() > depth) settle_oldest(p);
  }
  //! Pipelined pushes sent and not yet known to be acknowledged.
  std::size_t pushes_in_flight() const noexcept {
    return index_ < core_->pipelines.size() ? core_->pipelines[index_].entries.size() : 0;
  }
  //! Waits until every pipelined push is acknowledged; throws the error of
  //! the first one that failed (the others are still waited for).
  void flush() {
    check_running("flush");
    detail::PushPipeline& p = pipeline();
    std::exception_ptr first;
    while (!p.entries.empty()) {
      try {
        settle_oldest(p);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }
  Handle push_rows_async(std::string_view name, std::span<const std::uint64_t> ids, std::span<const float> grads) {
    return send_rows(Op::push_rows, name, ids, grads, {}, {});
  }

  // -- progress --------------------------------------------------------------

  //! Ends this worker's step: the pushes made since the last `step()` form
  //! its gradient for that step. Under a synchronous policy the next pull
  //! waits until every worker's gradient of this step is applied.
  void step() {
    check_running("step");
    const std::uint64_t next = core_->clocks[index_] + 1;
    for (std::size_t s = 0; s < num_servers(); ++s) {
      Request r;
      r.op = Op::clock;
      r.worker = static_cast<std::uint32_t>(index_);
      r.clock = next;
      core_->send(s, std::move(r));
    }
    core_->clocks[index_] = next;
  }

  //! Returns once every worker still training has called `barrier()` as
  //! often. Every server takes part, so every request a worker sent before
  //! its barrier has reached its server when the barrier returns (even
  //! between processes, where only messages from one worker to one server
  //! keep their order). A worker that has left (`leave()`) gets sync_error.
  void barrier() {
    check_running("barrier");
    call_every_server(Op::barrier, clock());
  }

  //! A barrier that also agrees on a number: returns the largest `value`
  //! passed by the workers taking part (every worker still training must
  //! call it as often, and no plain `barrier()` in between). What one worker
  //! alone knows (the chief's clock says it is time to save) becomes what
  //! all of them do.
  std::uint64_t agree_max(std::uint64_t value) {
    check_running("agree_max");
    std::vector<std::array<float, 2>> answers(num_servers());
    call_every_server(Op::barrier, value, {}, [&](std::size_t s) { return std::span<float>(answers[s]); });
    std::uint64_t out = 0;
    for (const auto& a : answers) {
      std::uint64_t v;
      std::memcpy(&v, a.data(), sizeof v);
      out = std::max(out, v);
    }
    return out;
  }

  //! Every server's counters, `[s]` for server s, asked over the transport:
  //! how a chief sees servers that run in other processes (send them to
  //! TensorBoard with psx/summary.hpp, say). A snapshot: servers count on
  //! while it travels. Does not count as this worker's activity, and is
  //! answered even after the sync policy failed.
  std::vector<ServerStats> server_stats() {
    check_running("server_stats");
    std::vector<std::vector<float>> answers(num_servers(), std::vector<float>(detail::stats_floats));
    call_every_server(Op::stats, clock(), {}, [&](std::size_t s) { return std::span<float>(answers[s]); });
    std::vector<ServerStats> out;
    out.reserve(answers.size());
    for (const auto& a : answers) out.push_back(detail::get_stats(a));
    return out;
  }

  // -- dynamic tables ---------------------------------------------------------

  //! What each server holds of dynamic table `name` (`[s]` for server s),
  //! asked over the transport, so also of servers in other processes. Every
  //! request this worker sent before is applied first (a server handles
  //! one worker's requests in order). Does not count as this worker's
  //! activity, and is answered even after the sync policy failed. Throws
  //! unknown_variable, config_error for another kind of variable.
  std::vector<TableStats> table_stats(std::string_view name) {
    check_running("table_stats");
    const VariableInfo& v = table_variable(name, "table_stats");
    std::vector<std::vector<float>> answers(num_servers(), std::vector<float>(detail::table_stats_floats));
    std::vector<Handle> calls;
    calls.reserve(num_servers());
    for (std::size_t s = 0; s < num_servers(); ++s) {
      Item item;
      item.variable = v.meta.id;
      item.shard = static_cast<std::uint32_t>(s);
      item.out = answers[s];
      calls.push_back(inspect(Op::table_stats, s, item, num_servers() == 1));
    }
    std::vector<TableStats> out;
    out.reserve(num_servers());
    for (std::size_t s = 0; s < num_servers(); ++s) {
      calls[s].wait();
      out.push_back(detail::get_table_stats(answers[s]));
    }
    return out;
  }

  //! The rows of dynamic table `name`: every stored row (`since` empty), or
  //! a delta: the rows changed and the ids removed after `since` (the
  //! `cursor` of the export before it). Asked over the transport, so also
  //! of servers in other processes, in pages of at most `page_bytes` per
  //! server and message (one row at least), continued from where each page
  //! stopped (every server's pages asked for at once; a server handles one
  //! page at a time between other requests). Safe while
  //! training runs: a row changed meanwhile (also between two pages) is in
  //! this export or in the next delta; taken when the servers are idle, a
  //! full export plus its deltas equals a full export. Throws
  //! unknown_variable, config_error for another kind of variable or a
  //! cursor of another number of servers, and checkpoint_error naming the
  //! server for a cursor of another incarnation of its table (the server
  //! restarted, or restored a checkpoint), of a version it has not
  //! reached, or older than the removals it remembers
  //! (`TableOptions::removal_log_limit`), and for a table restored during
  //! the export: then take a full export.
  TableExport export_table(std::string_view name, const TableCursor& since = {},
                           std::size_t page_bytes = table_page_bytes) {
    check_running("export_table");
    const VariableInfo& v = table_variable(name, "export_table");
    const std::size_t n = num_servers(), dim = v.meta.row_width;
    if (!since.empty() && (since.version.size() != n || since.incarnation.size() != n))
      throw config_error("psx: export_table('" + v.meta.name + "'): a cursor of " +
                         std::to_string(since.version.size()) + " versions and " +
                         std::to_string(since.incarnation.size()) + " incarnations for " + std::to_string(n) +
                         " servers");
    const std::size_t page_floats = page_bytes / sizeof(float);
    const std::size_t max_entries =
        page_floats <= detail::page_header_floats ? 1 : std::max<std::size_t>(1, (page_floats - detail::page_header_floats) / (2 + dim));
    struct Part {
      std::vector<float> page;
      std::size_t capacity = 0;  // entries the next page asks for
      std::uint64_t after = 0;   // the hash the next page starts after
      bool started = false, done = false;
      std::size_t delivered = 0;  // entries so far
    };
    std::vector<Part> parts(n);
    // A delta is usually small; a full export learns the size from its first page.
    for (Part& p : parts) p.capacity = std::min<std::size_t>(since.empty() ? 4096 : 1024, max_entries);
    TableExport out;
    out.dim = dim;
    out.cursor.incarnation.assign(n, 0);
    out.cursor.version.assign(n, 0);
    auto server = [&](std::size_t s) { return " (server " + std::to_string(s) + " of " + std::to_string(n) + ")"; };
    // Every server's next page at once, then their answers in server order;
    // each page holds one entry at least, so each round moves every server
    // not done further along its ids' hashes.
    std::uint64_t expected = 0;  // rows the servers held at their first page
    for (std::size_t open = n, round = 0; open > 0; ++round) {
      std::vector<std::size_t> asked;
      std::vector<std::array<std::uint64_t, detail::page_ask_words>> words(n);
      std::vector<Handle> calls;
      calls.reserve(n);
      for (std::size_t s = 0; s < n; ++s) {
        Part& p = parts[s];
        if (p.done) continue;
        p.page.resize(detail::page_floats(p.capacity, dim));
        words[s] = {since.empty() ? 0 : since.incarnation[s], since.empty() ? 0 : since.version[s], p.after,
                    (since.empty() ? 0 : detail::page_delta) | (p.started ? detail::page_continues : 0)};
        Item item;
        item.variable = v.meta.id;
        item.shard = static_cast<std::uint32_t>(s);
        item.ids = words[s];
        item.out = p.page;
        asked.push_back(s);
        calls.push_back(inspect(Op::table_export, s, item, open == 1));
      }
      for (std::size_t k = 0; k < asked.size(); ++k) {
        const std::size_t s = asked[k];
        Part& p = parts[s];
        try {
          calls[k].wait();
        } catch (const checkpoint_error& e) {  // which server restarted or forgot its removals
          throw checkpoint_error(std::string(e.what()) + server(s));
        }
        const std::span<const float> page(p.page);
        const detail::PageHeader h = detail::get_page_header(page);
        const std::size_t taken = h.page.rows + h.page.removed;
        if (h.page.rows > p.capacity || h.page.removed > p.capacity - h.page.rows ||
            (h.page.more && (taken == 0 || (p.started && h.page.next <= p.after))))
          throw wire_error("psx: export_table('" + v.meta.name + "'): server " + std::to_string(s) + " answered " +
                           std::to_string(h.page.rows) + " rows and " + std::to_string(h.page.removed) +
                           " removed ids for a page of " + std::to_string(p.capacity) + (h.page.more ? ", and more" : ""));
        if (!p.started) {
          // The cursor: where the first page found the table.
          out.cursor.incarnation[s] = h.page.incarnation;
          out.cursor.version[s] = h.page.version;
          expected += h.stored;
        } else if (h.page.incarnation != out.cursor.incarnation[s]) {
          throw checkpoint_error("psx: dynamic table '" + v.meta.name + "': its table was replaced (restored from a "
                                 "checkpoint, incarnation " + std::to_string(h.page.incarnation) + " after " +
                                 std::to_string(out.cursor.incarnation[s]) + ") during the export; take a full export" +
                                 server(s));
        }
        const auto* bytes = reinterpret_cast<const std::byte*>(page.data() + detail::page_header_floats);
        const std::size_t at = out.ids.size(), gone = out.removed.size();
        out.ids.resize(at + h.page.rows);
        out.removed.resize(gone + h.page.removed);
        if (h.page.rows != 0) std::memcpy(out.ids.data() + at, bytes, h.page.rows * sizeof(std::uint64_t));
        if (h.page.removed != 0)  // (memcpy into an empty vector's null data is undefined, even of 0 bytes)
          std::memcpy(out.removed.data() + gone, bytes + h.page.rows * sizeof(std::uint64_t),
                      h.page.removed * sizeof(std::uint64_t));
        const float* rows = page.data() + detail::page_header_floats + 2 * p.capacity;
        out.values.insert(out.values.end(), rows, rows + h.page.rows * dim);
        p.started = true;
        p.after = h.page.next;
        p.delivered += taken;
        if (!h.page.more) {
          p.done = true;
          --open;
          std::vector<float>().swap(p.page);
          continue;
        }
        // What is left, as the server counts it now (a delta: at most one
        // entry per change since the cursor), with room for rows that come
        // meanwhile.
        std::uint64_t left = since.empty() ? h.stored : h.stored + h.removals;
        if (!since.empty() && h.page.version >= since.version[s]) left = std::min(left, h.page.version - since.version[s]);
        left = left > p.delivered ? left - p.delivered : 0;
        p.capacity = left >= max_entries ? max_entries
                                         : std::min<std::size_t>(static_cast<std::size_t>(left + left / 8 + 64), max_entries);
      }
      if (round == 0 && since.empty()) {  // room for the rows the servers held (and a little more)
        out.ids.reserve(expected + expected / 16);
        out.values.reserve((expected + expected / 16) * dim);
      }
    }
    return out;
  }

  //! The most one server's page of `export_table` holds by default (rows
  //! of a wider table come in more pages).
  // A full export of 1M rows of 16 floats on 2 servers in process
  // (bench_table_export, a loaded 2-core VM): pages of 1 and 8 MiB took
  // 145-307 and 180-280 ms, 256 KiB 548 ms, 64 MiB 342 ms (larger pages
  // cost page faults, smaller ones rescans of a stripe and round trips).
  static constexpr std::size_t table_page_bytes = std::size_t{8} << 20;

  //! Leaves the cluster, as `ParameterServer::run` does when a worker
  //! function returns: synchronous steps stop waiting for this worker. For
  //! workers driven from threads of your own; calling it again, or after
  //! shutdown, does nothing.
  //! Pipelined pushes still in flight are waited for first (and their
  //! errors dropped: `flush()` before leaving reports them).
  void leave() noexcept {
    if (index_ < core_->pipelines.size()) core_->pipelines[index_].entries.clear();  // each handle waits
    detail::announce(*core_, index_, Op::leave);
  }

 private:
  friend struct detail::WorkerAccess;

  // Sends `op` to every server and waits for every answer; with `answer`,
  // server s writes its answer (a barrier's agreed value, its counters) into
  // answer(s).
  void call_every_server(Op op, std::uint64_t clock_value, const std::string& text = {},
                         const std::function<std::span<float>(std::size_t)>& answer = {}) {
    auto done = std::make_shared<Completion>(num_servers());
    std::size_t s = 0;
    try {
      for (; s < num_servers(); ++s) {
        Request r;
        r.op = op;
        r.worker = static_cast<std::uint32_t>(index_);
        r.clock = clock_value;
        r.reason = text;
        if (answer) r.items.emplace_back().out = answer(s);
        r.done = done;
        r.caller_waits = s + 1 == num_servers();
        core_->send(s, std::move(r));
      }
    } catch (...) {  // the parts not sent fail, so the wait below ends
      const auto error = std::current_exception();
      for (; s < num_servers(); ++s) done->finish(error);
    }
    handle(std::move(done)).wait();
  }

  // Dynamic table `name`, or unknown_variable / config_error naming the call.
  const VariableInfo& table_variable(std::string_view name, const char* verb) const {
    const VariableInfo& v = core_->find(name, verb, index_);
    if (v.meta.kind != VariableKind::dynamic)
      throw config_error("psx: worker " + std::to_string(index_) + ": " + verb + "('" + v.meta.name + "'): a " +
                         (v.meta.kind == VariableKind::dense ? "dense" : "sparse") + " variable, not a dynamic table");
    return v;
  }

  // Sends inspection `op` with one item to server `s` (no clock: it may
  // come from a thread that is not the worker's); `alone`: the only request
  // the caller waits for next (Request::caller_waits; with several, each
  // server's thread takes its own, so that they work at once).
  Handle inspect(Op op, std::size_t s, const Item& item, bool alone) {
    auto done = std::make_shared<Completion>(1);
    Handle h = handle(done);
    Request r;
    r.op = op;
    r.worker = static_cast<std::uint32_t>(index_);
    r.items.push_back(item);
    r.done = done;
    r.caller_waits = alone;
    try {
      core_->send(s, std::move(r));
    } catch (...) {  // not sent: the handle must not wait for it
      done->finish(std::current_exception());
    }
    return h;
  }

  // A handle whose wait sends heartbeats when the cluster has a peer timeout,
  // and that cancels pull `call` (Request::call, 0: none) at `servers` when
  // dropped unfinished.
  Handle handle(std::shared_ptr<Completion> done, std::uint64_t call = 0,
                std::vector<std::uint32_t> servers = {}) const {
    const auto timeout = core_->config.peer_timeout;
    const std::weak_ptr<const bool> alive = core_->alive;
    Handle::Waiter waiter;
    if (core_->await)
      waiter = [core = core_, alive, index = waits_as_](Completion& c) {
        if (!alive.expired()) core->await(index, c);
      };
    Handle::Heartbeat heartbeat;
    std::chrono::milliseconds every{0};
    if (timeout.count() > 0 && waits_as_ == index_) {
      heartbeat = [core = core_, alive, index = index_] {
        if (!alive.expired()) detail::announce(*core, index, Op::heartbeat);
      };
      every = std::max<std::chrono::milliseconds>(timeout / 4, std::chrono::milliseconds(1));
    }
    Handle::Cancel cancel;
    if (call != 0)
      cancel = [core = core_, alive, index = index_, call, servers = std::move(servers)] {
        if (alive.expired()) return;
        for (const std::uint32_t s : servers) {
          Request r;
          r.op = Op::cancel;
          r.worker = static_cast<std::uint32_t>(index);
          r.call = call;
          try {
            core->send(s, std::move(r));
          } catch (...) {  // shut down: the shutdown finishes the call
          }
        }
      };
    return Handle(std::move(done), std::move(waiter), std::move(heartbeat), every, std::move(cancel));
  }

  // Like pull_async, but the servers answer at once whatever the sync
  // policy says and record nothing about this worker (ParameterServer::read).
  Handle read_async(std::span<const PullItem> items) {
    return send_dense(Op::read, items.size(), [&](std::size_t i) { return std::pair{items[i].name, items[i].out.size()}; },
                      [&](std::size_t i, Item& item, std::size_t first, std::size_t n) {
                        item.out = items[i].out.subspan(first, n);
                      });
  }

  void check_trainable(const VariableInfo& v, std::string_view verb) const {
    if (!v.trainable)
      throw frozen_variable("psx: worker " + std::to_string(index_) + ": " + std::string(verb) + " to variable '" +
                            v.meta.name + "' of shape " + detail::shape_string(v.meta.shape) +
                            ", which is frozen (trainable = false)");
  }

  // Every call starts here: a call after shutdown is refused, and the
  // worker's own thread first takes the pipelined pushes that finished,
  // throwing the error of the first that failed.
  void check_running(std::string_view op) const {
    if (core_->stopped.load(std::memory_order_acquire))
      throw shutdown_error("psx: worker " + std::to_string(index_) + ": " + std::string(op) +
                           " after the cluster shut down");
    if (waits_as_ == index_ && index_ < core_->pipelines.size()) {
      detail::PushPipeline& p = core_->pipelines[index_];
      while (!p.entries.empty() && p.entries.front().handle.ready()) settle_oldest(p);
    }
  }

  bool pipelined() const noexcept {
    return waits_as_ == index_ && index_ < core_->pipelines.size() && core_->pipelines[index_].depth > 0;
  }
  detail::PushPipeline& pipeline() const {
    if (index_ >= core_->pipelines.size())
      throw config_error("psx: worker " + std::to_string(index_) + ": this cluster keeps no pipelined pushes");
    return core_->pipelines[index_];
  }
  // Waits for the oldest pipelined push and lets it go (its copies only
  // once it finished); rethrows its error.
  static void settle_oldest(detail::PushPipeline& p) {
    struct Pop {
      detail::PushPipeline& p;
      ~Pop() { p.entries.pop_front(); }
    } pop{p};
    p.entries.front().handle.wait();
  }
  // Sends one pipelined push made by `send(entry)` (which copies what it
  // sends into the entry), first waiting for room. The entry joins the
  // pipeline once sent (its copies' memory does not move with it); if that
  // fails, its handle waits for the call before the copies go.
  template <class Send>
  void pipelined_push(Send&& send) {
    detail::PushPipeline& p = pipeline();
    check_running("push");
    while (p.entries.size() >= p.depth) settle_oldest(p);
    detail::PushPipeline::Entry e;
    e.handle = send(e);
    if (e.handle.ready()) {  // answered already (in one process, at times): nothing to keep
      e.handle.wait();
      return;
    }
    p.entries.push_back(std::move(e));
  }

  // The tensor's shape; a tensor the adapter cannot view (a column-major
  // matrix, strided elements) is a shape_error saying which call and variable.
  template <TensorLike T>
  std::vector<std::size_t> tensor_shape(std::string_view name, const T& tensor, std::string_view op) const {
    try {
      return tensor_traits<T>::shape(tensor);
    } catch (const shape_error& e) {
      throw shape_error("psx: worker " + std::to_string(index_) + ": " + std::string(op) + " of variable '" +
                        std::string(name) + "': " + std::string(detail::without_psx_prefix(e.what())));
    }
  }

  void check_tensor(std::string_view name, const std::vector<std::size_t>& shape, std::string_view op) const {
    const VariableInfo& v = core_->find(name, op, index_);
    const std::size_t n = detail::element_count(shape);
    const bool same = shape == v.meta.shape;
    const bool as_matrix = shape.size() == 2 && shape[0] == v.meta.rows && shape[1] == v.meta.row_width;
    const bool flat = shape.size() == 1 && n == v.meta.size();
    if (!same && !as_matrix && !flat)
      throw shape_error("psx: worker " + std::to_string(index_) + ": " + std::string(op) + " of variable '" +
                        v.meta.name + "' of shape " + detail::shape_string(v.meta.shape) +
                        " with a tensor of shape " + detail::shape_string(shape));
  }

  // Sends the requests built per server; on a send failure, fails the parts
  // not sent and waits for those sent (they may still touch the buffers).
  Handle dispatch(std::vector<Request>& per_server, std::shared_ptr<Completion> done) {
    if (blocking_)
      for (std::size_t k = per_server.size(); k-- > 0;)
        if (!per_server[k].items.empty()) {
          per_server[k].caller_waits = true;
          break;
        }
    // A pull the caller may drop unwaited is numbered, so that its handle
    // can cancel it where a server keeps it (a blocking call always waits).
    std::uint64_t call = 0;
    std::vector<std::uint32_t> servers;  // those its parts go to
    if (!blocking_ && !per_server.empty() && (per_server[0].op == Op::pull || per_server[0].op == Op::pull_rows)) {
      call = core_->calls.fetch_add(1, std::memory_order_relaxed) + 1;
      for (std::size_t k = 0; k < per_server.size(); ++k) {
        per_server[k].call = call;
        if (!per_server[k].items.empty()) servers.push_back(static_cast<std::uint32_t>(k));
      }
    }
    // Made before anything is sent: an allocation that fails here leaves no
    // request in flight with the caller's buffers and no handle to wait.
    Handle h = handle(done, call, std::move(servers));
    std::size_t s = 0;
    try {
      for (; s < per_server.size(); ++s)
        if (!per_server[s].items.empty()) core_->send(s, std::move(per_server[s]));
    } catch (...) {
      auto error = std::current_exception();
      for (; s < per_server.size(); ++s)
        if (!per_server[s].items.empty()) done->finish(error);
      core_->wait(index_, *done);
    }
    return h;
  }

  std::vector<Request> requests(Op op) const {
    std::vector<Request> per_server(num_servers());
    // An inspection carries no clock: it may come from a thread that is
    // not the worker's (ParameterServer::read), which must not read the
    // worker's clock while the worker's thread steps it.
    const bool inspection = detail::is_inspection(op);
    for (Request& r : per_server) {
      r.op = op;
      r.worker = static_cast<std::uint32_t>(index_);
      r.clock = inspection ? 0 : clock();
    }
    return per_server;
  }

  static std::size_t parts(const std::vector<Request>& per_server) {
    std::size_t n = 0;
    for (const Request& r : per_server) n += !r.items.empty();
    return n;
  }

  template <class T>
  static std::span<std::uint16_t> as_bits(std::span<T> out) noexcept {
    static_assert(sizeof(T) == sizeof(std::uint16_t) && std::is_standard_layout_v<T>);
    return {reinterpret_cast<std::uint16_t*>(out.data()), out.size()};
  }

  void check_dtype(std::string_view name, DType want, std::string_view op) const {
    const VariableInfo& v = core_->find(name, op, index_);
    if (v.meta.dtype != want)
      throw shape_error("psx: worker " + std::to_string(index_) + ": " + std::string(op) + " of variable '" +
                        v.meta.name + "' (dtype " + dtype_name(v.meta.dtype) + ") into a " + dtype_name(want) +
                        " buffer; 16-bit pulls need the variable's own dtype");
  }

  // `entry(i)` gives item i's variable name and buffer size; `fill(i, item,
  // first, n)` points the item at elements [first, first + n) of its buffer.
  template <class Entry, class Fill>
  Handle send_dense(Op op, std::size_t count, Entry entry, Fill fill) {
    const bool push = op == Op::push;
    const char* verb = push ? "push" : op == Op::read ? "read" : "pull";
    check_running(verb);
    std::vector<Request> per_server = requests(op);
    for (std::size_t i = 0; i < count; ++i) {
      auto [name, size] = entry(i);
      const VariableInfo& v = core_->find(name, verb, index_);
      if (v.meta.kind == VariableKind::dynamic)
        throw shape_error("psx: worker " + std::to_string(index_) + ": " + verb + " of '" + v.meta.name +
                          "', a dynamic table: it has no whole value; pull_rows and push_rows its rows by id");
      if (size != v.meta.size())
        throw shape_error("psx: worker " + std::to_string(index_) + ": " + verb + " of variable '" + v.meta.name +
                          "' of shape " + detail::shape_string(v.meta.shape) + " (" +
                          detail::floats(v.meta.size()) + ") with a buffer of " + detail::floats(size));
      if (push) check_trainable(v, verb);
      for (std::size_t k = 0; k < v.shards.size(); ++k) {
        const Shard& sh = v.shards[k];
        Item item;
        item.variable = v.meta.id;
        item.shard = static_cast<std::uint32_t>(k);
        fill(i, item, sh.row_begin * v.meta.row_width, sh.rows() * v.meta.row_width);
        per_server[sh.server].items.push_back(item);
      }
    }
    auto done = std::make_shared<Completion>(parts(per_server));
    for (Request& r : per_server) r.done = done;
    return dispatch(per_server, std::move(done));
  }

  Handle send_rows(Op op, std::string_view name, std::span<const std::uint64_t> ids, std::span<const float> in,
                   std::span<float> out, std::span<std::uint16_t> out16) {
    const bool push = op == Op::push_rows;
    const char* verb = push ? "push_rows" : "pull_rows";
    check_running(verb);
    const VariableInfo& v = core_->find(name, verb, index_);
    const std::size_t width = v.meta.row_width;
    const std::size_t got = push ? in.size() : out16.data() ? out16.size() : out.size();
    if (got != ids.size() * width)
      throw shape_error("psx: worker " + std::to_string(index_) + ": " + verb + " of " +
                        std::to_string(ids.size()) + " rows of variable '" + v.meta.name + "' (row width " +
                        std::to_string(width) + ") needs " + detail::floats(ids.size() * width) +
                        ", the buffer has " + detail::floats(got));
    if (ids.size() > std::numeric_limits<std::uint32_t>::max())
      throw shape_error("psx: worker " + std::to_string(index_) + ": " + verb + " of " +
                        std::to_string(ids.size()) + " ids of '" + v.meta.name + "': at most 2^32 - 1 per call");
    const bool dynamic = v.meta.kind == VariableKind::dynamic;  // any 64-bit id
    for (std::size_t j = 0; j < ids.size() && !dynamic; ++j)
      if (ids[j] >= v.meta.rows)
        throw row_out_of_range("psx: worker " + std::to_string(index_) + ": " + verb + " of variable '" +
                               v.meta.name + "' (" + std::to_string(v.meta.rows) + " rows): row id " +
                               std::to_string(ids[j]) + " at position " + std::to_string(j) + " is out of range");
    if (push) check_trainable(v, verb);

    std::vector<Request> per_server = requests(op);
    auto make_item = [&](std::size_t k, std::span<const std::uint64_t> item_ids,
                         std::span<const std::uint32_t> positions) {
      Item item;
      item.variable = v.meta.id;
      item.shard = static_cast<std::uint32_t>(k);
      item.ids = item_ids;
      item.positions = positions;
      item.in = in;
      item.out = out;
      item.out16 = out16;
      per_server[v.shards[k].server].items.push_back(item);
    };

    if (ids.empty()) return Handle();
    if (v.shards.size() == 1) {
      // The common case: the caller's ids travel as they are.
      make_item(0, ids, {});
      auto done = std::make_shared<Completion>(1);
      per_server[v.shards[0].server].done = done;
      return dispatch(per_server, std::move(done));
    }
    // Group ids by shard (a counting sort), remembering where each row lives
    // in the caller's buffer; the completion owns the grouped lists.
    std::vector<std::size_t> start(v.shards.size() + 1, 0);
    std::vector<std::uint32_t> shard_of(ids.size());
    for (std::size_t j = 0; j < ids.size(); ++j) {
      shard_of[j] = static_cast<std::uint32_t>(dynamic ? v.ring.server(ids[j]) : v.shard_of_row(ids[j]));
      ++start[shard_of[j] + 1];
    }
    std::vector<bool> server_used(num_servers(), false);
    for (std::size_t k = 0; k < v.shards.size(); ++k) {
      if (start[k + 1] != 0) server_used[v.shards[k].server] = true;
      start[k + 1] += start[k];
    }
    auto done = std::make_shared<detail::RowsCompletion>(
        static_cast<std::size_t>(std::count(server_used.begin(), server_used.end(), true)));
    done->ids.resize(ids.size());
    done->positions.resize(ids.size());
    std::vector<std::size_t> next(start.begin(), start.end() - 1);
    for (std::size_t j = 0; j < ids.size(); ++j) {
      const std::size_t at = next[shard_of[j]]++;
      done->ids[at] = ids[j];
      done->positions[at] = static_cast<std::uint32_t>(j);
    }
    const std::span<const std::uint64_t> grouped_ids(done->ids);
    const std::span<const std::uint32_t> grouped_positions(done->positions);
    for (std::size_t k = 0; k < v.shards.size(); ++k) {
      const std::size_t b = start[k], n = start[k + 1] - start[k];
      if (n != 0) make_item(k, grouped_ids.subspan(b, n), grouped_positions.subspan(b, n));
    }
    for (Request& r : per_server) r.done = done;
    return dispatch(per_server, std::move(done));
  }

  // A blocking call: sends as `call` does, its last request marked
  // Request::caller_waits, and waits.
  template <class Call>
  void blocking(Call&& call) {
    blocking_ = true;
    Handle h;
    try {
      h = call();
    } catch (...) {
      blocking_ = false;
      throw;
    }
    blocking_ = false;
    h.wait();
  }

  detail::ClusterCore* core_;
  std::size_t index_;
  // Who waits for the answers: the worker itself, or (num_workers) another
  // thread that reads through it (ParameterServer::read watching a run),
  // which neither stands in for the worker in a simulated cluster nor
  // sends heartbeats in its name.
  std::size_t waits_as_ = index_;
  bool blocking_ = false;  // within blocking(): the requests dispatched are waited for at once
};

}  // namespace v0
}  // namespace psx
