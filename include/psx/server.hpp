//! @file psx/server.hpp
//! A parameter server: owns shards of variables with their optimizer slots,
//! applies gradients as the sync policy says, answers pulls. One thread runs
//! it (the transport's `serve` loop), so its state needs no lock; requests
//! the sync policy holds back are kept and retried when progress changes,
//! never waited on.
#pragma once

#include <psx/concepts.hpp>
#include <psx/detail/persist.hpp>
#include <psx/detail/priority.hpp>
#include <psx/detail/span.hpp>
#include <psx/detail/table_ops.hpp>
#include <psx/embedding.hpp>
#include <psx/errors.hpp>
#include <psx/message.hpp>
#include <psx/storage.hpp>
#include <psx/variable.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {
namespace detail {

// One worker's gradient for one shard in one step: the sum of its pushes.
struct Contribution {
  bool present = false;
  bool empty = false;  // a step() without a gradient for this shard (SyncState::counts_empty_steps)
  std::uint64_t clock = 0;           // the worker's clock when it made the contribution
  std::uint64_t pulled_version = 0;  // the shard version the worker had read
  std::vector<float> dense;  // the whole shard, or empty when only rows were pushed
  RowAccumulator rows;
};

}  // namespace detail


//! A server of the cluster: holds the shards the partitioner gave it, in
//! `Storage` (host memory by default, see psx/storage.hpp).
template <class S, class O, class Storage = storage::Host>
class Server final : public RequestHandler {
  using SyncStateT = decltype(std::declval<const S&>().make_state(std::size_t{}));
  using time_point = clock_type::time_point;

 public:
  //! `variables` must outlive the server (shards point at their entries).
  //! A worker silent for `peer_timeout` while others wait is lost (0: never);
  //! one not yet heard from at all has `start_grace` from the server's start
  //! instead, where that is longer (processes that start in any order).
  Server(std::size_t index, std::size_t num_workers, const std::vector<VariableInfo>& variables, const S& sync,
         const O& optimizer, std::chrono::milliseconds peer_timeout = {}, std::chrono::milliseconds start_grace = {})
      : index_(index),
        sync_(sync.make_state(num_workers)),
        optimizer_(optimizer),
        peer_timeout_(peer_timeout),
        start_grace_(start_grace),
        clocks_(num_workers, 0),
        gone_(num_workers, Gone::no),
        heard_(num_workers, false),
        last_seen_(num_workers, clock_type::now()),
        lost_reason_(num_workers) {
    shards_.resize(variables.size());
    for (const VariableInfo& v : variables) {
      shards_[v.meta.id].resize(v.shards.size());
      for (std::size_t k = 0; k < v.shards.size(); ++k)
        if (v.shards[k].server == index) {
          shards_[v.meta.id][k] = make_shard(v, k);
          const ShardState& sh = *shards_[v.meta.id][k];
          if (sh.table) tables_.push_back(sh.table.get());
          parameter_bytes_ += sh.data.parameter_bytes();
          slot_bytes_ += sh.data.slot_bytes();
        }
    }
    recount();
  }

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  //! Calls off a save being written in the background.
  ~Server() { forget_background(); }

  void handle(Request&& r) noexcept override {
    const bool timed = peer_timeout_.count() > 0;
    const time_point start = timed ? clock_type::now() : time_point{};
    count(requests_);
    std::exception_ptr error;
    try {
      dispatch(std::move(r));
    } catch (...) {
      error = std::current_exception();
    }
    // Finished after the handler ended, so that `error` is the only reference
    // left here and the worker becomes the exception's sole owner.
    if (error) {
      count(errors_);
      r.finish(std::move(error));
    }
    note_waiting();
    if (timed) {
      // Only a handle longer than the heartbeat period hides heartbeats:
      // what comes during a shorter one is read within the slack the
      // timeout leaves (counting every handle would stretch a dead
      // worker's timeout by all the time a busy server spends).
      const auto took = clock_type::now() - start;
      if (took > peer_timeout_ / 4) deaf_ += took;
    }
  }

  void drain(const ErrorFactory& make_error) noexcept override {
    fail_waiting(make_error);
    note_waiting();
  }

  time_point next_tick() const noexcept override {
    if (peer_timeout_.count() <= 0) return time_point::max();
    // A tenth: a silent worker is lost within 1.1 times the timeout.
    return last_tick_ + std::max<clock_type::duration>(peer_timeout_ / 10, std::chrono::milliseconds(1));
  }

  void tick(time_point now) noexcept override {
    last_tick_ = now;
    if (peer_timeout_.count() <= 0 || failed() || (parked_.empty() && barrier_.empty())) return;
    // Someone waits on progress: a live worker with nothing waiting here that
    // has been silent for longer than the timeout is lost.
    std::vector<bool> waiting(clocks_.size(), false);
    for (const Request& r : parked_) waiting[r.worker] = true;
    for (const Request& r : barrier_) waiting[r.worker] = true;
    for (std::size_t w = 0; w < clocks_.size(); ++w) {
      const auto silence = now - deaf_ - last_seen_[w];
      const bool unstarted = !heard_[w] && start_grace_ > peer_timeout_;
      if (gone_[w] != Gone::no || waiting[w] || silence <= (unstarted ? start_grace_ : peer_timeout_)) continue;
      const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(silence);
      try {
        lose(w, unstarted ? "never appeared: nothing from it in the " + std::to_string(silent.count()) +
                                " ms since the server started (start timeout " +
                                std::to_string(start_grace_.count()) + " ms)"
                          : "sent nothing for " + std::to_string(silent.count()) + " ms (peer timeout " +
                                std::to_string(peer_timeout_.count()) + " ms)");
      } catch (...) {  // a failing policy or allocation: keep serving
      }
    }
    note_waiting();
  }

  //! A snapshot of the counters.
  ServerStats stats() const {
    auto get = [](const std::atomic<std::uint64_t>& a) { return a.load(std::memory_order_relaxed); };
    ServerStats st{get(requests_), get(pulls_), get(pushes_), get(bytes_in_), get(bytes_out_),
                   get(errors_),   get(dropped_), get(steps_), {}};
    st.staleness.reserve(staleness_buckets);
    for (const auto& b : staleness_) st.staleness.push_back(get(b));
    st.parameter_bytes = parameter_bytes_;
    st.slot_bytes = slot_bytes_;
    for (const DynamicTable<O>* t : tables_) {  // rows held now
      const std::uint64_t row = t->dim() * sizeof(float), rows = t->size();
      st.parameter_bytes += rows * row;
      st.slot_bytes += rows * row * optimizer_.slots();
    }
    st.rejected = get(rejected_);
    st.undelivered = get(undelivered_);
    st.retried = get(retried_);
    st.duplicates = get(duplicates_);
    st.waiting = get(waiting_);
    st.waiting_max = get(waiting_max_);
    return st;
  }

  void link_event(LinkEvent e) noexcept override {
    switch (e) {
      case LinkEvent::rejected: return count(rejected_);
      case LinkEvent::undelivered: return count(undelivered_);
      case LinkEvent::retried: return count(retried_);
      case LinkEvent::duplicate: return count(duplicates_);
    }
  }

  std::string training_failure() const override { return failed_ ? failure_text() : std::string(); }

  WorkerState worker_state(std::size_t w) const noexcept override {
    if (w >= gone_.size() || gone_[w] == Gone::no) return WorkerState::active;
    return gone_[w] == Gone::left ? WorkerState::left : WorkerState::lost;
  }

  //! Why training failed on this server (the sync policy gave up on a lost
  //! worker, or a step could not be applied), or null. Read it once the
  //! server has stopped serving.
  std::exception_ptr failure() const {
    return failed() ? failure_error(failure_text()) : std::exception_ptr();
  }

