// psx-bench: the Zmq half of the grid. Every task of the cluster (each ps,
// the chief, each other worker) is a thread of this process with its own
// ParameterServer, ZeroMQ context and sockets, over tcp on 127.0.0.1 with
// ephemeral ports (published in a rendezvous directory) or over ipc sockets
// in a temporary directory: the code paths of separate processes, as in
// tests/zmq/transport.cpp's run_tasks.
#include "grid.hpp"

#include <psx/transport/zmq.hpp>

#include <stdlib.h>  // mkdtemp

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

namespace psx_bench {
namespace {

namespace fs = std::filesystem;
using psx::transport::ClusterSpec;
using psx::transport::Zmq;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "psx-bench-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr)
      throw std::system_error(errno, std::generic_category(), "psx-bench: mkdtemp " + pattern);
    path = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

template <class P, class S>
std::vector<psx::ServerStats> run_zmq(const ClusterSetup& c, const WorkerFn& fn) {
  TempDir dir;
  const ClusterSpec cluster_spec = ClusterSpec::local(c.servers, c.workers, c.zmq_ipc ? dir.path : fs::path());
  // A peer timeout only so that a task that dies cannot leave the others
  // waiting forever; it is far above any step of the workloads.
  const psx::ClusterConfig config{c.servers, c.workers, std::chrono::milliseconds(20000)};
  std::vector<psx::ServerStats> stats(c.servers);
  std::mutex mu;
  std::exception_ptr first;
  Watchdog dog(c.time_limit);
  auto task = [&](std::string type, std::size_t index) {
    try {
      Zmq z;
      z.tf.cluster = cluster_spec;
      z.tf.task = {type, index};
      z.rendezvous = dir.path.string();
      z.start_timeout = std::chrono::milliseconds(20000);
      // PSX_BUSY_POLL_US=n sets Zmq::busy_poll (0: waiters sleep at once), to compare.
      if (const char* b = std::getenv("PSX_BUSY_POLL_US")) z.busy_poll = std::chrono::microseconds(std::atoi(b));
      psx::ParameterServer<P, S, psx::optim::SGD, Zmq> cluster(config, P{}, S{}, psx::optim::SGD{c.lr}, z);
      for (const psx::VariableSpec& v : c.variables) cluster.declare(v);
      const std::size_t watched = dog.watch(cluster);
      try {
        cluster.run(fn);
      } catch (...) {
        dog.forget(watched);
        throw;
      }
      dog.forget(watched);
      if (type == "ps") stats[index] = cluster.server_stats(index);
    } catch (...) {
      std::lock_guard lock(mu);
      if (!first) first = std::current_exception();
    }
  };
  std::vector<std::thread> tasks;
  for (std::size_t s = 0; s < c.servers; ++s) tasks.emplace_back(task, "ps", s);
  tasks.emplace_back(task, "chief", 0);
  for (std::size_t w = 1; w < c.workers; ++w) tasks.emplace_back(task, "worker", w - 1);
  for (auto& t : tasks) t.join();
  dog.check();  // the first exception may be a shutdown_error the time limit caused
  if (first) std::rethrow_exception(first);
  return stats;
}

}  // namespace

std::vector<Entry> zmq_entries() {
  return make_entries("zmq", "Zmq", []<class P, class S>() -> RunFn { return &run_zmq<P, S>; });
}

}  // namespace psx_bench
