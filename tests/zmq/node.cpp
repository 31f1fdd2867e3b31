// One task of a psx cluster over ZeroMQ, as a process: reads TF_CONFIG and
// PSX_RENDEZVOUS, declares the test program's variables and runs it. The
// chief then trains the same program on an in-process cluster and compares
// the two bit for bit. Run by tests/zmq/multiprocess.sh through psx-launch.
//
//   psx_zmq_node [--steps N] [--pause-ms MS] [--peer-timeout-ms MS]
//
// Exit status: 0 when the run (and, for the chief, the comparison) passed;
// 1 when the parameters differ; 3 when a psx error ended the run (printed).
#include "program.hpp"

#include <psx/psx.hpp>
#include <psx/transport/zmq.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <thread>

namespace {

using Policies = psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD,
                                      psx::transport::Zmq>;

}  // namespace

int main(int argc, char** argv) {
  int steps = psx_zmq_test::steps;
  int pause_ms = 0;
  long peer_timeout_ms = 20000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--steps") steps = std::atoi(argv[i + 1]);
    else if (flag == "--pause-ms") pause_ms = std::atoi(argv[i + 1]);
    else if (flag == "--peer-timeout-ms") peer_timeout_ms = std::atol(argv[i + 1]);
    else {
      std::fprintf(stderr, "psx_zmq_node: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  try {
    auto z = psx::transport::Zmq::from_env();
    const std::string role = z.tf.task.type + " " + std::to_string(z.tf.task.index);
    psx::ClusterConfig config{z.tf.cluster.num_servers(), z.tf.cluster.num_workers(),
                              std::chrono::milliseconds(peer_timeout_ms)};
    std::map<std::string, std::vector<float>> trained;
    {
      Policies cluster(config, {}, {}, psx::optim::SGD{0.05f}, z);
      psx_zmq_test::declare(cluster);
      cluster.run([&](psx::Worker& w) {
        psx_zmq_test::train_for(w, steps, [&] {
          if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
        });
      });
      if (z.tf.task.type == "chief") trained = psx_zmq_test::read_all(cluster);
      std::printf("%s: done\n", role.c_str());
    }
    if (z.tf.task.type != "chief") return 0;
    psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD> local(
        psx::ClusterConfig{config.num_servers, config.num_workers}, {}, {}, psx::optim::SGD{0.05f});
    psx_zmq_test::declare(local);
    local.run([&](psx::Worker& w) { psx_zmq_test::train_for(w, steps, [] {}); });
    for (const auto& [name, values] : trained) {
      const auto expected = local.read(name);
      if (expected.size() != values.size() ||
          std::memcmp(expected.data(), values.data(), values.size() * sizeof(float)) != 0) {
        std::printf("chief: variable %s differs from the in-process cluster\n", name.c_str());
        return 1;
      }
    }
    std::printf("chief: %zu servers, %zu workers, %d steps: parameters bit-identical to the in-process cluster\n",
                config.num_servers, config.num_workers, steps);
    return 0;
  } catch (const psx::error& e) {
    std::printf("psx error: %s\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 4;
  }
}
