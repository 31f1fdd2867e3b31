//! @file psx/parameter_server.hpp
//! `psx::ParameterServer<P, S, O, T>`: the composition of a partitioner, a
//! sync policy, an optimizer and a transport.
#pragma once

#include <psx/cluster.hpp>
#include <psx/concepts.hpp>
#include <psx/embedding.hpp>
#include <psx/errors.hpp>
#include <psx/optim.hpp>
#include <psx/partition.hpp>
#include <psx/server.hpp>
#include <psx/storage.hpp>
#include <psx/sync.hpp>
#include <psx/transport/inprocess.hpp>
#include <psx/variable.hpp>
#include <psx/worker.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace psx {
inline namespace v0 {

//! A parameter-server cluster composed at compile time.
//!
//! @tparam P a `psx::Partitioner`: where each variable's rows live
//! @tparam S a `psx::SyncPolicy`: when pushes apply and pulls return
//! @tparam O a `psx::Optimizer`: how servers apply gradients
//! @tparam T a `psx::Transport`: how requests travel
//! @tparam Storage where servers keep shards: `psx::storage::Host` (default)
//!         or `psx::cuda::Device` (GPU memory, `psx/cuda/storage.cuh`)
//!
//! Life cycle: `declare` the variables, then `run` the worker function on
//! every worker (or `start` and drive `worker(i)` from threads of your own),
//! then `shutdown` (the destructor does it too). With `transport::InProcess`
//! the servers are threads of this process: the embedded local cluster.
template <class P = partition::HashByName, class S = sync::Synchronous, class O = optim::SGD,
          class T = transport::InProcess, class Storage = storage::Host>
class ParameterServer {
  static_assert(explain_partitioner<P>());
  static_assert(explain_sync_policy<S>());
  static_assert(explain_optimizer<O>());
  static_assert(explain_transport<T>());

 public:
  using partitioner_type = P;
  using sync_policy_type = S;
  using optimizer_type = O;
  using transport_type = T;
  using storage_type = Storage;
  using server_type = Server<S, O, Storage>;

  explicit ParameterServer(ClusterConfig config, P partitioner = {}, S sync = {}, O optimizer = {},
                           T transport = {})
      : partitioner_(std::move(partitioner)),
        sync_(std::move(sync)),
        optimizer_(std::move(optimizer)),
        transport_(std::move(transport)),
        core_(std::make_unique<detail::ClusterCore>()) {
    if (config.num_servers == 0 || config.num_workers == 0)
      throw config_error("psx: a cluster needs at least one server and one worker (got " +
                         std::to_string(config.num_servers) + " servers, " + std::to_string(config.num_workers) +
                         " workers)");
    if (config.peer_timeout == ClusterConfig::transport_default) config.peer_timeout = default_peer_timeout(transport_);
    if (config.peer_timeout.count() < 0 || config.peer_timeout > std::chrono::hours(24 * 366))
      throw config_error("psx: peer_timeout must be between 0 (off) and a year, got " +
                         std::to_string(config.peer_timeout.count()) + " ms");
    core_->config = config;
    core_->clocks.assign(config.num_workers, 0);
    core_->pipelines = std::vector<detail::PushPipeline>(config.num_workers);  // made in place: a deque does not move without throwing
    core_->rejoined.assign(config.num_workers, 0);
    placed_bytes_.assign(config.num_servers, 0);
  }

  ParameterServer(const ParameterServer&) = delete;
  ParameterServer& operator=(const ParameterServer&) = delete;
  ~ParameterServer() { shutdown(); }

  const ClusterConfig& config() const noexcept { return core_->config; }
  const P& partitioner() const noexcept { return partitioner_; }
  const S& sync_policy() const noexcept { return sync_; }
  const O& optimizer() const noexcept { return optimizer_; }

  //! Declares a variable and places it. Only before `start()`/`run()`.
  //! Returns a copy of what was declared (a later declaration may move the
  //! cluster's own). Throws `psx::duplicate_variable`, `psx::shape_error`,
  //! or `psx::config_error` (after start, when the partitioner's placement
  //! does not tile the rows, or when the optimizer refuses the variable,
  //! e.g. LAMB and a split variable).
  VariableInfo declare(VariableSpec spec) {
    if (core_->by_name.contains(spec.name))
      throw duplicate_variable("psx: variable '" + spec.name + "' is already declared (shape " +
                               detail::shape_string(lookup(spec.name, "declare").meta.shape) + "); the second declaration has shape " +
                               detail::shape_string(spec.shape));
    if (started_)
      throw config_error("psx: declare('" + spec.name + "') after the cluster started; declare every variable first");
    VariableInfo info;
    info.meta = detail::make_meta(spec, static_cast<std::uint32_t>(core_->variables.size()));
    info.init = spec.init;
    info.trainable = spec.trainable;
    if (info.meta.kind == VariableKind::dynamic) {
      place_table(info, spec.table);
    } else {
      info.shards = place(info.meta);
      detail::check_placement(info.meta, info.shards, config().num_servers);
    }
    validate_optimizer(optimizer_, info.meta, info.shards.size());
    core_->by_name.emplace(info.meta.name, info.meta.id);
    core_->variables.push_back(std::move(info));
    const VariableInfo& placed = core_->variables.back();
    // What each server holds so far, kept as variables come (placement_report's
    // sum, without a pass over every variable at each declare).
    for (const Shard& sh : placed.shards)
      placed_bytes_[sh.server] += std::uint64_t{sh.rows()} * detail::row_bytes(placed.meta);
    return placed;
  }

  //! The variable declared as `name`; throws `psx::unknown_variable`. The
  //! reference holds until the next `declare` (none once the cluster started).
  const VariableInfo& variable(std::string_view name) const { return lookup(name, "variable"); }
  //! What each server holds of the declared variables (with the
  //! optimizer's slots): print it to see how even the placement is.
  //! Dynamic tables count with the bytes their servers in this process hold now.
  PlacementReport placement() const {
    PlacementReport r = placement_report(core_->variables, config().num_servers, optimizer_.slots());
    std::lock_guard lock(link_mu_);
    for (const VariableInfo& v : core_->variables)
      for (std::size_t s = 0; v.meta.kind == VariableKind::dynamic && s < servers_.size(); ++s)
        if (servers_[s])
          if (const auto* t = servers_[s]->table(v.meta.id)) r.bytes[s] += t->stats().bytes;
    return r;
  }

  //! What each server holds of dynamic table `name` (index = server), read
  //! while training runs, from every server, in this process or another
  //! (asked over the transport: `Worker::table_stats`). Every request this
  //! process sent before the call, such as the last steps of a `run()` that
  //! returned, is applied first (a server handles a process's requests in
  //! order). Throws unknown_variable, config_error for
  //! another kind of variable, before `start()`, or in a process without
  //! workers (call it from a worker process).
  std::vector<TableStats> table_stats(std::string_view name) {
    return inspect_table(name, "table_stats", [&](Worker& w) { return w.table_stats(name); });
  }

  //! The rows of dynamic table `name`: every stored row (`since` empty), or
  //! a delta: the rows changed and the ids removed after `since` (the
  //! `cursor` of the export before it), from every server, in this process
  //! or another, in pages of at most `page_bytes` per server
  //! (`Worker::export_table`). Safe while training runs
  //! (a row changed meanwhile is in this export or the next delta); taken
  //! when the servers are idle, a full export plus its deltas equals a full
  //! export. Throws as `table_stats`, config_error for a cursor of another
  //! number of servers, and checkpoint_error naming the server for a cursor
  //! of another incarnation of its table (it restarted, or restored a
  //! checkpoint), or older than the removals it remembers
  //! (`TableOptions::removal_log_limit`).
  TableExport export_table(std::string_view name, const TableCursor& since = {},
                           std::size_t page_bytes = Worker::table_page_bytes) {
    return inspect_table(name, "export_table", [&](Worker& w) { return w.export_table(name, since, page_bytes); });
  }
  const std::vector<VariableInfo>& variables() const noexcept { return core_->variables; }

  //! Starts the servers: each builds and initializes its shards, then serves
  //! on its own thread. Idempotent; throws `psx::shutdown_error` after shutdown.
  void start() {
    refuse_after_shutdown("start()");
    std::lock_guard start_lock(start_mu_);
    if (started_) return;
    // Build everything first; publish only a cluster whose servers all run,
    // so a failed start (a policy refusing the cluster, no thread to be had)
    // leaves nothing half-started and can be retried or reported again.
    auto link = transport_.connect(TransportContext{config().num_servers, config().num_workers, core_->variables,
                                                    config().peer_timeout});
    // Between processes each runs its own part of the cluster (the link
    // says which); in one process, all of it.
    std::vector<std::unique_ptr<server_type>> servers(config().num_servers);
    for (std::size_t s = 0; s < config().num_servers; ++s)
      if (local_server(*link, s))
        servers[s] = std::make_unique<server_type>(s, config().num_workers, core_->variables, sync_, optimizer_,
                                                   config().peer_timeout, start_grace(*link));
    std::vector<std::thread> threads;
    try {
      for (std::size_t s = 0; s < config().num_servers; ++s)
        if (servers[s]) threads.emplace_back([l = link.get(), server = servers[s].get(), s] { l->serve(s, *server); });
    } catch (...) {
      link->close();
      for (auto& t : threads) t.join();
      throw;
    }
    auto* raw = link.get();
    core_->send = [raw](std::size_t server, Request&& r) { raw->send(server, std::move(r)); };
    using L = typename T::link_type;
    if constexpr (requires(L& l, Completion& c, std::size_t w) { l.await(w, c); })
      core_->await = [raw](std::size_t w, Completion& c) { raw->await(w, c); };
    if constexpr (requires(L& l, std::size_t w) {
                    l.worker_begins(w);
                    l.worker_ends(w);
                  }) {
      core_->worker_begins = [raw](std::size_t w) { raw->worker_begins(w); };
      core_->worker_ends = [raw](std::size_t w) { raw->worker_ends(w); };
    }
    {
      std::lock_guard lock(link_mu_);
      link_ = std::move(link);
      servers_ = std::move(servers);
    }
    {
      std::lock_guard lock(join_mu_);
      threads_ = std::move(threads);
    }
    started_ = true;
    // A shutdown() that ran meanwhile saw no link: close it now.
    if (core_->stopped.load()) shutdown();
  }

  //! Worker `index`'s handle, for callers that run workers on threads of
  //! their own. Starts the cluster; throws `psx::shutdown_error` after
  //! shutdown. The Worker must not outlive the cluster (its Handles may).
  Worker worker(std::size_t index) {
    refuse_after_shutdown("worker()");
    if (index >= config().num_workers)
      throw config_error("psx: worker " + std::to_string(index) + " of a cluster of " +
                         std::to_string(config().num_workers) + " workers");
    start();
    if (!is_local_worker(index))
      throw config_error("psx: worker " + std::to_string(index) + " runs in another process");
    return Worker(*core_, index);
  }

  //! Whether this process runs worker `index` (every worker with an
  //! in-process transport; with one between processes, those of this
  //! process's task). Starts the cluster.
  bool is_local_worker(std::size_t index) {
    start();
    std::lock_guard lock(link_mu_);
    return link_ && local_worker(*link_, index);
  }

  //! The workers this process runs, in index order. Starts the cluster.
  std::vector<std::size_t> local_workers() {
    std::vector<std::size_t> local;
    for (std::size_t w = 0; w < config().num_workers; ++w)
      if (is_local_worker(w)) local.push_back(w);
    return local;
  }

  //! Runs `fn(worker)` for every worker, each on its own thread, and returns
  //! when all have. A worker that returns leaves the cluster (synchronous
  //! steps stop waiting for it). A worker that throws is lost: the sync
  //! policy decides whether the others carry on without it or fail with
  //! `psx::peer_lost` (see `psx::OnWorkerLost`); either way no worker waits
  //! forever (the throwing one's unwinding cancels the pulls it left
  //! unwaited: see Handle), and once all have returned the first exception
  //! is rethrown. Every worker
  //! joins at the start (one that left counts again), and leaves at the end:
  //! `worker(i)` after a `run()` gives a worker that no longer counts for
  //! synchronous steps until the next `run()`.
  template <class F>
    requires std::invocable<F&, Worker&>
  void run(F&& fn) {
    refuse_after_shutdown("run()");
    const std::vector<std::size_t> local = local_workers();
    if (local.empty()) {
      // A server process: serve until the cluster is done (without holding
      // the lock, so that shutdown() can close the link meanwhile).
      auto* link = [&] {
        std::lock_guard lock(link_mu_);
        return link_.get();
      }();
      if constexpr (requires { link->wait_stopped(); })
        if (const std::string why = link->wait_stopped(); !why.empty()) throw peer_lost(why);
      // A server whose training failed (the sync policy gave up on a lost
      // worker) ends with that error, not as if training had finished: a
      // supervisor then restarts it with the rest of the job.
      // (Only once the link's loop has ended by itself: after a shutdown from
      // another thread it may still be serving.)
      if constexpr (requires { link->served(); })
        if (link->served())
          for (const auto& server : servers_)
            if (server)
              if (std::exception_ptr e = server->failure()) std::rethrow_exception(e);
      return;
    }
    {
      // Every worker counts again for the sync policy before any of them
      // starts, at the clock of the furthest one: a second run continues
      // from the last step of the first, whatever each worker did then.
      const std::uint64_t clock = *std::max_element(core_->clocks.begin(), core_->clocks.end());
      const std::size_t servers = config().num_servers;
      auto joined = std::make_shared<Completion>(servers * local.size());
      // Each server answers the clock it counts the worker at: further than
      // `clock` for a worker it had lost (a restarted process joining a
      // job that went on without it), which resumes at the slowest server's.
      std::vector<std::array<float, 2>> at(servers * local.size());
      std::size_t sent = 0;
      try {
        for (std::size_t k = 0; k < local.size(); ++k) {
          const std::size_t w = local[k];
          core_->clocks[w] = clock;
          for (std::size_t s = 0; s < servers; ++s) {
            Request r;
            r.op = Op::join;
            r.worker = static_cast<std::uint32_t>(w);
            r.clock = clock;
            Item answer;
            answer.out = at[k * servers + s];
            r.items.push_back(answer);
            r.done = joined;
            core_->send(s, std::move(r));
            ++sent;
          }
        }
      } catch (...) {  // the joins not sent fail; the wait below ends once the servers answered the others into `at`
        const std::exception_ptr error = std::current_exception();
        for (; sent < at.size(); ++sent) joined->finish(error);
      }
      core_->wait(config().num_workers, *joined);
      for (std::size_t k = 0; k < local.size(); ++k) {
        std::uint64_t resume = std::numeric_limits<std::uint64_t>::max();
        for (std::size_t s = 0; s < servers; ++s) {
          std::uint64_t v;
          std::memcpy(&v, at[k * servers + s].data(), sizeof v);
          resume = std::min(resume, v);
        }
        core_->rejoined[local[k]] = resume > clock;
        if (resume > clock) core_->clocks[local[k]] = resume;
      }
    }
    if (core_->worker_begins)
      for (std::size_t w : local) core_->worker_begins(w);
    std::exception_ptr first;
    std::mutex mu;
    std::vector<std::thread> workers;
    std::size_t started = 0;
    const std::string no_thread = "no thread could be started for it";  // made here: the handler below allocates nothing
    try {
      workers.reserve(local.size());
      for (; started < local.size(); ++started) {
        const std::size_t w = local[started];
        workers.emplace_back([&, w] {
          Worker worker(*core_, w);
          detail::running_worker = {core_.get(), w};
          try {
            fn(worker);
            worker.flush();  // pipelined pushes: their errors are the function's
            detail::announce(*core_, w, Op::leave);
          } catch (...) {
            auto error = std::current_exception();
            {
              std::lock_guard lock(mu);
              if (!first) first = error;
            }
            std::string reason = "its function threw a non-standard exception";
            try {
              std::rethrow_exception(error);
            } catch (const std::exception& e) {
              reason = std::string("its function threw: ") + e.what();
            } catch (...) {
            }
            detail::announce(*core_, w, Op::fail, reason);
          }
          core_->pipelines[w].entries.clear();  // after a throw: each handle waits for its call
          if (core_->worker_ends) core_->worker_ends(w);
        });
      }
    } catch (...) {
      // No thread (or no memory) for a worker: those not started fail as a
      // worker that threw does (the sync policy decides for the others) and
      // end (a simulated cluster waits for a worker that began), the started
      // ones are joined, and the error is rethrown.
      for (std::size_t k = started; k < local.size(); ++k) {
        detail::announce(*core_, local[k], Op::fail, no_thread);
        try {
          if (core_->worker_ends) core_->worker_ends(local[k]);
        } catch (...) {  // the link is closing: nobody waits for it
        }
      }
      for (auto& t : workers) t.join();
      throw;
    }
    for (auto& t : workers) t.join();
    if (first) std::rethrow_exception(first);
  }

  //! Counters of server `index` (zeros before `start()`); config_error for
  //! a server of another process.
  ServerStats server_stats(std::size_t index) const {
    if (index >= config().num_servers)
      throw config_error("psx: server " + std::to_string(index) + " of a cluster of " +
                         std::to_string(config().num_servers) + " servers");
    std::lock_guard lock(link_mu_);
    if (index >= servers_.size()) return ServerStats{};
    if (!servers_[index]) throw config_error("psx: server " + std::to_string(index) + " runs in another process");
    return servers_[index]->stats();
  }

  //! The counters of every server of this process added up.
  ServerStats stats() const {
    ServerStats total;
    total.staleness.assign(staleness_buckets, 0);
    std::vector<ServerStats> each;
    {
      std::lock_guard lock(link_mu_);
      for (const auto& server : servers_)
        if (server) each.push_back(server->stats());
    }
    for (const ServerStats& one : each) total += one;
    return total;
  }

  //! The current value of variable `name`, read from its servers without
  //! waiting for the sync policy: between runs, from a worker's function,
  //! or from a thread of your own watching a run (in a simulated cluster,
  //! such a thread's read leaves at the simulated time of the first local
  //! worker, and the thread runs events while it waits, as a worker would).
  std::vector<float> read(std::string_view name) {
    refuse_after_shutdown("read()");
    start();
    const VariableInfo& v = lookup(name, "read");
    std::vector<float> out(v.meta.size());
    const PullItem item{name, out};
    const std::vector<std::size_t> local = local_workers();
    if (local.empty())
      throw config_error("psx: read('" + v.meta.name + "') in a process without workers; read from a worker");
    const bool own = detail::running_worker.core == core_.get();  // the thread of a worker of this cluster
    Worker reader(*core_, own ? detail::running_worker.index : local.front());
    if (!own) reader.waits_as_ = config().num_workers;
    reader.read_async(std::span<const PullItem>(&item, 1)).wait();
    return out;
  }

  //! Stops the servers and joins their threads. Requests in flight and calls
  //! made later fail with `psx::shutdown_error`. Safe from any thread, any
  //! number of times; never waits on a worker.
  void shutdown() noexcept {
    shutdown_link();
    std::lock_guard lock(join_mu_);
    for (auto& t : threads_)
      if (t.joinable() && t.get_id() != std::this_thread::get_id()) t.join();
  }

  //! True between `start()` and `shutdown()`.
  bool running() const noexcept { return started_ && !core_->stopped.load(); }

 private:
  // Variable `name`, or unknown_variable naming the call ("ParameterServer::read").
  const VariableInfo& lookup(std::string_view name, const char* verb) const {
    if (const VariableInfo* v = core_->try_find(name)) return *v;
    core_->unknown(name, std::string("ParameterServer::") + verb);
  }

  template <class L>
  static bool local_server(const L& link, std::size_t s) noexcept {
    if constexpr (requires { { link.local_server(s) } -> std::same_as<bool>; })
      return link.local_server(s);
    else
      return true;
  }
  // The partitioner's placement of `meta`; one that balances load (a
  // `place(meta, num_servers, server_bytes)`) is told what each server
  // holds of the variables declared before.
  std::vector<Shard> place(const VariableMeta& meta) const {
    const std::size_t n = config().num_servers;
    if constexpr (requires(std::span<const std::uint64_t> b) {
                    { partitioner_.place(meta, n, b) } -> std::same_as<std::vector<Shard>>;
                  }) {
      return partitioner_.place(meta, n, placed_bytes_);
    } else {
      return partitioner_.place(meta, n);
    }
  }
  // What `ClusterConfig::transport_default` means for transport `t`: its
  // `default_peer_timeout` where it has one (between processes), else off.
  static std::chrono::milliseconds default_peer_timeout(const T& t) noexcept {
    if constexpr (requires { { t.default_peer_timeout } -> std::convertible_to<std::chrono::milliseconds>; })
      return t.default_peer_timeout;
    else
      return std::chrono::milliseconds(0);
  }
  // How long a worker not yet heard from may stay silent (processes that
  // start in any order); links within one process start every worker at once.
  template <class L>
  static std::chrono::milliseconds start_grace(const L& link) noexcept {
    if constexpr (requires { { link.start_grace() } -> std::same_as<std::chrono::milliseconds>; })
      return link.start_grace();
    else
      return {};
  }
  template <class L>
  static bool local_worker(const L& link, std::size_t w) noexcept {
    if constexpr (requires { { link.local_worker(w) } -> std::same_as<bool>; })
      return link.local_worker(w);
    else
      return true;
  }

  // A dynamic table: shard k on server k, ids by a consistent-hash ring.
  void place_table(VariableInfo& info, const TableOptions& options) const {
    const std::size_t n = config().num_servers;
    if (!accepts_rows<O>())
      throw config_error("psx: dynamic table '" + info.meta.name + "': the optimizer does not apply row pushes");
    detail::check_table_cap(info.meta.name, info.meta.row_width, optimizer_.slots(), options);  // at declare, not start
    info.table = options;
    info.ring = detail::HashRing(n, options.virtual_nodes);
    for (std::size_t k = 0; k < n; ++k) info.shards.push_back({k, 0, 0});
  }

  // shutdown_error naming the call the user made (which starts the cluster).
  void refuse_after_shutdown(const char* call) const {
    if (core_->stopped.load()) throw shutdown_error(std::string("psx: ") + call + " after shutdown()");
  }

  // Calls `fn(worker)` for dynamic table `name` with a worker of this
  // process that asks the servers (ParameterServer::read's way: the
  // calling thread's own worker in a run, else the first local worker,
  // waited for as no worker).
  template <class F>
  auto inspect_table(std::string_view name, const char* verb, F&& fn) {
    const VariableInfo& v = lookup(name, verb);
    if (v.meta.kind != VariableKind::dynamic)
      throw config_error(std::string("psx: ") + verb + "('" + v.meta.name + "'): a " +
                         (v.meta.kind == VariableKind::dense ? "dense" : "sparse") + " variable, not a dynamic table");
    if (!started_) throw config_error(std::string("psx: ") + verb + "('" + v.meta.name + "') before start()");
    if (core_->stopped.load()) throw shutdown_error(std::string("psx: ") + verb + "() after shutdown()");
    const std::vector<std::size_t> local = local_workers();
    if (local.empty())
      throw config_error(std::string("psx: ") + verb + "('" + v.meta.name +
                         "') in a process without workers; call it from a worker process");
    const bool own = detail::running_worker.core == core_.get();
    Worker reader(*core_, own ? detail::running_worker.index : local.front());
    if (!own) reader.waits_as_ = config().num_workers;
    return fn(reader);
  }

  void shutdown_link() noexcept {
    core_->stopped.store(true, std::memory_order_release);
    std::lock_guard lock(link_mu_);
    if (link_) link_->close();
  }

  P partitioner_;
  S sync_;
  O optimizer_;
  T transport_;
  std::unique_ptr<detail::ClusterCore> core_;
  // Per server, the bytes of the shards declared so far (LeastLoaded's input).
  std::vector<std::uint64_t> placed_bytes_;
  std::atomic<bool> started_{false};
  std::mutex start_mu_;
  mutable std::mutex link_mu_;  // guards link_ and servers_
  std::mutex join_mu_;          // guards threads_
  std::unique_ptr<typename T::link_type> link_;
  std::vector<std::unique_ptr<server_type>> servers_;
  std::vector<std::thread> threads_;
};

//! The embedded default: servers and workers as threads of this process.
template <class P = partition::HashByName, class S = sync::Synchronous, class O = optim::SGD>
using LocalCluster = ParameterServer<P, S, O, transport::InProcess>;

}  // namespace v0
}  // namespace psx
