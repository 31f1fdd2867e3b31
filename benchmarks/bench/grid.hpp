// psx-bench's compile-time grid: the partitioners and sync policies every
// transport is instantiated with, and the table of function pointers the
// sweep picks cells from at run time. Each transport has its own translation
// unit (grid_inprocess.cpp, grid_zmq.cpp), so the two halves of the table
// compile in parallel: 3 partitioners x 5 sync policies = 15
// ParameterServer instantiations per transport, 30 in all.
#pragma once

#include <psx/psx.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

namespace psx_bench {

//! A policy type with the flag key and the display name psx-bench uses for it.
template <class T>
struct Tag {
  using type = T;
  std::string_view key;
  std::string_view name;
  std::size_t min_workers = 1;  //!< SyncReplicas<M> refuses clusters of fewer than M workers
};

//! The compile-time lists. Adding a type here adds one instantiation per
//! transport (per entry of the other list): keep them short.
inline constexpr auto partitioners = std::tuple{
    Tag<psx::partition::RowRange>{"rowrange", "RowRange"},
    Tag<psx::partition::HashByName>{"hash", "HashByName"},
    Tag<psx::partition::RoundRobin>{"roundrobin", "RoundRobin"},
};
inline constexpr auto sync_policies = std::tuple{
    Tag<psx::sync::Asynchronous>{"async", "Asynchronous"},
    Tag<psx::sync::Synchronous>{"bsp", "Synchronous"},
    Tag<psx::sync::BoundedStaleness<1>>{"ssp1", "BoundedStaleness<1>"},
    Tag<psx::sync::BoundedStaleness<4>>{"ssp4", "BoundedStaleness<4>"},
    Tag<psx::sync::SyncReplicas<2>>{"replicas2", "SyncReplicas<2>", 2},
};

//! What one cell's cluster is made of (the policies are the entry's types).
struct ClusterSetup {
  std::size_t servers = 1;
  std::size_t workers = 1;
  std::vector<psx::VariableSpec> variables;
  double lr = 0.1;
  bool zmq_ipc = false;  //!< Zmq: ipc sockets in a temporary directory instead of tcp on 127.0.0.1
  //! A cell still running after this long is shut down (its calls then
  //! fail with psx::shutdown_error) and reported as failed: a deadlock
  //! must not stop the sweep.
  std::chrono::milliseconds time_limit{600000};
};

//! Shuts down every cluster handed to `watch` once the time limit has
//! passed, unless destroyed before; `check()` then throws a message saying so.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::milliseconds limit) : limit_(limit), thread_([this] { wait(); }) {}
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  //! Registers a cluster (any type with `shutdown()`), which must outlive
  //! the watchdog or be removed with the returned id.
  template <class Cluster>
  std::size_t watch(Cluster& c) {
    std::lock_guard lock(mu_);
    if (fired_) c.shutdown();
    stops_.emplace_back([&c] { c.shutdown(); });
    return stops_.size() - 1;
  }
  void forget(std::size_t id) {
    std::lock_guard lock(mu_);
    stops_[id] = nullptr;
  }

  //! Throws if the time limit shut the cell down.
  void check() const {
    std::lock_guard lock(mu_);
    if (fired_)
      throw std::runtime_error("psx-bench: still running after the cell's time limit (--cell-timeout) of " +
                               std::to_string(limit_.count()) + " ms; shut down (a deadlock?)");
  }

 private:
  void wait() {
    std::unique_lock lock(mu_);
    if (cv_.wait_for(lock, limit_, [this] { return done_; })) return;
    fired_ = true;
    for (auto& stop : stops_)
      if (stop) stop();
  }

  std::chrono::milliseconds limit_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false, fired_ = false;
  std::vector<std::function<void()>> stops_;
  std::thread thread_;  // last: started once the rest is built
};

using WorkerFn = std::function<void(psx::Worker&)>;

//! Builds the cluster, declares the variables, runs `fn` on every worker and
//! returns every server's counters, read once the servers are idle.
using RunFn = std::vector<psx::ServerStats> (*)(const ClusterSetup&, const WorkerFn&);

//! One (partitioner, sync policy, transport) combination.
struct Entry {
  std::string_view partition_key, partition;
  std::string_view sync_key, sync;
  std::string_view transport_key, transport;
  std::size_t min_workers = 1;
  RunFn run = nullptr;
};

//! Every partitioner x sync policy for one transport; `make.template
//! operator()<P, S>()` returns the RunFn of that pair.
template <class Make>
std::vector<Entry> make_entries(std::string_view transport_key, std::string_view transport, Make make) {
  std::vector<Entry> out;
  std::apply(
      [&](auto... p) {
        auto row = [&](auto pt) {
          std::apply(
              [&](auto... s) {
                (out.push_back(Entry{pt.key, pt.name, s.key, s.name, transport_key, transport, s.min_workers,
                                     make.template operator()<typename decltype(pt)::type,
                                                              typename decltype(s)::type>()}),
                 ...);
              },
              sync_policies);
        };
        (row(p), ...);
      },
      partitioners);
  return out;
}

std::vector<Entry> inprocess_entries();
std::vector<Entry> zmq_entries();  // defined only when psx::zmq is built (PSX_BENCH_ZMQ)

}  // namespace psx_bench
