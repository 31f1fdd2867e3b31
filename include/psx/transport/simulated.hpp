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
//!
//! Faults (`Simulated::faults`, docs/faults.md): from a seed, the network
//! drops a message together with its connection, duplicates one or delays
//! one past those sent after it; a worker-server link is partitioned for a
//! while and heals; a server or worker process is killed. The recovery code
//! is the ZeroMQ transport's: a worker numbers its messages to each server
//! and keeps each until it is answered, sends every unanswered one again
//! when its connection is back, and the server executes each message once
//! and in order (`detail::Window`, the same class `transport::Zmq` uses),
//! answering one that comes again with the answer it kept. So the message
//! a model carries is a copy, as on a real network: a server reads the
//! request's bytes and writes its answer into buffers of the message, and
//! the answer is copied into the caller's buffers when it arrives. A killed
//! process is noticed by its peers `FaultModel::detect` later (the peer
//! timeout, in simulated time): the calls that wait on it fail with
//! `psx::peer_lost`, and a synchronous job ends with that error, to be
//! restarted from its checkpoint as psx-launch restarts a real one.
#pragma once

#include <psx/concepts.hpp>
#include <psx/detail/hash.hpp>
#include <psx/detail/window.hpp>
#include <psx/detail/wire.hpp>
#include <psx/errors.hpp>
#include <psx/message.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numbers>
#include <span>
#include <tuple>
#include <type_traits>
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

//! One fault at a set moment of simulated time.
struct Fault {
  enum class Kind : std::uint8_t {
    kill_server,  //!< server `server`'s process dies: what it holds is lost
    kill_worker,  //!< worker `worker`'s process dies
    partition,    //!< the link between `worker` and `server` carries nothing for `duration` s, then heals
  };
  Kind kind = Kind::partition;
  double at = 0;  //!< simulated seconds
  std::size_t worker = 0;
  std::size_t server = 0;
  double duration = 0;

  static Fault kill_server(std::size_t s, double at) { return {Kind::kill_server, at, 0, s, 0}; }
  static Fault kill_worker(std::size_t w, double at) { return {Kind::kill_worker, at, w, 0, 0}; }
  static Fault partition(std::size_t w, std::size_t s, double at, double duration) {
    return {Kind::partition, at, w, s, duration};
  }

  friend bool operator==(const Fault&, const Fault&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Fault& f) {
    switch (f.kind) {
      case Kind::kill_server: return os << "kill server " << f.server << " at " << f.at * 1e3 << " ms";
      case Kind::kill_worker: return os << "kill worker " << f.worker << " at " << f.at * 1e3 << " ms";
      case Kind::partition:
        return os << "partition worker " << f.worker << " - server " << f.server << " at " << f.at * 1e3
                  << " ms for " << f.duration * 1e3 << " ms";
    }
    return os;
  }
};

//! The faults of a simulated cluster (see the file comment): per message,
//! drawn from `seed` and the message's sender and number, and at set
//! moments (`schedule`). The default injects none.
struct FaultModel {
  //! Probability that a message arriving is lost together with its
  //! connection: everything that arrives on that worker-server link in the
  //! next `reconnect` seconds is lost too; then the worker sends every
  //! message that was not answered again.
  double drop = 0;
  //! Probability that a message arrives twice (the copy `latency` later).
  double duplicate = 0;
  //! Probability that a message is held up for up to `max_delay` more
  //! seconds, so that messages sent after it may overtake it.
  double delay = 0;
  double max_delay = 200e-6;
  //! Seconds from a dropped connection, or a healed partition, until the
  //! worker has connected again.
  double reconnect = 1e-3;
  //! Seconds after a process dies (or a partition began) until its peers
  //! count it lost: the peer timeout, in simulated time. A partition that
  //! lasts this long loses its worker and server to each other for good.
  double detect = 50e-3;
  std::vector<Fault> schedule{};
  std::uint64_t seed = 0;

  //! Whether any fault may happen.
  bool any() const noexcept { return drop > 0 || duplicate > 0 || delay > 0 || !schedule.empty(); }

