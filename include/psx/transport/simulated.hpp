//! @file psx/transport/simulated.hpp
//! The in-process cluster under a model of the network and of compute time,
//! in simulated (discrete-event) time: 64 to 256 workers on one machine, with
//! results that do not depend on this machine's load.
//!
//! Servers and workers run the real code (the server's sync policy and
//! optimizer, the worker's function) on threads of this process, as with
//! `transport::InProcess`; what is simulated is *when* things happen. Every
//! message becomes a chain of events on one clock: it leaves its sender's
//! network link (bandwidth, one message after another), crosses the network
//! (latency), queues at the receiver's link (bandwidth), and then the server
//! handles it or the worker's call completes. A worker's compute time is not
//! measured but drawn from `ComputeModel` and charged before the first
//! gradient push of each step.
//!
//! Determinism: events run in the order of their simulated time, ties broken
//! by sender and by the sender's own message count; an event runs only when
//! no worker still computing could send anything earlier. So the same model,
//! seed and worker function give the same parameters, the same simulated
//! times and the same counters in every run. That holds for workers driven
//! by `ParameterServer::run` (the link then knows which workers are
//! computing); threads of your own calling `ParameterServer::worker(i)` work,
//! but their timing is not reproducible.
//!
//! A simulated cluster in which every worker waits and no message is in
//! flight can never move again (a sync policy that waits for a gradient that
//! will not come): every waiting call fails with `psx::sync_error` naming the
//! simulated time, instead of hanging.
#pragma once

#include <psx/concepts.hpp>
#include <psx/detail/hash.hpp>
#include <psx/errors.hpp>
#include <psx/message.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <numbers>
#include <ostream>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {
namespace transport {

//! The network: every node (worker or server) has one full-duplex link of
//! `bandwidth` bytes/s each way; a message of b bytes occupies its sender's
//! link for b / bandwidth, travels for `latency`, then occupies the
//! receiver's link for b / bandwidth (queued behind whatever arrived first).
struct NetworkModel {
  double latency = 50e-6;      //!< one-way seconds per message
  double bandwidth = 1.25e9;   //!< bytes/s of each node's link, each way (10 Gbit/s); 0 = unlimited
  std::size_t header_bytes = 64;  //!< added to every message's payload (ids, floats, text)

  friend bool operator==(const NetworkModel&, const NetworkModel&) = default;
  friend std::ostream& operator<<(std::ostream& os, const NetworkModel& n) {
    return os << "latency " << n.latency * 1e6 << " us, bandwidth " << n.bandwidth / 1e9 << " GB/s, header "
              << n.header_bytes << " B";
  }
};

//! A worker's compute time per step:
//! `step_seconds`, times a lognormal factor of mean 1 and log-standard
//! deviation `jitter`, times `slow_factor` for the last `slow_workers`
//! workers (persistent stragglers), times `straggler_slowdown` with
//! probability `straggler_probability` per worker and step (transient
//! stragglers). Draws depend only on (seed, worker, step).
struct ComputeModel {
  double step_seconds = 1e-3;
  double jitter = 0.0;
  double straggler_probability = 0.0;
  double straggler_slowdown = 1.0;
  std::size_t slow_workers = 0;
  double slow_factor = 1.0;

