// Local ZeroMQ clusters whose tasks are threads of the test process: the
// cluster, each task's settings, and a runner that starts every task
// (tests/zmq/transport.cpp, tests/zmq/chunks.cpp).
#pragma once

#include "../support.hpp"

#include <psx/transport/zmq.hpp>

#include <chrono>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace psx_zmq_test {

// A cluster of `ps` servers and `workers` workers (the first the chief):
// tcp on loopback with ephemeral ports, or ipc in `dir`.
inline psx::transport::ClusterSpec spec(std::size_t ps, std::size_t workers, bool ipc,
                                        const std::filesystem::path& dir) {
  return psx::transport::ClusterSpec::local(ps, workers, ipc ? dir : std::filesystem::path());
}

inline psx::transport::Zmq settings(const psx::transport::ClusterSpec& c, std::string type, std::size_t index,
                                    const std::filesystem::path& dir) {
  psx::transport::Zmq z;
  z.tf.cluster = c;
  z.tf.task = {std::move(type), index};
  z.rendezvous = dir.string();
  z.start_timeout = std::chrono::milliseconds(20000);
  return z;
}

// Runs `task(type, index, settings)` for every task of a local cluster of
// `ps` servers and `workers` workers, each on a thread; rethrows the first
// task's exception once all have ended.
inline void for_each_task(std::size_t ps, std::size_t workers, bool ipc,
                          const std::function<void(const std::string&, std::size_t, psx::transport::Zmq)>& task) {
  psx_test::TempDir dir;
  const psx::transport::ClusterSpec c = spec(ps, workers, ipc, dir.path);
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> tasks;
  auto run = [&](std::string type, std::size_t index) {
    try {
      task(type, index, settings(c, type, index, dir.path));
    } catch (...) {
      std::lock_guard lock(mu);
      if (!first) first = std::current_exception();
    }
  };
  for (std::size_t s = 0; s < ps; ++s) tasks.emplace_back(run, "ps", s);
  tasks.emplace_back(run, "chief", 0);
  for (std::size_t w = 1; w < workers; ++w) tasks.emplace_back(run, "worker", w - 1);
  for (auto& t : tasks) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace psx_zmq_test