  //! A schedule drawn from `seed` for a cluster of `servers` and `workers`
  //! whose run takes about `horizon` simulated seconds: message drops,
  //! duplicates and delays at rates up to a few percent, up to two
  //! partitions shorter than `detect`, and in one schedule of four a
  //! process killed. The same arguments give the same schedule.
  static FaultModel random(std::uint64_t seed, std::size_t servers, std::size_t workers, double horizon) {
    std::uint64_t k = 0;
    auto uniform = [&] { return static_cast<double>(detail::mix64(seed * 0x9e3779b97f4a7c15ull + ++k) >> 11) * 0x1.0p-53; };
    auto below = [&](std::size_t n) { return std::min(n - 1, static_cast<std::size_t>(uniform() * static_cast<double>(n))); };
    FaultModel m;
    m.seed = seed;
    m.drop = uniform() < 0.7 ? 0.03 * uniform() : 0.0;
    m.duplicate = uniform() < 0.5 ? 0.05 * uniform() : 0.0;
    m.delay = uniform() < 0.5 ? 0.1 * uniform() : 0.0;
    m.max_delay = horizon / 50 * (0.1 + uniform());
    m.reconnect = horizon / 100 * (0.1 + uniform());
    m.detect = horizon / 4;
    for (std::size_t n = below(3); n > 0; --n)
      m.schedule.push_back(Fault::partition(below(workers), below(servers), horizon * uniform(), m.detect * 0.9 * uniform()));
    if (uniform() < 0.25) {
      const double at = horizon * uniform();
      m.schedule.push_back(uniform() < 0.5 ? Fault::kill_server(below(servers), at) : Fault::kill_worker(below(workers), at));
    }
    return m;
  }

  friend bool operator==(const FaultModel&, const FaultModel&) = default;
  friend std::ostream& operator<<(std::ostream& os, const FaultModel& m) {
    if (!m.any()) return os << "no faults";
    os << "faults seed " << m.seed;
    if (m.drop > 0) os << ", drop " << m.drop;
    if (m.duplicate > 0) os << ", duplicate " << m.duplicate;
    if (m.delay > 0) os << ", delay " << m.delay << " up to " << m.max_delay * 1e3 << " ms";
    os << ", reconnect " << m.reconnect * 1e3 << " ms, detect " << m.detect * 1e3 << " ms";
    for (const Fault& f : m.schedule) os << "; " << f;
    return os;
  }
};

//! What the fault model did in a run.
struct FaultCounts {
  std::uint64_t dropped = 0;     //!< messages lost with their connection (the drop itself)
  std::uint64_t lost = 0;        //!< messages that arrived on a link that was down, or at a dead process
  std::uint64_t duplicated = 0;  //!< messages delivered twice
  std::uint64_t delayed = 0;     //!< messages held up
  std::uint64_t resent = 0;      //!< messages sent again after a reconnect
  std::uint64_t partitions = 0;  //!< scheduled partitions that began
  std::uint64_t kills = 0;       //!< processes killed
  friend bool operator==(const FaultCounts&, const FaultCounts&) = default;
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
  //! What the fault model did.
  FaultCounts faults() const {
    std::lock_guard lock(mu_);
    return faults_;
  }