  friend bool operator==(const ComputeModel&, const ComputeModel&) = default;
  friend std::ostream& operator<<(std::ostream& os, const ComputeModel& c) {
    os << "step " << c.step_seconds * 1e3 << " ms";
    if (c.jitter > 0) os << ", jitter " << c.jitter;
    if (c.straggler_probability > 0)
      os << ", stragglers p " << c.straggler_probability << " x" << c.straggler_slowdown;
    if (c.slow_workers > 0) os << ", " << c.slow_workers << " slow workers x" << c.slow_factor;
    return os;
  }
};

//! What one worker did in simulated time.
struct SimulatedWorker {
  double time = 0;     //!< the worker's own clock: when it last woke, plus compute charged since
  double compute = 0;  //!< seconds of compute charged (ComputeModel)
  double waiting = 0;  //!< seconds spent waiting for answers (network, servers, sync policy)
  std::uint64_t steps = 0;  //!< steps whose compute was charged
};

//! The clock and counters of a simulation, shared by every copy of the
//! `Simulated` value that made it; read them from any thread, during or
//! after a run.
class Timeline {
 public:
  //! Simulated seconds: the time of the latest event handled.
  double now() const {
    std::lock_guard lock(mu_);
    return now_;
  }
  //! Worker `w`'s clock (simulated seconds); for a worker calling it on its
  //! own thread, the moment its last call returned plus compute charged since.
  double worker_time(std::size_t w) const { return worker(w).time; }
  SimulatedWorker worker(std::size_t w) const {
    std::lock_guard lock(mu_);
    if (w >= workers_.size())
      throw config_error("psx: Timeline::worker(" + std::to_string(w) + ") of " + std::to_string(workers_.size()) +
                         " simulated workers");
    return workers_[w];
  }
  std::size_t num_workers() const {
    std::lock_guard lock(mu_);
    return workers_.size();
  }
  std::uint64_t events() const {
    std::lock_guard lock(mu_);
    return events_;
  }
  std::uint64_t messages() const {
    std::lock_guard lock(mu_);
    return messages_;
  }
  //! Bytes sent over the simulated network (payloads plus headers).
  std::uint64_t bytes() const {
    std::lock_guard lock(mu_);
    return bytes_;
  }

 private:
  friend struct Simulated;
  mutable std::mutex mu_;
  double now_ = 0;
  std::vector<SimulatedWorker> workers_;
  std::uint64_t events_ = 0, messages_ = 0, bytes_ = 0;
  bool in_use_ = false;
};

//! A simulated cluster (see the file comment). Settings are plain values;
//! `timeline` is where a run's simulated clock can be read.
//!
//! @code
//! psx::transport::Simulated sim{.network = {.latency = 100e-6, .bandwidth = 1.25e9},
//!                               .compute = {.step_seconds = 5e-3, .straggler_probability = 0.05,
//!                                           .straggler_slowdown = 4},
//!                               .seed = 7};
//! psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous, psx::optim::SGD,
//!                      psx::transport::Simulated> ps({.num_servers = 4, .num_workers = 64}, {}, {}, {}, sim);
//! ps.run(train);
//! double seconds = sim.timeline->now();
//! @endcode
struct Simulated {
  NetworkModel network{};
  ComputeModel compute{};
  //! Bytes per second a server handles (gradients applied, parameters
  //! copied out); 0: servers take no simulated time.
  double server_bandwidth = 0;
  //! Seeds the compute model's draws.
  std::uint64_t seed = 0;
  //! Shared by copies of this value: the simulated clock of the cluster
  //! this value (or a copy) connected last.
  std::shared_ptr<Timeline> timeline = std::make_shared<Timeline>();

  //! Worker `w`'s compute seconds for step `step` under this model.
  double compute_seconds(std::size_t w, std::uint64_t step, std::size_t num_workers) const noexcept {
    const ComputeModel& c = compute;
    // Draw k is the k-th output of a splitmix64 stream seeded by (seed, w, step).
    const std::uint64_t state = seed ^ (0x9e3779b97f4a7c15ull * (w + 1)) ^ (0xc2b2ae3d27d4eb4full * (step + 1));
    auto uniform = [&](std::uint64_t k) {  // 53 bits: in [0, 1)
      return static_cast<double>(detail::mix64(state + k * 0x9e3779b97f4a7c15ull) >> 11) * 0x1.0p-53;
    };
    double t = c.step_seconds;
    const double u1 = uniform(0), u2 = uniform(1), u3 = uniform(2);
    if (c.jitter > 0) {
      const double z = std::sqrt(-2.0 * std::log1p(-u1)) * std::cos(2 * std::numbers::pi * u2);
      t *= std::exp(c.jitter * z - 0.5 * c.jitter * c.jitter);
    }
    if (c.slow_workers > 0 && w + c.slow_workers >= num_workers) t *= c.slow_factor;
    if (u3 < c.straggler_probability) t *= c.straggler_slowdown;
    return t;
  }