  //! This server's part of dynamic table `variable` (a declaration index),
  //! or null; safe to use from any thread while the server runs.
  const DynamicTable<O>* table(std::uint32_t variable) const noexcept {
    if (variable >= shards_.size() || index_ >= shards_[variable].size() || !shards_[variable][index_]) return nullptr;
    return shards_[variable][index_]->table.get();
  }

 private:
  enum class Gone : std::uint8_t { no, left, lost };

  // What a shard remembers of each worker.
  struct WorkerView {
    std::uint64_t pulled_version = 0;
    std::uint64_t pulled_step = 0;
    bool has_pushed = false;
    std::uint64_t pushed_step = 0;
    bool pushed_since_clock = false;  // a push (applied, aggregated or dropped) since the last step()
    std::vector<float> pulled;        // the values last pulled, for delay compensation
    std::vector<bool> pulled_rows;    // which rows of `pulled` hold values the worker read
  };

  struct ShardState {
    ShardState(const O& optimizer, const VariableInfo& v, std::size_t k)
        : var(&v), shard(v.shards[k]), data(optimizer, v, v.shards[k]) {
      if (v.meta.kind == VariableKind::dynamic)
        table = std::make_unique<DynamicTable<O>>(v.meta.name, v.meta.row_width, v.init, v.table, optimizer);
    }

    const VariableInfo* var = nullptr;
    Shard shard;
    // Parameters, optimizer slots and the 16-bit copy, where Storage keeps them.
    typename Storage::template shard<O> data;
    // A dynamic table's part on this server (then `data` holds nothing).
    std::unique_ptr<DynamicTable<O>> table;
    std::uint64_t version = 0;
    std::uint64_t applied_steps = 0;
    std::vector<WorkerView> workers;
    // Step -> each worker's contribution, for aggregating policies.
    std::map<std::uint64_t, std::vector<detail::Contribution>> pending;

    std::size_t width() const noexcept { return var->meta.row_width; }
    ShardProgress progress() const noexcept { return {&var->meta, version, applied_steps}; }
  };

  // What the first phase of a restore read, until the second applies it.
  struct StagedRestore {
    std::uint64_t step = 0;
    std::vector<ShardState*> held;
    std::vector<detail::RestoredShard> shards;
    std::vector<ShardState*> held_tables;
    std::vector<std::unique_ptr<typename DynamicTable<O>::Restorer>> restorers;
    std::vector<detail::RestoredTable> tables;
  };

  std::unique_ptr<ShardState> make_shard(const VariableInfo& v, std::size_t k) const {
    auto s = std::make_unique<ShardState>(optimizer_, v, k);
    s->workers.resize(clocks_.size());
    if (s->table && !Storage::host_visible)
      throw config_error("psx: server " + std::to_string(index_) + ": dynamic table '" + v.meta.name +
                         "' lives in host memory, and this storage hands pulls buffers elsewhere (device memory); "
                         "keep dynamic tables on a cluster with host storage");
    if constexpr (detail::has_compensation<SyncStateT>)
      if (s->table && sync_.compensates(v.meta))
        throw config_error("psx: server " + std::to_string(index_) + ": dynamic table '" + v.meta.name +
                           "': delay compensation keeps a copy of every row a worker read, which an unbounded "
                           "table cannot; leave it out of the compensated variables");
    if constexpr (detail::has_compensation<SyncStateT> && !Storage::host_visible)
      if (sync_.compensates(v.meta))
        throw config_error("psx: server " + std::to_string(index_) + ": variable '" + v.meta.name +
                           "': delay compensation reads parameters on the host; this storage keeps them elsewhere");
    return s;
  }

  // The dynamic table a table request names (its one item: the variable,
  // and this server's index as the shard), its answer's size checked.
  const DynamicTable<O>& table_for(const Request& r) const {
    const bool page = r.op == Op::table_export;
    const char* what = page ? "an export page" : "a table stats request";
    if (r.items.size() != 1)
      throw wire_error("psx: " + where(r) + ": " + what + " carries one item, not " + std::to_string(r.items.size()));
    const Item& item = r.items[0];
    const DynamicTable<O>* t = item.shard == index_ ? table(item.variable) : nullptr;
    if (!t)
      throw wire_error("psx: " + where(r) + ": " + what + " names shard " + std::to_string(item.shard) +
                       " of variable " + std::to_string(item.variable) +
                       ", which is not this server's part of a dynamic table");
    const bool sized = page ? detail::is_page_size(item.out.size(), t->dim()) && item.ids.size() == detail::page_ask_words
                            : item.out.size() == detail::table_stats_floats && item.ids.empty();
    if (!sized)
      throw wire_error("psx: " + where(r) + ": " + what + " of table '" + t->name() + "' with " +
                       std::to_string(item.ids.size()) + " words and an answer of " + std::to_string(item.out.size()) +
                       " floats (" +
                       (page ? std::to_string(detail::page_ask_words) + " words, " +
                                   std::to_string(detail::page_header_floats) + " floats and rows of " +
                                   std::to_string(t->dim()) + " floats with their ids"
                             : "no word, " + std::to_string(detail::table_stats_floats) + " floats") +
                       " expected)");
    return *t;
  }

  // One page of a table's export (Op::table_export): the request's words
  // say from which cursor and after which id hash (detail/table_ops.hpp).
  void export_page(const Request& r) {
    const DynamicTable<O>& t = table_for(r);
    const Item& item = r.items[0];
    const std::uint64_t flags = item.ids[3];
    if ((flags & ~(detail::page_delta | detail::page_continues)) != 0)
      throw wire_error("psx: " + where(r) + ": an export page with unknown flags " + std::to_string(flags));
    TableCursor since;
    if (flags & detail::page_delta) since = {{item.ids[0]}, {item.ids[1]}};
    std::optional<std::uint64_t> after;
    if (flags & detail::page_continues) after = item.ids[2];
    detail::PageHeader h;
    h.page = t.export_page(since, after, item.out.subspan(detail::page_header_floats));
    const TableStats st = t.stats();
    h.stored = st.rows;
    h.removals = st.removal_log;
    detail::put_page_header(h, item.out);
    count(bytes_out_, (h.page.rows * (2 + t.dim()) + 2 * h.page.removed) * sizeof(float));
  }

  ServerClock server_clock() const noexcept { return {clocks_, min_clock_, live_}; }

  std::string where(const Request& r) const {
    return "server " + std::to_string(index_) + ", request from worker " + std::to_string(r.worker);
  }