 private:
  friend struct Simulated;
  mutable std::mutex mu_;
  double now_ = 0;
  std::vector<SimulatedWorker> workers_;
  std::uint64_t events_ = 0, messages_ = 0, bytes_ = 0;
  FaultCounts faults_;
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
  //! Faults injected (none by default).
  FaultModel faults{};
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
           a.seed == b.seed && a.faults == b.faults;
  }
  friend std::ostream& operator<<(std::ostream& os, const Simulated& s) {
    os << "Simulated(" << s.network << "; " << s.compute;
    if (s.server_bandwidth > 0) os << "; server " << s.server_bandwidth / 1e9 << " GB/s";
    os << "; seed " << s.seed;
    if (s.faults.any()) os << "; " << s.faults;
    return os << ")";
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
    t.faults_ = {};
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
  static void count(Timeline& t, std::uint64_t FaultCounts::*what) {
    std::lock_guard lock(t.mu_);
    ++(t.faults_.*what);
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
        server_busy_(ctx.num_servers, 0.0),
        lanes_(ctx.num_workers * ctx.num_servers),
        windows_(ctx.num_workers * ctx.num_servers),
        server_dead_(ctx.num_servers, false),
        worker_dead_(ctx.num_workers, false) {
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
    const FaultModel& f = model.faults;
    for (auto [p, what] : {std::pair{f.drop, "faults.drop"}, {f.duplicate, "faults.duplicate"}, {f.delay, "faults.delay"}})
      if (!(p >= 0 && p <= 1)) throw config_error(std::string("psx: transport::Simulated: ") + what + " must be in [0, 1]");
    check(f.max_delay, "faults.max_delay");
    check(f.reconnect, "faults.reconnect");
    check(f.detect, "faults.detect");
    for (std::size_t k = 0; k < f.schedule.size(); ++k) {
      const Fault& x = f.schedule[k];
      const std::string where = "psx: transport::Simulated: faults.schedule[" + std::to_string(k) + "] (";
      std::ostringstream os;
      os << x << "): ";
      if (!(x.at >= 0) || !std::isfinite(x.at) || !(x.duration >= 0) || !std::isfinite(x.duration))
        throw config_error(where + os.str() + "times must be finite and >= 0");
      if (x.kind != Fault::Kind::kill_worker && x.server >= num_servers_)
        throw config_error(where + os.str() + "a cluster of " + std::to_string(num_servers_) + " servers");
      if (x.kind != Fault::Kind::kill_server && x.worker >= num_workers_)
        throw config_error(where + os.str() + "a cluster of " + std::to_string(num_workers_) + " workers");
    }
    Simulated::bind(*model_.timeline, num_workers_);
    for (std::size_t k = 0; k < f.schedule.size(); ++k) {
      Event e;
      e.kind = Kind::fault;
      e.time = f.schedule[k].at;
      e.src = fault_source;
      e.seq = fault_events_++;
      e.id = k;
      push(std::move(e));
    }
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
    // The message is a copy of the request: the server reads it and writes
    // its answer there; the caller's request waits in its lane until the
    // answer arrives (or the server is lost), to be sent again after a
    // reconnect.
    const std::uint32_t w = r.worker;
    Lane& lane = lanes_[lane_index(w, server)];
    const std::uint64_t id = lane.next_id;
    Event e = outgoing(r, server, id);
    lane.pending.emplace(id, Pending{std::move(r), false, t});
    ++lane.next_id;
    try {
      transfer(worker_node(w), std::move(e), t);
    } catch (...) {
      lane.pending.erase(id);
      throw;
    }
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

  //! Fails every call still waiting for an answer and stops the servers' loops.
  void close() noexcept {
    std::vector<Pending> left;
    {
      std::lock_guard lock(mu_);
      if (closed_) return;
      closed_ = true;
      events_.clear();
      for (Lane& lane : lanes_) {
        for (auto& [id, p] : lane.pending) left.push_back(std::move(p));
        lane.pending.clear();
      }
    }
    for (Pending& p : left)
      p.request.finish(std::make_exception_ptr(shutdown_error("psx: the simulated cluster shut down with the message in flight")));
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
  enum class Kind : std::uint8_t {
    to_server,    // a request reaches its server's link
    deliver,      // ... and its server, through the link
    to_worker,    // an answer reaches its worker's link
    answer,       // ... and its worker
    fault,        // FaultModel::schedule[id] happens
    reconnect,    // worker dst's connection to server id is back (unless it went down again since)
    lost_server,  // server dst, killed `detect` ago, is lost to every worker
    lost_worker,  // worker dst, killed `detect` ago, is lost to every server
    lost_link,    // the link between worker dst and server id, cut `detect` ago, is lost for good
  };
  // Sender of the events the fault model makes (after every node).
  static constexpr std::uint32_t fault_source = std::numeric_limits<std::uint32_t>::max();

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
  // A message's bytes: a copy of what the request reads, and room for what
  // its answer carries.
  struct Buffers {
    std::vector<std::uint64_t> ids;
    std::vector<std::uint32_t> positions;
    std::vector<float> in, out;
    std::vector<std::uint16_t> out16;
  };
  struct Event {
    double time = 0;
    std::uint32_t src = 0;  // node that sent the message
    std::uint64_t seq = 0;  // the sender's message count
    std::uint8_t copy = 0;  // 1: the duplicate the fault model made
    Kind kind = Kind::to_server;
    bool resend = false;    // sent again after a reconnect
    bool delayed = false;   // held up by the fault model once already
    std::uint32_t dst = 0;  // server (to_server, deliver) or worker (to_worker, answer, ...)
    std::size_t bytes = 0;
    std::uint64_t id = 0;   // the message's number on its worker-server lane (the schedule's index: fault)
    Request request;        // to_server, deliver: its spans point into `data`
    std::shared_ptr<Buffers> data;
    std::exception_ptr error;  // to_worker, answer
  };
  struct Later {  // heap order: the earliest event at the front
    bool operator()(const Event& a, const Event& b) const noexcept {
      if (a.time != b.time) return a.time > b.time;
      if (a.src != b.src) return a.src > b.src;
      if (a.seq != b.seq) return a.seq > b.seq;
      return a.copy > b.copy;
    }
  };
  struct Waiter {
    explicit Waiter(WorkerState* w) noexcept : worker(w) {}
    WorkerState* worker;  // null: not a computing worker when it began to wait
    bool woken = false;
    std::condition_variable cv;
  };
  // A message sent and not answered yet: the caller's request (its spans
  // point into the caller's buffers) and whether it must go again.
  struct Pending {
    Request request;
    bool lost = false;  // it, or its answer, was lost: sent again at the next reconnect
    double sent_at = 0;
  };
  // One worker's connection to one server, seen from the worker.
  struct Lane {
    std::uint64_t next_id = 1;
    std::uint64_t done_max = 0;  // the highest message answered or failed
    std::map<std::uint64_t, Pending> pending;
    bool down = false;        // messages that arrive now are lost
    double up_at = 0;         // when it is connected again
    std::string gone;         // the server is lost to this worker: why (every message fails)
  };
  // What a server keeps of an answer, to send it again.
  struct Kept {
    detail::wire::Status status = detail::wire::Status::ok;
    std::string text;
    std::shared_ptr<Buffers> data;  // reads: the answer's tensors
  };
  using Window = detail::Window<Event, Kept>;

  std::uint32_t worker_node(std::uint32_t w) const noexcept { return w; }
  std::uint32_t server_node(std::size_t s) const noexcept { return static_cast<std::uint32_t>(num_workers_ + s); }
  std::size_t lane_index(std::size_t w, std::size_t s) const noexcept { return w * num_servers_ + s; }

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

  template <class T>
  static std::span<T> part(std::vector<std::remove_const_t<T>>& v, std::size_t at, std::size_t n) noexcept {
    return n == 0 ? std::span<T>{} : std::span<T>(v.data() + at, n);
  }

  // The message that carries request `id` of `r`'s worker to `server`: a
  // copy of what it reads, and room for its answer.
  Event outgoing(const Request& r, std::size_t server, std::uint64_t id) const {
    Event e;
    e.kind = Kind::to_server;
    e.dst = static_cast<std::uint32_t>(server);
    e.id = id;
    e.bytes = request_bytes(r);
    auto b = std::make_shared<Buffers>();
    std::size_t ids = 0, positions = 0, in = 0, out = 0, out16 = 0;
    for (const Item& it : r.items) {
      ids += it.ids.size();
      positions += it.positions.size();
      in += it.in.size();
      out += it.out.size();
      out16 += it.out16.size();
    }
    b->ids.resize(ids);
    b->positions.resize(positions);
    b->in.resize(in);
    b->out.resize(out);
    b->out16.resize(out16);
    Request& c = e.request;
    c.op = r.op;
    c.worker = r.worker;
    c.clock = r.clock;
    c.call = r.call;
    c.reason = r.reason;
    c.items.resize(r.items.size());
    ids = positions = in = out = out16 = 0;
    for (std::size_t i = 0; i < r.items.size(); ++i) {
      const Item& from = r.items[i];
      Item& to = c.items[i];
      to.variable = from.variable;
      to.shard = from.shard;
      std::copy(from.ids.begin(), from.ids.end(), b->ids.begin() + static_cast<std::ptrdiff_t>(ids));
      std::copy(from.positions.begin(), from.positions.end(), b->positions.begin() + static_cast<std::ptrdiff_t>(positions));
      std::copy(from.in.begin(), from.in.end(), b->in.begin() + static_cast<std::ptrdiff_t>(in));
      to.ids = part<const std::uint64_t>(b->ids, ids, from.ids.size());
      to.positions = part<const std::uint32_t>(b->positions, positions, from.positions.size());
      to.in = part<const float>(b->in, in, from.in.size());
      to.out = part<float>(b->out, out, from.out.size());
      to.out16 = part<std::uint16_t>(b->out16, out16, from.out16.size());
      ids += from.ids.size();
      positions += from.positions.size();
      in += from.in.size();
      out += from.out.size();
      out16 += from.out16.size();
    }
    e.data = std::move(b);
    return e;
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
    counted(e.bytes);
    push(std::move(e));
  }

  // One message of `b` bytes on the simulated network (Timeline::messages, bytes).
  void counted(std::size_t b) {
    Simulated::update(*model_.timeline, [&](double&, auto&, auto&, std::uint64_t& messages, std::uint64_t& bytes) {
      ++messages;
      bytes += b;
    });
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

  // An event the fault model makes at `t` (it runs in the event loop only,
  // so its numbering is deterministic).
  void push_fault(Kind kind, double t, std::uint32_t dst, std::uint64_t id = 0) {
    Event e;
    e.kind = kind;
    e.time = t;
    e.src = fault_source;
    e.seq = fault_events_++;
    e.dst = dst;
    e.id = id;
    push(std::move(e));
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
        if (!arrives(e, e.request.worker, e.dst)) break;
        e.kind = Kind::deliver;
        e.time = server_works(e.dst, received(server_node(e.dst), e.bytes), e.bytes);
        push(std::move(e));
        break;
      case Kind::deliver:
        deliver(std::move(e));
        break;
      case Kind::to_worker:
        if (!arrives(e, e.dst, e.src - num_workers_)) break;
        e.kind = Kind::answer;
        e.time = received(worker_node(e.dst), e.bytes);
        push(std::move(e));
        break;
      case Kind::answer:
        complete(std::move(e));
        break;
      case Kind::fault:
        happens(model_.faults.schedule[e.id]);
        break;
      case Kind::reconnect:
        reconnect(e.dst, e.id);
        break;
      case Kind::lost_server:
        lose_server(e.dst);
        break;
      case Kind::lost_worker:
        lose_worker(e.dst);
        break;
      case Kind::lost_link:
        lose_link(e.dst, e.id, "psx: worker " + std::to_string(e.dst) + " and server " + std::to_string(e.id) +
                                   " could not reach each other for " + seconds(model_.faults.detect) +
                                   " (a partition in the simulated network)");
        break;
    }
  }

  static std::string seconds(double s) {
    std::ostringstream os;
    os << s * 1e3 << " ms";
    return os.str();
  }
  std::string at_now() const { return " at t = " + seconds(now_) + " (simulated)"; }

  // Message `e` between worker `w` and server `s` reaches its receiver's
  // link now: whether it goes on. A message that arrives on a link that is
  // down, or at a process that died, is lost (its worker sends it again
  // after the reconnect); the fault model may drop it with its connection,
  // hold it up, or deliver it twice.
  bool arrives(Event& e, std::size_t w, std::size_t s) {
    Lane& lane = lanes_[lane_index(w, s)];
    const bool request = e.kind == Kind::to_server;
    if (worker_dead_[w]) {  // from or to a dead worker: its calls failed when it died
      if (request) fail(lane, e.id, "psx: worker " + std::to_string(w) + "'s process was killed (a simulated fault)");
      return false;
    }
    if (!lane.gone.empty()) {  // its server was lost: the call fails
      if (request) fail(lane, e.id, lane.gone);
      return false;
    }
    if (server_dead_[s] || lane.down) {
      Simulated::count(*model_.timeline, &FaultCounts::lost);
      mark_lost(lane, e.id);
      return false;
    }
    const FaultModel& f = model_.faults;
    if ((f.drop > 0 || f.delay > 0 || f.duplicate > 0) && !e.delayed) {
      // Draws of this message: (seed, sender, its number, copy).
      const std::uint64_t key = f.seed ^ (0x9e3779b97f4a7c15ull * (e.src + 1)) ^ (0xc2b2ae3d27d4eb4full * (e.seq + 1)) ^
                                (0x165667b19e3779f9ull * (e.copy + 1 + (e.resend ? 2 : 0)));
      auto uniform = [&](std::uint64_t k) {
        return static_cast<double>(detail::mix64(key + k * 0x9e3779b97f4a7c15ull) >> 11) * 0x1.0p-53;
      };
      if (uniform(0) < f.drop) {
        Simulated::count(*model_.timeline, &FaultCounts::dropped);
        mark_lost(lane, e.id);
        goes_down(w, s, now_ + f.reconnect);
        return false;
      }
      if (uniform(1) < f.delay) {
        Simulated::count(*model_.timeline, &FaultCounts::delayed);
        e.delayed = true;
        e.time = now_ + f.max_delay * uniform(2);
        push(std::move(e));
        return false;
      }
      if (e.copy == 0 && uniform(3) < f.duplicate) {
        Simulated::count(*model_.timeline, &FaultCounts::duplicated);
        Event twin = e;
        twin.copy = 1;
        if (twin.error) {  // an exception object of its own (no two threads share one)
          const auto [status, text] = detail::wire::status_of(twin.error);
          twin.error = detail::wire::exception_of(status, text);
        }
        twin.time = now_ + model_.network.latency;
        push(std::move(twin));
      }
    }
    return true;
  }

  void mark_lost(Lane& lane, std::uint64_t id) {
    if (auto it = lane.pending.find(id); it != lane.pending.end()) it->second.lost = true;
  }

  // The lane is down until `until`; a reconnect then sends what was lost.
  void goes_down(std::size_t w, std::size_t s, double until) {
    Lane& lane = lanes_[lane_index(w, s)];
    lane.down = true;
    lane.up_at = std::max(lane.up_at, until);
    push_fault(Kind::reconnect, until, static_cast<std::uint32_t>(w), s);
  }

  // Worker `w` connected to server `s` again: its messages that were lost
  // (or whose answers were) go again, in order, as transport::Zmq sends
  // its unanswered ones after a reconnect. (They leave at once, beside
  // whatever the worker's link is sending: only the event loop sends them,
  // and the worker's own sends may not be ordered against it.)
  void reconnect(std::size_t w, std::size_t s) {
    Lane& lane = lanes_[lane_index(w, s)];
    if (!lane.down || now_ < lane.up_at || !lane.gone.empty()) return;  // down again since, or lost for good
    lane.down = false;
    for (auto& [id, p] : lane.pending) {
      if (!p.lost) continue;
      p.lost = false;
      Event e = outgoing(p.request, s, id);
      e.resend = true;
      e.src = worker_node(static_cast<std::uint32_t>(w));
      e.seq = (std::uint64_t{1} << 63) | resent_++;
      e.time = now_ + wire_seconds(e.bytes) + model_.network.latency;
      Simulated::count(*model_.timeline, &FaultCounts::resent);
      counted(e.bytes);
      push(std::move(e));
    }
  }

  void happens(const Fault& f) {
    switch (f.kind) {
      case Fault::Kind::partition: {
        Simulated::count(*model_.timeline, &FaultCounts::partitions);
        goes_down(f.worker, f.server, now_ + f.duration + model_.faults.reconnect);
        if (f.duration >= model_.faults.detect)
          push_fault(Kind::lost_link, now_ + model_.faults.detect, static_cast<std::uint32_t>(f.worker), f.server);
        break;
      }
      case Fault::Kind::kill_server:
        if (server_dead_[f.server]) break;
        Simulated::count(*model_.timeline, &FaultCounts::kills);
        server_dead_[f.server] = true;
        killed_at_[f.server + num_workers_] = now_;
        push_fault(Kind::lost_server, now_ + model_.faults.detect, static_cast<std::uint32_t>(f.server));
        break;
      case Fault::Kind::kill_worker: {
        if (worker_dead_[f.worker]) break;
        Simulated::count(*model_.timeline, &FaultCounts::kills);
        worker_dead_[f.worker] = true;
        killed_at_[f.worker] = now_;
        // The process is gone: its thread stops waiting (its calls fail)
        // and whatever it sends from now on is lost.
        const std::string why = "psx: worker " + std::to_string(f.worker) + "'s process was killed" + at_now() +
                                " (a simulated fault)";
        for (std::size_t s = 0; s < num_servers_; ++s) fail_all(lanes_[lane_index(f.worker, s)], why);
        push_fault(Kind::lost_worker, now_ + model_.faults.detect, static_cast<std::uint32_t>(f.worker));
        break;
      }
    }
  }

  // Server `s` died `detect` ago: every worker's calls to it fail, now and later.
  void lose_server(std::size_t s) {
    const std::string why = "psx: server " + std::to_string(s) + " was lost: killed at t = " +
                            seconds(killed_at_[s + num_workers_]) + ", silent for " + seconds(model_.faults.detect) +
                            " (a simulated fault)";
    for (std::size_t w = 0; w < num_workers_; ++w) {
      Lane& lane = lanes_[lane_index(w, s)];
      if (!lane.gone.empty()) continue;
      lane.gone = why;
      fail_all(lane, why);
    }
  }

  // Worker `w` died `detect` ago: every live server counts it lost, as the
  // ZeroMQ server does after the peer timeout (the sync policy decides).
  void lose_worker(std::size_t w) {
    for (std::size_t s = 0; s < num_servers_; ++s)
      if (!server_dead_[s])
        tell_lost(s, w, "lost: killed at t = " + seconds(killed_at_[w]) + ", silent for " +
                            seconds(model_.faults.detect) + " (a simulated fault)");
  }

  // Worker `w` and server `s` lost each other for good.
  void lose_link(std::size_t w, std::size_t s, const std::string& why) {
    Lane& lane = lanes_[lane_index(w, s)];
    if (!lane.gone.empty() || worker_dead_[w] || server_dead_[s]) return;
    lane.gone = why;
    fail_all(lane, why);
    tell_lost(s, w, "lost: " + why.substr(5));
  }

  void tell_lost(std::size_t s, std::size_t w, std::string reason) {
    Request r;
    r.op = Op::fail;
    r.worker = static_cast<std::uint32_t>(w);
    r.reason = std::move(reason);
    loop_thread_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    handlers_[s]->handle(std::move(r));
    loop_thread_.store(std::thread::id{}, std::memory_order_relaxed);
  }

  // The call waiting on message `id` of `lane` fails with peer_lost(why).
  void fail(Lane& lane, std::uint64_t id, const std::string& why) {
    const auto it = lane.pending.find(id);
    if (it == lane.pending.end()) return;
    std::shared_ptr<Completion> done = std::move(it->second.request.done);
    forget(lane, it);
    if (!done) return;
    done->finish(std::make_exception_ptr(peer_lost(why + at_now())));
    if (done->ready()) wake(done);
  }
  // Fails the calls of `lane` whose messages left `latency` ago or earlier:
  // exactly those a worker's thread had sent when this event became due
  // (any later one leaves after now - latency, see may_run), so which
  // calls fail here does not depend on how far that thread got meanwhile.
  // The others fail when their messages arrive (`arrives`).
  void fail_all(Lane& lane, const std::string& why) {
    const double sent_by = now_ - model_.network.latency;
    std::vector<std::uint64_t> ids;
    for (const auto& [id, p] : lane.pending)
      if (p.sent_at <= sent_by) ids.push_back(id);
    for (std::uint64_t id : ids) fail(lane, id, why);
  }
  void forget(Lane& lane, std::map<std::uint64_t, Pending>::iterator it) {
    lane.done_max = std::max(lane.done_max, it->first);
    lane.pending.erase(it);
  }
  // The lowest message the worker still waits on: its server forgets the
  // answers below. (Read when a message arrives, in the event loop: what
  // the worker's thread sees of its lane when it sends depends on how far
  // the loop has run.)
  static std::uint64_t floor_of(const Lane& lane) noexcept {
    return lane.pending.empty() ? lane.done_max + 1 : std::min(lane.pending.begin()->first, lane.done_max + 1);
  }

  // Hands the request to its server in its worker's order, once
  // (detail::Window): a message that comes again gets the answer its first
  // got, one that came early waits for those before it.
  void deliver(Event&& e) {
    const std::size_t s = e.dst;
    const std::uint32_t w = e.request.worker;
    if (server_dead_[s] || worker_dead_[w]) return;
    RequestHandler& h = *handlers_[s];
    if (e.resend) h.link_event(RequestHandler::LinkEvent::retried);
    Window& win = windows_[lane_index(w, s)];
    const Lane& lane = lanes_[lane_index(w, s)];
    // The floor: while the worker's lane is not down (a message that
    // arrives in a lane that is down is lost, so this one came while it was
    // up, and so did everything the worker learnt before).
    win.acknowledge(std::min(floor_of(lane), e.id));
    const std::uint64_t id = e.id;
    switch (win.arrive(id, e, detail::is_read(e.request.op))) {
      case Window::Arrival::answered: {
        h.link_event(RequestHandler::LinkEvent::duplicate);
        const Kept& k = win.find(id)->answer;
        answer(s, w, id, k.status == detail::wire::Status::ok ? nullptr : detail::wire::exception_of(k.status, k.text),
               k.data, answer_bytes(e.request));
        return;
      }
      case Window::Arrival::running:
        h.link_event(RequestHandler::LinkEvent::duplicate);
        return;
      case Window::Arrival::forgotten:
        h.link_event(RequestHandler::LinkEvent::duplicate);
        answer(s, w, id,
               std::make_exception_ptr(wire_error("psx: worker " + std::to_string(w) + ": message " +
                                                  std::to_string(id) + " was sent again after server " +
                                                  std::to_string(s) + " forgot its answer; it is not executed twice")),
               nullptr, model_.network.header_bytes);
        return;
      case Window::Arrival::overflow:
        answer(s, w, id,
               std::make_exception_ptr(wire_error("psx: worker " + std::to_string(w) + ": message " +
                                                  std::to_string(id) + " came while " + std::to_string(win.held()) +
                                                  " others waited at server " + std::to_string(s) + " for message " +
                                                  std::to_string(win.next()) + ", which never came")),
               nullptr, model_.network.header_bytes);
        return;
      case Window::Arrival::held:
        return;
      case Window::Arrival::run:
        break;
    }
    for (;;) {
      execute(s, std::move(e));
      auto next = win.release();
      if (!next) break;
      e = std::move(next->second);
    }
  }

  // The server handles message `e`; its answer, whenever the server gives
  // it, goes back over the network.
  void execute(std::size_t s, Event&& e) {
    Request r = std::move(e.request);
    const std::uint32_t w = r.worker;
    const std::size_t bytes = answer_bytes(r);
    r.done = std::make_shared<Completion>(
        1, [this, s, w, id = e.id, data = std::move(e.data), bytes, read = detail::is_read(r.op)](std::exception_ptr error) mutable {
          answered(s, w, id, std::move(data), std::move(error), bytes, read);
        });
    loop_thread_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    handlers_[s]->handle(std::move(r));
    loop_thread_.store(std::thread::id{}, std::memory_order_relaxed);
  }

  // Server `s` finished message `id` of worker `w`: during an event (this
  // thread holds the lock), or while draining after close (it does not:
  // the caller's call failed then already).
  void answered(std::size_t s, std::uint32_t w, std::uint64_t id, std::shared_ptr<Buffers> data,
                std::exception_ptr error, std::size_t bytes, bool read) {
    if (loop_thread_.load(std::memory_order_relaxed) != std::this_thread::get_id()) {
      std::lock_guard lock(mu_);
      call_all();
      return;
    }
    Kept kept;
    if (error) std::tie(kept.status, kept.text) = detail::wire::status_of(error);
    else if (read) kept.data = data;
    const std::size_t tensors = kept.data ? bytes - model_.network.header_bytes : 0;
    windows_[lane_index(w, s)].remember(id, std::move(kept), tensors);
    if (server_dead_[s]) return;
    answer(s, w, id, std::move(error), std::move(data), bytes);
  }

  // The answer to message `id` leaves server `s` for worker `w`.
  void answer(std::size_t s, std::uint32_t w, std::uint64_t id, std::exception_ptr error,
              std::shared_ptr<Buffers> data, std::size_t bytes) {
    Event e;
    e.kind = Kind::to_worker;
    e.dst = w;
    e.id = id;
    e.bytes = bytes;
    e.error = std::move(error);
    if (!e.error) e.data = std::move(data);
    // The server copies the answer's parameters out before it leaves.
    const std::size_t header = model_.network.header_bytes;
    const double t = bytes > header ? server_works(s, now_, bytes - header) : now_;
    transfer(server_node(s), std::move(e), t);
  }

  // An answer reached its worker: into the caller's buffers, and the call
  // part is done. One whose call is done already (a duplicate) is dropped.
  void complete(Event&& e) {
    Lane& lane = lanes_[lane_index(e.dst, e.src - num_workers_)];
    const auto it = lane.pending.find(e.id);
    if (it == lane.pending.end()) return;
    Request& r = it->second.request;
    if (!e.error && e.data) {
      std::size_t out = 0, out16 = 0;
      for (Item& item : r.items) {
        if (!item.out.empty()) std::memcpy(item.out.data(), e.data->out.data() + out, item.out.size_bytes());
        if (!item.out16.empty()) std::memcpy(item.out16.data(), e.data->out16.data() + out16, item.out16.size_bytes());
        out += item.out.size();
        out16 += item.out16.size();
      }
    }
    std::shared_ptr<Completion> done = std::move(r.done);
    forget(lane, it);
    if (!done) return;
    done->finish(std::move(e.error));
    if (done->ready()) wake(done);
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
  std::vector<Lane> lanes_;      // by lane_index(worker, server)
  std::vector<Window> windows_;  // the servers' side of each lane, by lane_index
  std::vector<bool> server_dead_, worker_dead_;
  std::unordered_map<std::size_t, double> killed_at_;  // by node
  std::uint64_t fault_events_ = 0;  // events the fault model made (their numbers)
  std::uint64_t resent_ = 0;        // messages sent again (their numbers)
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