  class link_type;
  std::unique_ptr<link_type> connect(const TransportContext& ctx) const;

  friend bool operator==(const Simulated& a, const Simulated& b) {
    return a.network == b.network && a.compute == b.compute && a.server_bandwidth == b.server_bandwidth &&
           a.seed == b.seed;
  }
  friend std::ostream& operator<<(std::ostream& os, const Simulated& s) {
    os << "Simulated(" << s.network << "; " << s.compute;
    if (s.server_bandwidth > 0) os << "; server " << s.server_bandwidth / 1e9 << " GB/s";
    return os << "; seed " << s.seed << ")";
  }

 private:
  static void bind(Timeline& t, std::size_t workers) {
    std::lock_guard lock(t.mu_);
    if (t.in_use_)
      throw config_error("psx: this transport::Simulated value (or a copy) already drives a running cluster; "
                         "give each cluster its own Simulated value");
    t.in_use_ = true;
    t.now_ = 0;
    t.workers_.assign(workers, SimulatedWorker{});
    t.events_ = t.messages_ = t.bytes_ = 0;
  }
  static void unbind(Timeline& t) noexcept {
    std::lock_guard lock(t.mu_);
    t.in_use_ = false;
  }
  template <class F>
  static void update(Timeline& t, F&& f) {
    std::lock_guard lock(t.mu_);
    f(t.now_, t.workers_, t.events_, t.messages_, t.bytes_);
  }
  friend class link_type;
};

//! The simulated cluster of one ParameterServer.
class Simulated::link_type {
 public:
  link_type(const Simulated& model, const TransportContext& ctx)
      : model_(model),
        num_servers_(ctx.num_servers),
        num_workers_(ctx.num_workers),
        nodes_(ctx.num_servers + ctx.num_workers),
        workers_(ctx.num_workers),
        handlers_(ctx.num_servers, nullptr),
        server_busy_(ctx.num_servers, 0.0) {
    if (ctx.peer_timeout.count() > 0)
      throw config_error("psx: transport::Simulated has no lost peers to detect; set peer_timeout to 0 (got " +
                         std::to_string(ctx.peer_timeout.count()) + " ms)");
    auto check = [](double v, const char* what) {
      if (!(v >= 0) || !std::isfinite(v))
        throw config_error(std::string("psx: transport::Simulated: ") + what + " must be finite and >= 0");
    };
    check(model.network.latency, "network.latency");
    check(model.network.bandwidth, "network.bandwidth");
    check(model.server_bandwidth, "server_bandwidth");
    check(model.compute.step_seconds, "compute.step_seconds");
    check(model.compute.jitter, "compute.jitter");
    check(model.compute.straggler_slowdown, "compute.straggler_slowdown");
    check(model.compute.slow_factor, "compute.slow_factor");
    if (!(model.compute.straggler_probability >= 0 && model.compute.straggler_probability <= 1))
      throw config_error("psx: transport::Simulated: compute.straggler_probability must be in [0, 1]");
    Simulated::bind(*model_.timeline, num_workers_);
  }
  link_type(const link_type&) = delete;
  link_type& operator=(const link_type&) = delete;
  ~link_type() {
    close();
    Simulated::unbind(*model_.timeline);
  }