  // Only the server thread writes the counters; a plain load + store keeps
  // the hot path free of locked instructions.
  static void count(std::atomic<std::uint64_t>& a, std::uint64_t n = 1) noexcept {
    a.store(a.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }

  // The queue's gauge, after anything that may have kept or let go requests.
  void note_waiting() noexcept {
    const std::uint64_t n = parked_.size() + barrier_.size();
    waiting_.store(n, std::memory_order_relaxed);
    if (n > waiting_max_.load(std::memory_order_relaxed)) waiting_max_.store(n, std::memory_order_relaxed);
  }

  void record_staleness(std::uint64_t now, std::uint64_t pulled) noexcept {
    const std::uint64_t k = now > pulled ? now - pulled : 0;
    count(staleness_[std::min<std::uint64_t>(k, staleness_buckets - 1)]);
  }

  ShardState& shard_for(const Request& r, const Item& item) {
    if (item.variable >= shards_.size() || item.shard >= shards_[item.variable].size() ||
        !shards_[item.variable][item.shard])
      throw wire_error("psx: " + where(r) + " names shard " + std::to_string(item.shard) + " of variable " +
                       std::to_string(item.variable) + ", which this server does not hold");
    return *shards_[item.variable][item.shard];
  }

  // Checks an item's sizes against its shard; returns the shard.
  ShardState& checked(const Request& r, const Item& item, bool rows, bool push) {
    ShardState& s = shard_for(r, item);
    const std::size_t width = s.width();
    const bool low = !push && !item.out16.empty();
    const std::size_t got = push ? item.in.size() : low ? item.out16.size() : item.out.size();
    const std::string& name = s.var->meta.name;
    if (low && !s.data.low_precision())
      throw wire_error("psx: " + where(r) + ": a 16-bit pull of variable '" + name + "', which is stored as " +
                       dtype_name(s.var->meta.dtype));
    if (!rows) {
      if (s.table)
        throw wire_error("psx: " + where(r) + ": a whole-shard request of '" + name +
                         "', a dynamic table (its rows go by id: pull_rows, push_rows)");
      if (got != s.data.size())
        throw wire_error("psx: " + where(r) + ": variable '" + name + "' shard has " +
                         std::to_string(s.data.size()) + " floats, the request carries " + std::to_string(got));
      return s;
    }
    if (!item.positions.empty() && item.positions.size() != item.ids.size())
      throw wire_error("psx: " + where(r) + ": variable '" + name + "': " + std::to_string(item.ids.size()) +
                       " ids but " + std::to_string(item.positions.size()) + " positions");
    // Whole rows, and without positions one per id: a buffer of another
    // size is a malformed request (floats that would be ignored, or a
    // table's refusal halfway through a pull of several items).
    if (item.positions.empty() ? got != item.ids.size() * width : got % width != 0)
      throw wire_error("psx: " + where(r) + ": variable '" + name + "': a buffer of " + std::to_string(got) +
                       " elements, not " +
                       (item.positions.empty() ? std::to_string(item.ids.size()) + " rows" : std::string("whole rows")) +
                       " of " + std::to_string(width));
    const std::size_t buffer_rows = got / width;
    for (std::size_t j = 0; j < item.ids.size(); ++j) {
      const std::uint64_t id = item.ids[j];
      const std::size_t pos = item.positions.empty() ? j : item.positions[j];
      if (s.table && s.var->ring.servers() > 1 && s.var->ring.server(id) != index_)
        throw wire_error("psx: " + where(r) + ": id " + std::to_string(id) + " of dynamic table '" + name +
                         "' belongs to server " + std::to_string(s.var->ring.server(id)) +
                         " (the worker places ids on another ring)");
      if (!s.table && (id < s.shard.row_begin || id >= s.shard.row_end))
        throw row_out_of_range("psx: " + where(r) + ": row " + std::to_string(id) + " of variable '" + name +
                               "' is not in this shard's rows [" + std::to_string(s.shard.row_begin) + ", " +
                               std::to_string(s.shard.row_end) + ")");
      if (pos >= buffer_rows)
        throw wire_error("psx: " + where(r) + ": variable '" + name + "': row position " + std::to_string(pos) +
                         " beyond the " + std::to_string(buffer_rows) + "-row buffer");
    }
    return s;
  }

  void dispatch(Request&& r) {
    // Inspection: answered whatever the sync policy and the worker's state.
    const bool inspection = detail::is_inspection(r.op);
    if (!inspection && r.worker >= clocks_.size())
      throw wire_error("psx: server " + std::to_string(index_) + ": request from worker " +
                       std::to_string(r.worker) + " of " + std::to_string(clocks_.size()));
    // Once the policy failed only inspection is served; a worker's leaving
    // or failing is still recorded (a server told to stop waits for that).
    if (failed() && !inspection && r.op != Op::leave && r.op != Op::fail)
      std::rethrow_exception(failure_error(failure_text() + "; since then this cluster answers reads and stats only "
                                                            "(to go on, make a new ParameterServer and restore a "
                                                            "checkpoint)"));
    if (failed() && r.op == Op::leave) {
      if (gone_[r.worker] == Gone::no) gone_[r.worker] = Gone::left;
      r.finish();
      return;
    }
    if (!inspection && r.op != Op::join && gone_[r.worker] == Gone::lost)
      throw peer_lost("psx: server " + std::to_string(index_) + ": worker " + std::to_string(r.worker) +
                      " was declared lost earlier (" + lost_reason_[r.worker] + ") and is no longer served");
    if (!inspection) {
      last_seen_[r.worker] = clock_type::now() - deaf_;
      heard_[r.worker] = true;
    }
    switch (r.op) {
      case Op::pull:
      case Op::pull_rows:
      case Op::read:
        refuse_wrapping_clock(r);
        for (const Item& item : r.items) checked(r, item, r.op == Op::pull_rows, false);
        if (r.op != Op::read && !may_pull(r)) {
          parked_.push_back(std::move(r));
          return;
        }
        answer_pull(r);
        break;
      case Op::push:
      case Op::push_rows:
        refuse_wrapping_clock(r);
        push(r);
        advance();
        break;
      case Op::join:
        join(r);
        advance();
        break;
      case Op::clock:
      case Op::leave:
        tick_clock(r);
        if (r.op == Op::clock) count_empty_steps(r.worker);
        advance();
        break;
      case Op::fail:
        lose(r.worker, r.reason);
        break;
      case Op::heartbeat:
        break;  // last_seen_ is all it updates
      case Op::cancel:
        if (!r.items.empty()) throw wire_error("psx: " + where(r) + ": a cancel carries no item");
        cancel(r);
        break;
      case Op::barrier:
        if (!r.items.empty() && (r.items.size() != 1 || r.items[0].out.size() != 2))
          throw wire_error("psx: " + where(r) + ": a barrier carries no item, or one answer of 2 floats");
        // The barrier waits for the workers still training: one that left
        // would stand in for one of them and let it through early.
        if (gone_[r.worker] == Gone::left)
          throw sync_error("psx: server " + std::to_string(index_) + ": a barrier from worker " +
                           std::to_string(r.worker) +
                           ", which has left the cluster (Worker::leave, or the end of its function in run(); it "
                           "counts again from the next run())");
        barrier_.push_back(std::move(r));
        release_barrier();
        return;
      case Op::save:
        if (r.items.empty()) save(r);
        else background_save(r);
        break;
      case Op::restore:
        restore(r);
        break;
      case Op::stats:
        if (r.items.size() != 1 || r.items[0].out.size() != detail::stats_floats)
          throw wire_error("psx: " + where(r) + ": a stats request carries one answer of " +
                           std::to_string(detail::stats_floats) + " floats");
        detail::put_stats(stats(), r.items[0].out);
        break;
      case Op::table_stats:
        detail::put_table_stats(table_for(r).stats(), r.items[0].out);
        break;
      case Op::table_export:
        export_page(r);
        break;
      default:
        throw wire_error("psx: " + where(r) + " has unknown operation " +
                         std::to_string(static_cast<unsigned>(r.op)));
    }
    r.finish();  // last: an error above finishes the request once, in handle()
  }

  // Writes every shard this server holds, with its optimizer slots, and
  // its part of every dynamic table into the checkpoint directory
  // `r.reason` (psx/checkpoint.hpp's format).
  void save(const Request& r) {
    // An empty path would write the shard into the server's working directory.
    if (r.reason.empty()) throw wire_error("psx: " + where(r) + ": a save request names no checkpoint directory");
    if (background_ && !background_->done.load(std::memory_order_acquire))
      throw checkpoint_error("psx: server " + std::to_string(index_) + ": asked to save step " + std::to_string(r.clock) +
                             " while it still writes step " + std::to_string(background_->step) +
                             " in the background (one save at a time)");
    const auto& hooks = detail::persist_hooks();
    if (!hooks.save)
      throw config_error("psx: server " + std::to_string(index_) +
                         ": asked to save a checkpoint, but this program does not include psx/checkpoint.hpp");
    const std::size_t num_slots = optimizer_.slots();
    std::vector<detail::SavedShard> out;
    std::vector<detail::SavedTable> tables;
    std::deque<std::vector<float>> staged;  // state copied out of storage that is not in host memory (stable addresses)
    for (auto& per_variable : shards_)
      for (std::size_t k = 0; k < per_variable.size(); ++k) {
        if (!per_variable[k]) continue;
        ShardState& s = *per_variable[k];
        if (s.table) {
          detail::SavedTable t{s.var, s.table->checkpoint_state(), s.table->checkpoint_sketch(), {}};
          t.state.shard_version = s.version;
          t.rows = [table = s.table.get()](const std::function<void(std::span<const std::byte>)>& sink) {
            table->checkpoint_rows(sink);
          };
          tables.push_back(std::move(t));
          continue;
        }
        detail::SavedShard v{s.var, static_cast<std::uint32_t>(k), s.version, {}, {}};
        if constexpr (requires { s.data.values(); s.data.slot_values(std::size_t{}); }) {
          v.params = s.data.values();
          for (std::size_t j = 0; j < num_slots; ++j) v.slots.push_back(s.data.slot_values(j));
        } else if constexpr (requires(std::span<float> a) { s.data.save_state(a, a); }) {
          const std::size_t n = s.data.size();
          std::vector<float>& params = staged.emplace_back(n);
          std::vector<float>& slots = staged.emplace_back(num_slots * n);
          s.data.save_state(params, slots);
          v.params = params;
          for (std::size_t j = 0; j < num_slots; ++j) v.slots.push_back(std::span<const float>(slots).subspan(j * n, n));
        } else {
          throw config_error("psx: server " + std::to_string(index_) +
                             ": this storage has neither save_state nor values/slot_values: it cannot be checkpointed");
        }
        out.push_back(std::move(v));
      }
    hooks.save({r.reason, r.clock, index_}, out, tables);
  }

  // A save written by a thread of its own while the server goes on
  // serving (checkpoint::BackgroundSave). Its snapshot: the dense shards
  // copied, each dynamic table's Snapshot (copy-on-write by row).
  struct BackgroundSave {
    std::uint64_t step = 0;
    std::string directory;
    std::deque<std::vector<float>> copies;
    std::vector<detail::SavedShard> shards;
    std::vector<std::unique_ptr<typename DynamicTable<O>::Snapshot>> snapshots;
    std::vector<detail::SavedTable> tables;
    std::atomic<bool> stop{false}, done{false};
    std::exception_ptr error;  // the writer's, set before `done`
    std::thread writer;
  };

  // Op::save with an answer of 2 floats (a u64), `r.reason`:
  //  - a directory: snapshot this server's state now and write its shard
  //    file of step `r.clock` there in the background; answers 0 once the
  //    snapshot is taken;
  //  - "?" and that directory: answers 1 once the file is written, 0 while
  //    it is being written; throws the writer's error when it failed;
  //  - "-" and that directory: calls it off (its writer stops between two
  //    blocks) and forgets it; answers 1 (also when this server has no such
  //    save: one refused, or one it forgot).
  void background_save(const Request& r) {
    if (r.items.size() != 1 || r.items[0].out.size() != 2)
      throw wire_error("psx: " + where(r) + ": a background save carries one answer of 2 floats");
    auto answer = [&](std::uint64_t v) { std::memcpy(r.items[0].out.data(), &v, sizeof v); };
    const std::string_view dir = std::string_view(r.reason).substr(r.reason.empty() ? 0 : 1);
    const bool this_one = background_ && background_->directory == dir;
    if (r.reason.starts_with("-")) {
      if (this_one) forget_background();
      return answer(1);
    }
    if (r.reason.starts_with("?")) {
      if (!this_one)
        throw checkpoint_error("psx: server " + std::to_string(index_) + ": asked about the background save of step " +
                               std::to_string(r.clock) + " in " + std::string(dir) + ", but it " +
                               (background_ ? "writes step " + std::to_string(background_->step) + " in " +
                                                  background_->directory
                                            : std::string("writes none")));
      if (!background_->done.load(std::memory_order_acquire)) return answer(0);
      if (background_->writer.joinable()) background_->writer.join();
      if (background_->error) std::rethrow_exception(background_->error);
      return answer(1);
    }
    if (r.reason.empty()) throw wire_error("psx: " + where(r) + ": a background save names no checkpoint directory");
    if (background_ && !background_->done.load(std::memory_order_acquire))
      throw checkpoint_error("psx: server " + std::to_string(index_) + ": asked to save step " +
                             std::to_string(r.clock) + " in the background while it still writes step " +
                             std::to_string(background_->step) + " (one save at a time)");
    forget_background();  // one written and not asked about: the chief gave it up
    const auto& hooks = detail::persist_hooks();
    if (!hooks.save)
      throw config_error("psx: server " + std::to_string(index_) +
                         ": asked to save a checkpoint, but this program does not include psx/checkpoint.hpp");
    auto b = std::make_unique<BackgroundSave>();
    b->step = r.clock;
    b->directory = r.reason;
    const std::size_t num_slots = optimizer_.slots();
    for (auto& per_variable : shards_)
      for (std::size_t k = 0; k < per_variable.size(); ++k) {
        if (!per_variable[k]) continue;
        ShardState& s = *per_variable[k];
        if (s.table) {
          auto& snap = b->snapshots.emplace_back(s.table->snapshot());
          detail::SavedTable t{s.var, snap->state(), snap->sketch(), {}};
          t.state.shard_version = s.version;
          t.rows = [snap = snap.get(), stop = &b->stop](const std::function<void(std::span<const std::byte>)>& sink) {
            snap->rows(sink, stop);
          };
          b->tables.push_back(std::move(t));
          continue;
        }
        detail::SavedShard v{s.var, static_cast<std::uint32_t>(k), s.version, {}, {}};
        const std::size_t n = s.data.size();
        std::vector<float>& params = b->copies.emplace_back(n);
        std::vector<float>& slots = b->copies.emplace_back(num_slots * n);
        if constexpr (requires { s.data.values(); s.data.slot_values(std::size_t{}); }) {
          std::copy(s.data.values().begin(), s.data.values().end(), params.begin());
          for (std::size_t j = 0; j < num_slots; ++j) {
            const auto slot = s.data.slot_values(j);
            std::copy(slot.begin(), slot.end(), slots.begin() + static_cast<std::ptrdiff_t>(j * n));
          }
        } else if constexpr (requires(std::span<float> a) { s.data.save_state(a, a); }) {
          s.data.save_state(params, slots);
        } else {
          throw config_error("psx: server " + std::to_string(index_) +
                             ": this storage has neither save_state nor values/slot_values: it cannot be checkpointed");
        }
        v.params = params;
        for (std::size_t j = 0; j < num_slots; ++j) v.slots.push_back(std::span<const float>(slots).subspan(j * n, n));
        b->shards.push_back(std::move(v));
      }
    BackgroundSave& saving = *b;
    const detail::PersistRequest where_to{r.reason, r.clock, index_};
    saving.writer = std::thread([&saving, where_to, save = hooks.save] {
      detail::lower_this_thread();  // training first: the write takes the CPU time training leaves
      try {
        save(where_to, saving.shards, saving.tables);
      } catch (...) {
        saving.error = std::current_exception();
      }
      saving.snapshots.clear();  // copies let go, the tables copy no more
      saving.done.store(true, std::memory_order_release);
    });
    background_ = std::move(b);
    answer(0);
  }

  // Calls off the background save, if any, and waits for its writer.
  void forget_background() noexcept {
    if (!background_) return;
    background_->stop.store(true, std::memory_order_relaxed);
    if (background_->writer.joinable()) background_->writer.join();
    background_.reset();
  }

  // A restore in two phases, so that it changes nothing anywhere unless
  // every server could read its part: `r.reason` a directory: read and
  // check what this server's shards need from the checkpoint there, and
  // keep it; `r.reason` empty: replace every shard by what was kept and set
  // every clock to the checkpoint's step (`r.clock`); "-": drop what was kept.
  void restore(const Request& r) {
    if (r.reason == "-") {
      staged_.reset();
      return;
    }
    if (background_ && !background_->done.load(std::memory_order_acquire))
      throw checkpoint_error("psx: server " + std::to_string(index_) + ": asked to restore a checkpoint while it writes step " +
                             std::to_string(background_->step) + " in the background (finish or call off that save first)");
    if (r.reason.empty()) return commit_restore(r.clock);
    const auto& hooks = detail::persist_hooks();
    if (!hooks.restore)
      throw config_error("psx: server " + std::to_string(index_) +
                         ": asked to restore a checkpoint, but this program does not include psx/checkpoint.hpp");
    if constexpr (!requires(std::span<const float> a) { std::declval<ShardState&>().data.assign(a, a); }) {
      throw config_error("psx: server " + std::to_string(index_) +
                         ": this storage has no assign(params, slots): it cannot restore a checkpoint");
    } else {
      staged_.reset();
      auto staged = std::make_unique<StagedRestore>();
      const std::size_t num_slots = optimizer_.slots();
      for (auto& per_variable : shards_)
        for (std::size_t k = 0; k < per_variable.size(); ++k)
          if (ShardState* s = per_variable[k].get(); s && s->table) {
            staged->held_tables.push_back(s);
            staged->restorers.push_back(
                std::make_unique<typename DynamicTable<O>::Restorer>(*s->table, s->var->ring, index_));
            staged->tables.push_back({s->var, index_, staged->restorers.back().get()});
          } else if (s) {
            staged->held.push_back(s);
            staged->shards.push_back({s->var, static_cast<std::uint32_t>(k), num_slots, {}, {}, 0});
          }
      staged->step = hooks.restore({r.reason, r.clock, index_}, staged->shards, staged->tables);
      for (std::size_t i = 0; i < staged->held.size(); ++i) {
        const auto& t = staged->shards[i];
        if (t.params.size() != staged->held[i]->data.size() || t.slots.size() != num_slots * t.params.size())
          throw checkpoint_error("psx: server " + std::to_string(index_) + ": the checkpoint reader returned " +
                                 std::to_string(t.params.size()) + " parameters for a shard of '" +
                                 t.variable->meta.name + "' that holds " + std::to_string(staged->held[i]->data.size()));
      }
      staged_ = std::move(staged);
    }
  }

  void commit_restore(std::uint64_t step) {
    if (!staged_ || staged_->step != step)
      throw checkpoint_error("psx: server " + std::to_string(index_) + ": asked to commit the restore of step " +
                             std::to_string(step) + ", but it " +
                             (staged_ ? "read step " + std::to_string(staged_->step) : std::string("read none")));
    if constexpr (requires(std::span<const float> a) { std::declval<ShardState&>().data.assign(a, a); }) {
      const auto staged = std::move(staged_);
      auto restart = [&](ShardState& s, std::uint64_t version) {
        s.version = version;
        s.applied_steps = step;
        s.pending.clear();
        s.workers.assign(clocks_.size(), WorkerView{});
        for (WorkerView& wv : s.workers) {
          wv.pulled_version = s.version;
          wv.pulled_step = step;
        }
      };
      for (std::size_t i = 0; i < staged->held.size(); ++i) {
        ShardState& s = *staged->held[i];
        if constexpr (requires { s.data.adopt(staged->shards[i].params, staged->shards[i].slots); })
          s.data.adopt(staged->shards[i].params, staged->shards[i].slots);
        else
          s.data.assign(staged->shards[i].params, staged->shards[i].slots);
        restart(s, staged->shards[i].version);
      }
      for (std::size_t i = 0; i < staged->held_tables.size(); ++i) {
        ShardState& s = *staged->held_tables[i];
        s.table->adopt(*staged->restorers[i]);
        restart(s, staged->restorers[i]->shard_version());
      }
      std::fill(clocks_.begin(), clocks_.end(), step);
      recount();
    }
  }

  bool may_pull(const Request& r) const {
    for (const Item& item : r.items) {
      const ShardState& s = *shards_[item.variable][item.shard];
      const WorkerView& wv = s.workers[r.worker];
      if (!sync_.may_pull(PullInfo{r.worker, r.clock, wv.has_pushed, wv.pushed_step}, s.progress(),
                          server_clock()))
        return false;
    }
    return true;
  }

  void answer_pull(const Request& r) {
    const bool rows = r.op == Op::pull_rows;
    count(pulls_);
    for (const Item& item : r.items) {
      ShardState& s = shard_for(r, item);
      const std::size_t width = s.width();
      const bool compensating = r.op != Op::read && compensates(s);
      const bool low = !item.out16.empty();
      const std::size_t elem = low ? sizeof(std::uint16_t) : sizeof(float);
      count(bytes_out_, (rows ? item.ids.size() * width : low ? item.out16.size() : item.out.size()) * elem);
      WorkerView* wv = r.op == Op::read ? nullptr : &s.workers[r.worker];
      if (wv) {
        wv->pulled_version = s.version;
        wv->pulled_step = s.applied_steps;
        if (compensating && wv->pulled.empty()) {
          wv->pulled.assign(s.data.size(), 0.0f);
          wv->pulled_rows.assign(s.shard.rows(), false);
        }
      }
      if (s.table) s.table->pull(item.ids, item.positions, item.out, r.clock + 1);
      else if (rows && low) s.data.read_rows(item.ids, s.shard.row_begin, item.positions, item.out16);
      else if (rows) s.data.read_rows(item.ids, s.shard.row_begin, item.positions, item.out);
      else if (low) s.data.read(item.out16);
      else s.data.read(item.out);
      if (compensating) remember_pulled(s, item, rows, *wv);
    }
  }

  // Delay compensation: keeps the values the worker just read.
  void remember_pulled(const ShardState& s, const Item& item, bool rows, WorkerView& wv) const {
    if constexpr (Storage::host_visible) {
      const std::span<const float> values = s.data.values();
      const std::size_t width = s.width();
      if (!rows) {
        std::memcpy(wv.pulled.data(), values.data(), values.size() * sizeof(float));
        wv.pulled_rows.assign(s.shard.rows(), true);
        return;
      }
      for (const std::uint64_t id : item.ids) {
        const std::size_t row = id - s.shard.row_begin;
        detail::copy_floats(wv.pulled.data() + row * width, values.data() + row * width, width);
        wv.pulled_rows[row] = true;
      }
    } else {
      (void)s, (void)item, (void)rows, (void)wv;  // refused in make_shard
    }
  }

  bool compensates(const ShardState& s) const {
    if constexpr (detail::has_compensation<SyncStateT>) {
      return sync_.compensates(s.var->meta);
    } else {
      (void)s;
      return false;
    }
  }

  void push(const Request& r) {
    const bool rows = r.op == Op::push_rows;
    // Decide every item first, so a refused request changes nothing.
    std::vector<PushAction> actions;
    actions.reserve(r.items.size());
    for (const Item& item : r.items) {
      ShardState& s = checked(r, item, rows, true);
      if (!s.var->trainable)
        throw frozen_variable("psx: " + where(r) + ": variable '" + s.var->meta.name + "' is not trainable");
      if constexpr (requires { Storage::check_gradient(item.in, std::string()); })
        Storage::check_gradient(item.in, "psx: " + where(r) + ": push to '" + s.var->meta.name + "'");
      if (rows && !accepts_rows<O>())
        throw config_error("psx: " + where(r) + ": push_rows to '" + s.var->meta.name +
                           "': the optimizer does not apply row pushes; push the whole variable");
      const WorkerView& wv = s.workers[r.worker];
      const PushAction a = sync_.on_push(PushInfo{r.worker, r.clock, wv.pulled_version, wv.pulled_step, &s.var->meta},
                                         s.progress(), server_clock());
      if (a.kind == PushAction::Kind::reject)
        throw sync_error("psx: " + where(r) + ": the sync policy refused a push to '" + s.var->meta.name +
                         "' stamped with step " + std::to_string(r.clock) + " (the shard has applied " +
                         std::to_string(s.applied_steps) + " steps)");
      if (a.kind == PushAction::Kind::aggregate && a.step < s.applied_steps)
        throw sync_error("psx: " + where(r) + ": the sync policy aggregated a push to '" + s.var->meta.name +
                         "' into step " + std::to_string(a.step) + ", which the shard has already applied (" +
                         std::to_string(s.applied_steps) + " steps)");
      actions.push_back(a);
    }
    count(pushes_);
    for (std::size_t i = 0; i < r.items.size(); ++i) {
      const Item& item = r.items[i];
      ShardState& s = shard_for(r, item);
      WorkerView& wv = s.workers[r.worker];
      count(bytes_in_, (rows ? item.ids.size() * s.width() : item.in.size()) * sizeof(float));
      switch (actions[i].kind) {
        case PushAction::Kind::apply:
          record_staleness(s.version, wv.pulled_version);
          if (rows && applies_raw_rows && !compensates(s) && !s.table) {
            // The storage sums repeated ids itself (on the device).
            apply_raw_rows(s, item, actions[i].lr_scale, r.clock + 1);
          } else if (rows) {
            scratch_rows(s, item);
            if (compensates(s) && !wv.pulled.empty()) compensate_rows(s, scratch_, wv);
            apply_rows(s, scratch_, actions[i].lr_scale, r.clock + 1);
          } else if (compensates(s) && !wv.pulled.empty()) {
            compensated_.assign(item.in.begin(), item.in.end());
            for (std::size_t row = 0; row < s.shard.rows(); ++row)
              compensate_row(s, compensated_.data() + row * s.width(), row, wv);
            apply_dense(s, compensated_, actions[i].lr_scale, r.clock + 1);
          } else {
            apply_dense(s, item.in, actions[i].lr_scale, r.clock + 1);
          }
          break;
        case PushAction::Kind::drop:
          count(dropped_);
          wv.has_pushed = true;
          wv.pushed_step = wv.pulled_step;
          wv.pushed_since_clock = true;
          break;
        case PushAction::Kind::aggregate: {
          auto& by_worker = s.pending[actions[i].step];
          if (by_worker.empty()) by_worker.resize(clocks_.size());
          detail::Contribution& c = by_worker[r.worker];
          // A worker's gradient for a step is what it pushes between two
          // step() calls: a push from a later interval into a step it is
          // already in (it read before the step was applied, see
          // SyncReplicas) is dropped, never added to the earlier one.
          if (c.present && !c.empty && c.clock != r.clock) {
            count(dropped_);
            wv.pushed_since_clock = true;
            break;
          }
          wv.has_pushed = true;
          wv.pushed_step = actions[i].step;
          wv.pushed_since_clock = true;
          if (!c.present || c.empty) {
            c.present = true;
            c.empty = false;
            c.clock = r.clock;
            c.pulled_version = wv.pulled_version;
            c.rows = detail::RowAccumulator(s.width());
          }
          if (rows) {
            add_rows(s, c, item);
          } else if (c.dense.empty()) {
            c.dense.assign(item.in.begin(), item.in.end());
            if (!c.rows.empty()) scatter_add(s, c.dense, c.rows);  // rows came first: fold them in
            c.rows.clear();
          } else {
            for (std::size_t k = 0; k < c.dense.size(); ++k) c.dense[k] += item.in[k];
          }
          break;
        }
        case PushAction::Kind::reject: break;  // refused above
      }
    }
  }

  // Rewrites gradient row `g` of shard row `row` from what worker `wv` read
  // of it (delay compensation); a row it never read is left as it is.
  void compensate_row(const ShardState& s, float* g, std::size_t row, const WorkerView& wv) const {
    if (!wv.pulled_rows[row]) return;
    const std::size_t width = s.width();
    if constexpr (detail::has_compensation<SyncStateT> && Storage::host_visible)
      sync_.compensate(s.var->meta, std::span<float>(g, width),
                       std::span<const float>(s.data.values().data() + row * width, width),
                       std::span<const float>(wv.pulled.data() + row * width, width));
  }

  void compensate_rows(const ShardState& s, detail::RowAccumulator& rows, const WorkerView& wv) const {
    for (std::size_t k = 0; k < rows.rows().size(); ++k)
      compensate_row(s, rows.data().data() + k * s.width(), rows.rows()[k], wv);
  }

  void add_rows(const ShardState& s, detail::Contribution& c, const Item& item) const {
    const std::size_t width = s.width();
    for (std::size_t j = 0; j < item.ids.size(); ++j) {
      const std::size_t pos = item.positions.empty() ? j : item.positions[j];
      const std::uint64_t row = item.ids[j] - s.shard.row_begin;
      const float* g = item.in.data() + pos * width;
      if (c.dense.empty()) {
        c.rows.add(row, g);
      } else {
        float* dst = c.dense.data() + row * width;
        for (std::size_t k = 0; k < width; ++k) dst[k] += g[k];
      }
    }
  }

  static void scatter_add(const ShardState& s, std::vector<float>& dense, detail::RowAccumulator& rows) {
    const std::size_t width = s.width();
    for (std::size_t k = 0; k < rows.rows().size(); ++k) {
      float* dst = dense.data() + rows.rows()[k] * width;
      const float* src = rows.row_data(k);
      for (std::size_t i = 0; i < width; ++i) dst[i] += src[i];
    }
  }

  void scratch_rows(const ShardState& s, const Item& item) {
    scratch_.reset(s.width());
    const std::size_t width = s.width();
    for (std::size_t j = 0; j < item.ids.size(); ++j) {
      const std::size_t pos = item.positions.empty() ? j : item.positions[j];
      scratch_.add(item.ids[j] - s.shard.row_begin, item.in.data() + pos * width);
    }
  }

  void apply_dense(ShardState& s, std::span<const float> g, double lr_scale, std::uint64_t global_step) {
    s.data.apply(optimizer_, g, UpdateContext{++s.version, lr_scale, &s.var->meta, global_step, false});
  }

  static constexpr bool applies_raw_rows = requires(typename Storage::template shard<O>& d, const O& o, const Item& it) {
    d.apply_raw_rows(o, it.ids, std::size_t{}, it.positions, it.in, UpdateContext{});
  };

  void apply_raw_rows(ShardState& s, const Item& item, double lr_scale, std::uint64_t global_step) {
    if constexpr (applies_raw_rows)
      s.data.apply_raw_rows(optimizer_, item.ids, s.shard.row_begin, item.positions, item.in,
                            UpdateContext{++s.version, lr_scale, &s.var->meta, global_step, true});
    else
      (void)s, (void)item, (void)lr_scale, (void)global_step;
  }

  void apply_rows(ShardState& s, const detail::RowAccumulator& rows, double lr_scale, std::uint64_t global_step) {
    const UpdateContext ctx{++s.version, lr_scale, &s.var->meta, global_step, true};
    if (s.table) s.table->apply(optimizer_, rows, ctx);
    else s.data.apply_rows(optimizer_, rows, ctx);
  }

  StepProgress step_progress(const ShardState& s) const {
    StepProgress p{s.applied_steps, 0, 0, 0};
    auto it = s.pending.find(s.applied_steps);
    if (it == s.pending.end()) return p;
    for (std::size_t w = 0; w < it->second.size(); ++w) {
      if (!it->second[w].present) continue;
      ++p.contributors;
      p.live_contributors += gone_[w] == Gone::no;
      p.finished_contributors += clocks_[w] > s.applied_steps;
    }
    return p;
  }

  // Applies the aggregate of the shard's next step: the contributions summed
  // in worker order, finished by the policy (a mean divides).
  void apply_step(ShardState& s, const StepProgress& step) {
    auto it = s.pending.find(step.step);
    count(steps_);
    if (it == s.pending.end()) return;
    std::vector<detail::Contribution>& by_worker = it->second;
    // Only empty contributions: a step without a gradient, like no push at all.
    if (std::none_of(by_worker.begin(), by_worker.end(), [](const auto& c) { return c.present && !c.empty; })) {
      s.pending.erase(it);
      return;
    }
    bool any_dense = false;
    for (const auto& c : by_worker) {
      any_dense = any_dense || !c.dense.empty();
      if (c.present && !c.empty) record_staleness(s.version, c.pulled_version);
    }
    if (any_dense) {
      // Sum in worker order; a worker that pushed rows only adds them where they are.
      std::vector<float> sum;
      for (auto& c : by_worker) {
        if (!c.present) continue;
        if (sum.empty() && !c.dense.empty()) {
          sum = std::move(c.dense);
        } else if (sum.empty()) {
          sum.assign(s.data.size(), 0.0f);
          scatter_add(s, sum, c.rows);
        } else if (!c.dense.empty()) {
          for (std::size_t k = 0; k < sum.size(); ++k) sum[k] += c.dense[k];
        } else {
          scatter_add(s, sum, c.rows);
        }
      }
      sync_.finish(sum, step, s.progress(), server_clock());
      apply_dense(s, sum, 1.0, step.step + 1);
    } else {
      detail::RowAccumulator sum(s.width());
      for (auto& c : by_worker)
        for (std::size_t k = 0; k < c.rows.rows().size(); ++k) sum.add(c.rows.rows()[k], c.rows.row_data(k));
      sync_.finish(sum.data(), step, s.progress(), server_clock());
      apply_rows(s, sum, 1.0, step.step + 1);
    }
    s.pending.erase(it);
  }

  // A step() that pushed nothing to a shard still counts, as an empty
  // contribution to the first step of that shard the worker is not yet in,
  // for policies that count contributions (SyncReplicas): otherwise a shard
  // that a worker's step skipped would wait for it (with M = N, for ever).
  void count_empty_steps(std::size_t w) {
    if constexpr (detail::counts_empty_steps<SyncStateT> || detail::counts_empty_for<SyncStateT>) {
      if (gone_[w] != Gone::no) return;
      for (auto& per_var : shards_)
        for (auto& sp : per_var) {
          if (!sp) continue;
          ShardState& s = *sp;
          WorkerView& wv = s.workers[w];
          if (std::exchange(wv.pushed_since_clock, false) || !s.var->trainable) continue;
          if (!detail::counts_empty(sync_, s.var->meta)) continue;
          std::uint64_t step = s.applied_steps;
          for (auto it = s.pending.find(step); it != s.pending.end() && it->second[w].present;
               it = s.pending.find(++step)) {
          }
          auto& by_worker = s.pending[step];
          if (by_worker.empty()) by_worker.resize(clocks_.size());
          by_worker[w].present = true;
          by_worker[w].empty = true;
          wv.has_pushed = true;
          wv.pushed_step = step;
        }
    } else {
      (void)w;
    }
  }

  // A pull's or push's step is its clock + 1, counted from 1 (bias
  // corrections divide by 1 - beta^step): the last clock would wrap it to 0.
  void refuse_wrapping_clock(const Request& r) const {
    if (r.clock == std::numeric_limits<std::uint64_t>::max())
      throw wire_error("psx: " + where(r) + ": clock " + std::to_string(r.clock) + ", whose step would wrap to 0");
  }

  void tick_clock(const Request& r) {
    // Clocks only move one step at a time (Worker::step), and a join never
    // goes beyond the furthest clock seen: anything else is a bad request,
    // and trusting it would make the step loop below run for ever.
    if (r.op == Op::clock && r.clock > clocks_[r.worker] + 1)
      throw wire_error("psx: server " + std::to_string(index_) + ": worker " + std::to_string(r.worker) +
                       " jumped from clock " + std::to_string(clocks_[r.worker]) + " to " + std::to_string(r.clock));
    if (r.op == Op::join && r.clock > max_clock_)
      throw wire_error("psx: server " + std::to_string(index_) + ": worker " + std::to_string(r.worker) +
                       " joins at clock " + std::to_string(r.clock) + ", beyond every clock seen (" +
                       std::to_string(max_clock_) + ")");
    if (r.op == Op::leave && gone_[r.worker] == Gone::no) gone_[r.worker] = Gone::left;
    if (r.op == Op::join) gone_[r.worker] = Gone::no;
    if (r.op != Op::leave) clocks_[r.worker] = std::max(clocks_[r.worker], r.clock);
    recount();
    release_barrier();
  }

  // A worker (re)joins. One that was lost (its process died, and a
  // policy that goes on without it let the others train on) comes back at
  // the step of the slowest worker still training, not at the clock it
  // brings (a restarted process starts at 0): its pushes then count for
  // the step the others are at, and a bounded-staleness policy does not
  // hold them back while it catches up. The answer (an item of 2 floats,
  // the bits of a uint64) is the clock this server now counts it at.
  void join(Request& r) {
    if (!r.items.empty() && (r.items.size() != 1 || r.items[0].out.size() != 2))
      throw wire_error("psx: " + where(r) + ": a join carries no item, or one answer of 2 floats");
    const bool was_lost = gone_[r.worker] == Gone::lost;
    tick_clock(r);
    if (was_lost) {
      std::uint64_t others = std::numeric_limits<std::uint64_t>::max();
      for (std::size_t w = 0; w < clocks_.size(); ++w)
        if (w != r.worker && gone_[w] == Gone::no) others = std::min(others, clocks_[w]);
      if (others != std::numeric_limits<std::uint64_t>::max() && others > clocks_[r.worker]) {
        clocks_[r.worker] = others;
        recount();
        release_barrier();
      }
    }
    if (!r.items.empty()) {
      const std::uint64_t at = clocks_[r.worker];
      static_assert(sizeof at == 2 * sizeof(float));
      std::memcpy(r.items[0].out.data(), &at, sizeof at);
    }
  }

  void recount() noexcept {
    std::uint64_t lo = std::numeric_limits<std::uint64_t>::max();
    max_clock_ = 0;
    live_ = 0;
    for (std::size_t w = 0; w < clocks_.size(); ++w) {
      max_clock_ = std::max(max_clock_, clocks_[w]);
      if (gone_[w] != Gone::no) continue;
      ++live_;
      lo = std::min(lo, clocks_[w]);
    }
    // With nobody left training, every clock that was reached is complete.
    min_clock_ = live_ ? lo : max_clock_;
  }

  // A worker failed or went silent: the sync policy decides whether training
  // goes on without it.
  void lose(std::size_t w, const std::string& reason) {
    if (gone_[w] != Gone::no) return;
    if (failed()) {  // the cluster already failed: only remember the worker is gone
      gone_[w] = Gone::lost;
      lost_reason_[w] = reason;
      return;
    }
    const OnWorkerLost outcome = sync_.on_worker_lost(w, server_clock());
    gone_[w] = Gone::lost;
    lost_reason_[w] = reason;
    // A barrier part the lost worker left here would stand in for a live
    // worker (the barrier counts parts): it goes, finished with the loss
    // (or, with no memory to say so, with the bad_alloc: nothing here may
    // throw, the state above being changed already).
    auto lost = [&] {
      return std::make_exception_ptr(
          peer_lost("psx: server " + std::to_string(index_) + ": worker " + std::to_string(w) + " was lost (" + reason + ")"));
    };
    for (const Request& r : barrier_)
      if (r.worker == w) r.finish(error_of(lost));
    std::erase_if(barrier_, [w](const Request& r) { return r.worker == w; });
    recount();
    if (outcome == OnWorkerLost::fail) {
      fail([&] {
        return "psx: server " + std::to_string(index_) + ": worker " + std::to_string(w) + " was lost (" + reason +
               "); the sync policy does not continue without it";
      });
      return;
    }
    release_barrier();
    advance();
  }

  bool failed() const noexcept { return failed_; }

  // Why the server failed; a fixed text when there was no memory to say more.
  std::string failure_text() const {
    return failure_.empty() ? std::string("psx: server ") + std::to_string(index_) +
                                  ": training stopped (no memory was left to say why)"
                            : failure_;
  }

  // The error of a failed server: peer_lost (the policy gave up on a lost
  // worker) or sync_error (a step could not be applied).
  std::exception_ptr failure_error(const std::string& message) const {
    return step_failed_ ? std::make_exception_ptr(sync_error(message)) : std::make_exception_ptr(peer_lost(message));
  }

  // Stops training (the policy gave up on a lost worker, or a step could
  // not be applied): every waiting and later request gets the error. The
  // server counts as failed before anything allocates: where the failure
  // is itself a bad_alloc, building its message may throw too, and a server
  // not marked failed would leave its parked pulls waiting for ever, and
  // retry a step whose gradients are gone. Such a message is left empty
  // (failure_text() has a fixed one).
  template <class Message>
  void fail(Message&& message) noexcept {
    failed_ = true;
    try {
      failure_ = message();
    } catch (...) {
      failure_.clear();
    }
    fail_waiting([&] { return failure_error(failure_text()); });
  }

  // An aggregated step that could not be applied (the policy's finish, the
  // optimizer or the storage threw): its gradients are gone and the shard
  // may be half updated, so the server stops training, as when the policy
  // gives up on a lost worker (the request that completed the step may be a
  // clock(), which no one waits for, and pulls parked for the step would
  // wait for ever).
  void fail_step(const ShardState& s, const StepProgress& step, const char* what) noexcept {
    step_failed_ = true;
    count(errors_);
    fail([&] {
      return "psx: server " + std::to_string(index_) + ": step " + std::to_string(step.step) + " of variable '" +
             s.var->meta.name + "' could not be applied (" + what + ")";
    });
  }

  // One exception object per request: see Completion::wait. Where making
  // one throws (no memory), the request gets that exception instead.
  // `make_error()`, or the exception making it threw (no memory): never throws.
  template <class F>
  static std::exception_ptr error_of(const F& make_error) noexcept {
    try {
      return make_error();
    } catch (...) {
      return std::current_exception();
    }
  }

  void fail_waiting(const ErrorFactory& make_error) noexcept {
    for (Request& r : parked_) r.finish(error_of(make_error));
    for (Request& r : barrier_) r.finish(error_of(make_error));
    parked_.clear();
    barrier_.clear();
  }

  // Finishes the kept pull that `c` names (its worker's Request::call) with
  // an error: its worker let go of the handle. One answered already, or
  // never kept here, is nobody's: nothing to do.
  void cancel(const Request& c) noexcept {
    if (c.call == 0) return;
    const auto it = std::find_if(parked_.begin(), parked_.end(),
                                 [&](const Request& r) { return r.worker == c.worker && r.call == c.call; });
    if (it == parked_.end()) return;
    std::exception_ptr why;
    try {
      why = std::make_exception_ptr(error("psx: server " + std::to_string(index_) + ": worker " +
                                          std::to_string(c.worker) +
                                          "'s pull cancelled: its handle was let go before the answer"));
    } catch (...) {  // no memory for the message: the pull still ends, with bad_alloc
      why = std::current_exception();
    }
    it->finish(std::move(why));
    parked_.erase(it);
  }

  // Applies every step the policy lets through, then retries kept pulls.
  void advance() {
    for (auto& per_var : shards_) {
      for (auto& sp : per_var) {
        if (!sp) continue;
        ShardState& s = *sp;
        for (;;) {
          const StepProgress step = step_progress(s);
          // No step beyond every worker's clock completes without gradients:
          // this bounds the loop whatever the policy answers.
          if (step.contributors == 0 && s.applied_steps >= max_clock_) break;
          if (!sync_.step_complete(step, s.progress(), server_clock())) break;
          try {
            apply_step(s, step);
          } catch (const std::exception& e) {
            fail_step(s, step, e.what());
            return;
          } catch (...) {
            fail_step(s, step, "an exception that is not a std::exception");
            return;
          }
          ++s.applied_steps;
        }
      }
    }
    if (parked_.empty()) return;
    // Each kept pull is answered, kept again, or finished with its own error:
    // whatever happens, every one is accounted for exactly once.
    std::deque<Request> waiting = std::exchange(parked_, {});
    for (Request& r : waiting) {
      try {
        if (may_pull(r)) {
          answer_pull(r);
          r.finish();
        } else {
          parked_.push_back(std::move(r));
        }
      } catch (...) {
        count(errors_);
        r.finish(std::current_exception());
      }
    }
  }

  // Releases the barrier once every live worker is in it; those that asked
  // (Worker::agree_max) get the largest value (`clock`) of its requests.
  void release_barrier() {
    if (barrier_.empty() || barrier_.size() < live_) return;
    std::uint64_t agreed = 0;
    for (const Request& r : barrier_) agreed = std::max(agreed, r.clock);
    for (Request& r : barrier_) {
      if (!r.items.empty()) std::memcpy(r.items[0].out.data(), &agreed, sizeof agreed);
      r.finish();
    }
    barrier_.clear();
  }

  std::size_t index_;
  std::atomic<std::uint64_t> requests_{0}, pulls_{0}, pushes_{0}, bytes_in_{0}, bytes_out_{0}, errors_{0},
      dropped_{0}, steps_{0}, rejected_{0}, undelivered_{0}, retried_{0}, duplicates_{0}, waiting_{0}, waiting_max_{0};
  std::array<std::atomic<std::uint64_t>, staleness_buckets> staleness_{};
  SyncStateT sync_;
  O optimizer_;
  std::uint64_t parameter_bytes_ = 0;  // set in the constructor, read-only after
  std::uint64_t slot_bytes_ = 0;
  std::chrono::milliseconds peer_timeout_;
  std::chrono::milliseconds start_grace_;
  std::vector<std::vector<std::unique_ptr<ShardState>>> shards_;  // [variable][shard]; null where not ours
  std::vector<const DynamicTable<O>*> tables_;  // the dynamic tables among them
  std::vector<std::uint64_t> clocks_;
  std::unique_ptr<StagedRestore> staged_;  // a restore read but not yet applied
  std::unique_ptr<BackgroundSave> background_;  // a save being written, or written and not yet asked about
  std::vector<Gone> gone_;
  std::vector<bool> heard_;  // whether each worker has sent anything yet
  // When each worker was last heard from, on a clock that stops while the
  // server handles a long request (deaf_: the time spent so): what a worker
  // sent meanwhile waits unread, so a long update makes nobody silent.
  std::vector<time_point> last_seen_;
  clock_type::duration deaf_{0};
  std::vector<std::string> lost_reason_;
  time_point last_tick_ = clock_type::now();
  std::uint64_t min_clock_ = 0;
  std::uint64_t max_clock_ = 0;
  std::size_t live_ = 0;
  // Why the server stopped training (a peer_lost message, or a sync_error
  // one when step_failed_); empty while serving (and where no memory was
  // left to write it: failure_text()).
  bool failed_ = false;
  std::string failure_;
  bool step_failed_ = false;
  std::deque<Request> parked_;
  std::vector<Request> barrier_;
  detail::RowAccumulator scratch_;
  std::vector<float> compensated_;
};

}  // namespace v0
}  // namespace psx