  //! Schedules `r` to leave its worker at the worker's simulated time.
  void send(std::size_t server, Request&& r) {
    std::unique_lock lock(mu_);
    if (closed_) throw shutdown_error("psx: server " + std::to_string(server) + " is shut down");
    if (server >= num_servers_)
      throw config_error("psx: request for server " + std::to_string(server) + " of " + std::to_string(num_servers_));
    if (r.worker >= num_workers_)
      throw config_error("psx: request from worker " + std::to_string(r.worker) + " of " +
                         std::to_string(num_workers_));
    // A worker whose function in `run` ended still names requests made on
    // its behalf afterwards (ParameterServer::read): they leave now and do
    // not move its clock.
    WorkerState& ws = workers_[r.worker];
    const bool own = ws.state != State::ended;
    double t = ws.state == State::computing ? ws.time : std::max(ws.time, now_);
    if (own && (r.op == Op::push || r.op == Op::push_rows) && ws.charged != r.clock) {
      const double c = model_.compute_seconds(r.worker, r.clock, num_workers_);
      t += c;
      ws.charged = r.clock;
      ws.compute += c;
      ++ws.steps;
    }
    if (own) ws.time = t;
    const std::uint32_t w = r.worker;
    Event e;
    e.kind = Kind::to_server;
    e.dst = static_cast<std::uint32_t>(server);
    e.bytes = request_bytes(r);
    e.request = std::move(r);
    transfer(worker_node(w), std::move(e), t);
    if (own) publish_worker(w);
    // A sender that is not a computing worker may be the only one who can
    // let the waiters go on.
    if (computing_ == 0) call_one();
  }

  //! Registers server `server`'s handler, waits for `close()`, then drains it.
  void serve(std::size_t server, RequestHandler& handler) {
    {
      std::unique_lock lock(mu_);
      handlers_.at(server) = &handler;
      ++registered_;
      call_all();
      closed_cv_.wait(lock, [&] { return closed_; });
    }
    const std::string why = "psx: server " + std::to_string(server) + " shut down before answering";
    handler.drain([&] { return std::make_exception_ptr(shutdown_error(why)); });
    std::lock_guard lock(mu_);
    handlers_[server] = nullptr;
  }

  //! Fails every message in flight and stops the servers' loops.
  void close() noexcept {
    std::vector<Event> left;
    {
      std::lock_guard lock(mu_);
      if (closed_) return;
      closed_ = true;
      left = std::move(events_);
      events_.clear();
    }
    for (Event& e : left) {
      auto error = std::make_exception_ptr(shutdown_error("psx: the simulated cluster shut down with the message in flight"));
      if (e.kind == Kind::to_server || e.kind == Kind::deliver)
        e.request.finish(error);
      else if (e.original)
        e.original->finish(e.error ? e.error : error);
    }
    std::lock_guard lock(mu_);
    call_all();
    closed_cv_.notify_all();
  }

  // -- hooks the ParameterServer calls (optional Link members) --------------

  //! Worker `w` starts running (`ParameterServer::run`): until it waits or
  //! ends, no event later than its clock runs.
  void worker_begins(std::size_t w) {
    std::lock_guard lock(mu_);
    WorkerState& ws = workers_.at(w);
    if (ws.state == State::computing) return;
    if (ws.state == State::ended) --ended_;
    ws.time = std::max(ws.time, now_);
    computes(ws);
    publish_worker(w);
  }

  //! Worker `w`'s function returned or threw (after it announced so).
  void worker_ends(std::size_t w) noexcept {
    std::lock_guard lock(mu_);
    WorkerState& ws = workers_[w];
    if (ws.state == State::computing) --computing_;
    if (ws.state != State::ended) ++ended_;
    ws.state = State::ended;
    call_one();
  }

  //! Waits for `done` while running the simulation: the calling thread (a
  //! worker `w`, or any thread with `w >= num_workers`) handles events
  //! whenever no worker computes. Returns when `done` is ready; throws
  //! `psx::sync_error` when the simulation can never get there.
  void await(std::size_t w, Completion& done) {
    std::unique_lock lock(mu_);
    WorkerState* ws = w < num_workers_ && workers_[w].state == State::computing ? &workers_[w] : nullptr;
    if (ws) {
      ws->state = State::waiting;
      --computing_;
      ++waiting_;
    }
    Waiter me{ws};
    waiters_.emplace(&done, &me);
    std::exception_ptr error;
    try {
      while (!done.ready() && !me.woken) {
        if (stuck_) {
          error = std::make_exception_ptr(sync_error(stuck_message_));
          break;
        }
        if (!closed_ && registered_ == num_servers_ && !events_.empty() && may_run(events_.front())) {
          run_one();
          continue;
        }
        // Stuck for good: every worker of the run waits (or has ended) and
        // nothing is in flight. (Workers driven by threads the link does not
        // know of may still send: no verdict then.)
        if (!closed_ && registered_ == num_servers_ && events_.empty() && computing_ == 0 && waiting_ > 0 &&
            waiting_ + ended_ == num_workers_) {
          stuck_ = true;
          stuck_message_ = describe_stuck();
          call_all();
          continue;
        }
        me.cv.wait(lock);
      }
    } catch (...) {
      // An event that threw (no memory): this waiter goes as it would have
      // returned (`me` lives on this stack: close() would wake it later).
      error = std::current_exception();
    }
    waiters_.erase(&done);
    if (!events_.empty()) call_one();  // someone else may run them meanwhile
    if (ws) {
      // The answer may have come while the worker still computed.
      if (auto it = ready_at_.find(&done); it != ready_at_.end()) {
        ws->time = std::max(ws->time, it->second.second);
        ready_at_.erase(it);
      }
      if (ws->state == State::waiting) {
        --waiting_;
        computes(*ws);
      }
      publish_worker(w);
    } else {
      ready_at_.erase(&done);
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  // idle: not (yet) in a run; ended: its function in `run` returned.
  enum class State : std::uint8_t { idle, computing, waiting, ended };
  enum class Kind : std::uint8_t { to_server, deliver, to_worker, answer };

  struct WorkerState {
    State state = State::idle;
    double time = 0;
    double compute = 0;
    double waiting = 0;
    std::uint64_t steps = 0;
    std::uint64_t charged = std::numeric_limits<std::uint64_t>::max();
  };
  struct Node {
    double egress_free = 0;
    double ingress_free = 0;
    std::uint64_t sent = 0;
  };
  struct Event {
    double time = 0;
    std::uint32_t src = 0;  // node that sent the message
    std::uint64_t seq = 0;  // the sender's message count
    Kind kind = Kind::to_server;
    std::uint32_t dst = 0;  // server (to_server, deliver) or worker (to_worker, answer)
    std::size_t bytes = 0;
    Request request;                        // to_server, deliver
    std::shared_ptr<Completion> original;   // to_worker, answer: the worker's call
    std::exception_ptr error;               // to_worker, answer
  };
  struct Later {  // heap order: the earliest event at the front
    bool operator()(const Event& a, const Event& b) const noexcept {
      if (a.time != b.time) return a.time > b.time;
      if (a.src != b.src) return a.src > b.src;
      return a.seq > b.seq;
    }
  };
  struct Waiter {
    explicit Waiter(WorkerState* w) noexcept : worker(w) {}
    WorkerState* worker;  // null: not a computing worker when it began to wait
    bool woken = false;
    std::condition_variable cv;
  };

  std::uint32_t worker_node(std::uint32_t w) const noexcept { return w; }
  std::uint32_t server_node(std::size_t s) const noexcept { return static_cast<std::uint32_t>(num_workers_ + s); }

  double wire_seconds(std::size_t bytes) const noexcept {
    return model_.network.bandwidth > 0 ? static_cast<double>(bytes) / model_.network.bandwidth : 0.0;
  }

  std::size_t request_bytes(const Request& r) const noexcept {
    std::size_t b = model_.network.header_bytes + r.reason.size();
    for (const Item& it : r.items) b += 16 + it.ids.size() * sizeof(std::uint64_t) + it.in.size() * sizeof(float);
    return b;
  }
  std::size_t answer_bytes(const Request& r) const noexcept {
    std::size_t b = model_.network.header_bytes;
    for (const Item& it : r.items) b += it.out.size() * sizeof(float) + it.out16.size() * sizeof(std::uint16_t);
    return b;
  }

  // `e` leaves node `src` at `t`: it waits for the sender's link, takes
  // bytes / bandwidth on it, and reaches the receiver `latency` later.
  void transfer(std::uint32_t src, Event&& e, double t) {
    Node& n = nodes_[src];
    const double start = std::max(t, n.egress_free);
    n.egress_free = start + wire_seconds(e.bytes);
    e.time = n.egress_free + model_.network.latency;
    e.src = src;
    e.seq = n.sent++;
    Simulated::update(*model_.timeline, [&](double&, auto&, auto&, std::uint64_t& messages, std::uint64_t& bytes) {
      ++messages;
      bytes += e.bytes;
    });
    push(std::move(e));
  }

  // A message of `bytes` that reached `node` now is through its link at the
  // returned time (after whatever arrived before it).
  double received(std::uint32_t node, std::size_t bytes) noexcept {
    Node& n = nodes_[node];
    n.ingress_free = std::max(now_, n.ingress_free) + wire_seconds(bytes);
    return n.ingress_free;
  }

  // Server `s` handles `bytes` of payload from `t` on (after what it was
  // busy with); returns when it is done. Free without server_bandwidth.
  double server_works(std::size_t s, double t, std::size_t bytes) noexcept {
    if (model_.server_bandwidth <= 0) return t;
    server_busy_[s] = std::max(t, server_busy_[s]) + static_cast<double>(bytes) / model_.server_bandwidth;
    return server_busy_[s];
  }

  void push(Event&& e) {
    events_.push_back(std::move(e));
    std::push_heap(events_.begin(), events_.end(), Later{});
  }

  // An event may run when no computing worker can still send one before it:
  // a worker's next message leaves at its clock or later and arrives
  // `latency` after that. `horizon_` is a lower bound of the computing
  // workers' clocks (they only grow while computing), looked at again only
  // when it is in the way.
  bool may_run(const Event& e) noexcept {
    if (computing_ == 0 || e.time < horizon_ + model_.network.latency) return true;
    horizon_ = std::numeric_limits<double>::infinity();
    for (const WorkerState& ws : workers_)
      if (ws.state == State::computing) horizon_ = std::min(horizon_, ws.time);
    return e.time < horizon_ + model_.network.latency;
  }

  void computes(WorkerState& ws) noexcept {
    ws.state = State::computing;
    ++computing_;
    horizon_ = std::min(horizon_, ws.time);
  }

  // Asks one waiting thread to look at the events (it may run them now).
  void call_one() noexcept {
    if (!waiters_.empty()) waiters_.begin()->second->cv.notify_one();
  }
  void call_all() noexcept {
    for (auto& [done, w] : waiters_) w->cv.notify_one();
  }

  void run_one() {
    std::pop_heap(events_.begin(), events_.end(), Later{});
    Event e = std::move(events_.back());
    events_.pop_back();
    now_ = e.time;
    Simulated::update(*model_.timeline, [&](double& now, auto&, std::uint64_t& events, auto&, auto&) {
      now = now_;
      ++events;
    });
    switch (e.kind) {
      case Kind::to_server:  // queue at the server's link, then for the server itself
        e.kind = Kind::deliver;
        e.time = server_works(e.dst, received(server_node(e.dst), e.bytes), e.bytes);
        push(std::move(e));
        break;
      case Kind::deliver:
        deliver(std::move(e));
        break;
      case Kind::to_worker:
        e.kind = Kind::answer;
        e.time = received(worker_node(e.dst), e.bytes);
        push(std::move(e));
        break;
      case Kind::answer:
        e.original->finish(std::move(e.error));
        if (e.original->ready()) wake(e.original);
        break;
    }
  }

  // Hands the request to its server; its answer, whenever the server gives
  // it, goes back over the network to the worker's call.
  void deliver(Event&& e) {
    Request r = std::move(e.request);
    const std::size_t server = e.dst;
    if (r.done) {
      const std::size_t bytes = answer_bytes(r);
      r.done = std::make_shared<Completion>(
          1, [this, original = std::move(r.done), server, worker = r.worker, bytes](std::exception_ptr error) mutable {
            answered(server, worker, std::move(original), std::move(error), bytes);
          });
    }
    loop_thread_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    handlers_[server]->handle(std::move(r));
    loop_thread_.store(std::thread::id{}, std::memory_order_relaxed);
  }

  // A server finished a request: during an event (this thread holds the
  // lock), or while draining after close (it does not).
  void answered(std::size_t server, std::uint32_t worker, std::shared_ptr<Completion> original,
                std::exception_ptr error, std::size_t bytes) {
    if (loop_thread_.load(std::memory_order_relaxed) != std::this_thread::get_id()) {
      if (!error) error = std::make_exception_ptr(shutdown_error("psx: the simulated cluster shut down"));
      original->finish(std::move(error));
      std::lock_guard lock(mu_);
      call_all();
      return;
    }
    Event e;
    e.kind = Kind::to_worker;
    e.dst = worker;
    e.bytes = bytes;
    e.original = std::move(original);
    e.error = std::move(error);
    // The server copies the answer's parameters out before it leaves.
    const std::size_t header = model_.network.header_bytes;
    const double t = bytes > header ? server_works(server, now_, bytes - header) : now_;
    transfer(server_node(server), std::move(e), t);
  }

  // `done` just became ready at `now_`: its waiter (if any) computes again.
  void wake(const std::shared_ptr<Completion>& done) {
    const auto it = waiters_.find(done.get());
    if (it == waiters_.end()) {
      ready_at_[done.get()] = {done, now_};  // not waited for yet
      return;
    }
    Waiter& w = *it->second;
    w.woken = true;
    if (w.worker && w.worker->state == State::waiting) {
      w.worker->waiting += std::max(0.0, now_ - w.worker->time);
      w.worker->time = std::max(w.worker->time, now_);
      --waiting_;
      computes(*w.worker);
    }
    w.cv.notify_one();
  }

  void publish_worker(std::size_t w) {
    const WorkerState& ws = workers_[w];
    Simulated::update(*model_.timeline, [&](double&, std::vector<SimulatedWorker>& all, auto&, auto&, auto&) {
      all[w] = SimulatedWorker{ws.time, ws.compute, ws.waiting, ws.steps};
    });
  }

  std::string describe_stuck() const {
    std::ostringstream os;
    os << "psx: the simulated cluster is deadlocked at t = " << now_
       << " s: every worker waits and no message is in flight, so the sync policy can never let them go on"
       << " (waiting workers:";
    std::size_t listed = 0;
    for (std::size_t w = 0; w < num_workers_; ++w)
      if (workers_[w].state == State::waiting && listed++ < 16) os << ' ' << w;
    if (listed > 16) os << " ...";
    os << ")";
    return os.str();
  }

  const Simulated model_;
  const std::size_t num_servers_, num_workers_;
  std::mutex mu_;
  std::condition_variable closed_cv_;  // servers wait on it for close()
  std::vector<Event> events_;  // a heap under Later
  std::vector<Node> nodes_;    // workers first, then servers
  std::vector<WorkerState> workers_;
  std::vector<RequestHandler*> handlers_;
  std::vector<double> server_busy_;
  std::unordered_map<const Completion*, Waiter*> waiters_;  // by the completion each waits for
  std::unordered_map<const Completion*, std::pair<std::shared_ptr<Completion>, double>> ready_at_;
  std::atomic<std::thread::id> loop_thread_{};
  std::size_t registered_ = 0;
  std::size_t computing_ = 0, waiting_ = 0, ended_ = 0;
  double now_ = 0;
  double horizon_ = 0;
  bool closed_ = false;
  bool stuck_ = false;
  std::string stuck_message_;
};

inline std::unique_ptr<Simulated::link_type> Simulated::connect(const TransportContext& ctx) const {
  return std::make_unique<link_type>(*this, ctx);
}

static_assert(Transport<Simulated>);

}  // namespace transport
}  // namespace v0
}  // namespace psx
