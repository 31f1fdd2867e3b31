// One task of a psx cluster over ZeroMQ, as a process: reads TF_CONFIG and
// PSX_RENDEZVOUS, declares the test program's variables and runs it. The
// chief then trains the same program on an in-process cluster and compares
// the two bit for bit. Run through psx-launch by the zmq.* tests.
//
//   psx_zmq_node [--steps N] [--pause-ms MS] [--peer-timeout-ms MS (default: the transport's)]
//                [--optimizer sgd|adam|ftrl] [--restore DIR] [--save ROOT]
//   psx_zmq_node --compare DIR1 DIR2
//   psx_zmq_node ... --checkpoint DIR --every N [--ballast-mb M] [--background 1]   (the chaos test)
//   psx_zmq_node ... --sync async   (Asynchronous instead of Synchronous: no comparison)
//
// With --restore every task restores the checkpoint DIR first (the clock
// starts at its step); with --save the cluster saves a checkpoint under
// ROOT when it has trained; either skips the in-process comparison.
// --compare checks that two checkpoints hold the same parameters and
// optimizer slots, bit for bit, without a cluster.
//
// With --checkpoint every task resumes from the newest checkpoint in DIR
// that restores whole (CheckpointManager::restore_or_init), saves every N
// steps there, and meets a barrier every 7 steps; the chief still compares
// the end result with an undisturbed in-process run. It says "saving step
// N" and "barrier at N" first, for tests/zmq/chaos.sh to aim its kills.
// --ballast-mb declares a frozen variable of M MiB that every save writes
// (a save long enough to be killed in). --background 1: the manager saves in
// the background (training goes on while the servers write), and the last
// save is finished when training ends.
//
// Exit status: 0 when the run (and, for the chief, the comparison) passed;
// 1 when the parameters differ; 3 when a psx error ended the run (printed).
#include "program.hpp"

#include <psx/checkpoint.hpp>
#include <psx/psx.hpp>
#include <psx/transport/zmq.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

struct Flags {
  int steps = psx_zmq_test::steps;
  int pause_ms = 0;
  long peer_timeout_ms = -1;  // ClusterConfig::transport_default
  std::string optimizer = "sgd", restore, save, checkpoint;
  int every = 10;
  int ballast_mb = 0;
  bool alone = false;  // --alone 1: no final barrier, no comparison (workers of unequal steps end in any order)
  bool background = false;
  std::string sync = "bsp";  // or "async"
};

template <class PS>
void declare_all(PS& ps, const Flags& f) {
  psx_zmq_test::declare(ps);
  if (f.ballast_mb > 0)
    ps.declare({.name = "ballast",
                .shape = {static_cast<std::size_t>(f.ballast_mb) << 18},
                .init = psx::Initializer::constant(1.0f),
                .trainable = false});
}

// Whether two float vectors hold the same bits (memcmp must not see the
// null data of an empty vector: SGD keeps no slots).
bool same_bits(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
}

int compare(const char* a, const char* b) {
  for (const auto& name : psx_zmq_test::names()) {
    const auto x = psx::checkpoint::load_variable(a, name), y = psx::checkpoint::load_variable(b, name);
    if (x.version != y.version || !same_bits(x.values, y.values) || !same_bits(x.slots, y.slots)) {
      std::printf("compare: variable %s differs (parameters or optimizer slots)\n", name.c_str());
      return 1;
    }
  }
  std::printf("compare: %s and %s hold the same parameters and optimizer slots, bit for bit\n", a, b);
  return 0;
}

template <class S, class O>
int run(const Flags& f, const O& optimizer) {
  using Policies = psx::ParameterServer<psx::partition::RowRange, S, O, psx::transport::Zmq>;
  auto z = psx::transport::Zmq::from_env();
  const std::string role = z.tf.task.type + " " + std::to_string(z.tf.task.index);
  psx::ClusterConfig config{z.tf.cluster.num_servers(), z.tf.cluster.num_workers(),
                            f.peer_timeout_ms < 0 ? psx::ClusterConfig::transport_default
                                                  : std::chrono::milliseconds(f.peer_timeout_ms)};
  std::map<std::string, std::vector<float>> trained;
  {
    Policies cluster(config, {}, {}, optimizer, z);
    declare_all(cluster, f);
    std::optional<psx::CheckpointManager<Policies>> ckpt;
    if (!f.checkpoint.empty())
      ckpt.emplace(cluster, psx::checkpoint::Options{.directory = f.checkpoint,
                                                     .every_steps = static_cast<std::uint64_t>(f.every),
                                                     .max_to_keep = 3,
                                                     .background = f.background});
    cluster.run([&](psx::Worker& w) {
      if (!f.restore.empty()) psx::checkpoint::restore(cluster, w, f.restore);
      std::uint64_t start = 0;
      if (ckpt) {
        start = ckpt->restore_or_init(w);
        const char* again = std::getenv("PSX_RESTART_COUNT");
        std::printf("%s: starts at step %llu (restart %s%s)\n", role.c_str(), static_cast<unsigned long long>(start),
                    again ? again : "0", w.rejoined() ? ", rejoined a running job" : "");
        std::fflush(stdout);
      }
      bool said = false;
      psx_zmq_test::train_for(w, f.steps, [&] {
        if (ckpt && w.clock() > start) {
          const std::uint64_t c = w.clock();
          if (c % static_cast<std::uint64_t>(f.every) == 0 && w.is_chief()) {
            std::printf("%s: saving step %llu\n", role.c_str(), static_cast<unsigned long long>(c));
            std::fflush(stdout);
          }
          ckpt->maybe_save(w);
          if (c % 7 == 0) {
            std::printf("%s: barrier at %llu\n", role.c_str(), static_cast<unsigned long long>(c));
            std::fflush(stdout);
            w.barrier();
          }
        }
        if (f.pause_ms <= 0) return;
        // Paced (the fault tests): say so once training runs, for faults.sh to wait on.
        if (!said && w.clock() >= 2) {
          std::printf("%s: training\n", role.c_str());
          std::fflush(stdout);
          said = true;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(f.pause_ms));
      }, !f.alone);
      if (ckpt) ckpt->finish(w);  // a background save still pending
      if (!f.save.empty()) {
        const auto info = psx::checkpoint::save(cluster, w, f.save);
        if (w.is_chief()) std::printf("%s: saved %s\n", role.c_str(), info.path.c_str());
      }
      if (w.is_chief() && !f.alone) {
        // What reconnects cost (faults.sh reads it).
        psx::ServerStats all;
        for (const auto& st : w.server_stats()) all += st;
        std::printf("%s: servers counted %llu requests sent again, %llu of them duplicates\n", role.c_str(),
                    static_cast<unsigned long long>(all.retried), static_cast<unsigned long long>(all.duplicates));
      }
    });
    if (z.tf.task.type == "chief") trained = psx_zmq_test::read_all(cluster);
    std::printf("%s: done\n", role.c_str());
  }
  if (z.tf.task.type != "chief" || !f.restore.empty() || !f.save.empty() || f.alone) return 0;
  if constexpr (!std::is_same_v<S, psx::sync::Synchronous>) {
    std::printf("chief: %zu servers, %zu workers, %d steps trained (no comparison: not synchronous)\n",
                config.num_servers, config.num_workers, f.steps);
    return 0;
  }
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, O> local(
      psx::ClusterConfig{config.num_servers, config.num_workers}, {}, {}, optimizer);
  declare_all(local, f);
  local.run([&](psx::Worker& w) { psx_zmq_test::train_for(w, f.steps, [] {}); });
  for (const auto& [name, values] : trained) {
    const auto expected = local.read(name);
    if (expected.size() != values.size() ||
        std::memcmp(expected.data(), values.data(), values.size() * sizeof(float)) != 0) {
      std::printf("chief: variable %s differs from the in-process cluster\n", name.c_str());
      return 1;
    }
  }
  std::printf("chief: %zu servers, %zu workers, %d steps: parameters bit-identical to the in-process cluster\n",
              config.num_servers, config.num_workers, f.steps);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  try {
    if (argc == 4 && std::string(argv[1]) == "--compare") return compare(argv[2], argv[3]);
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string flag = argv[i];
      if (flag == "--steps") f.steps = std::atoi(argv[i + 1]);
      else if (flag == "--pause-ms") f.pause_ms = std::atoi(argv[i + 1]);
      else if (flag == "--peer-timeout-ms") f.peer_timeout_ms = std::atol(argv[i + 1]);
      else if (flag == "--optimizer") f.optimizer = argv[i + 1];
      else if (flag == "--restore") f.restore = argv[i + 1];
      else if (flag == "--save") f.save = argv[i + 1];
      else if (flag == "--checkpoint") f.checkpoint = argv[i + 1];
      else if (flag == "--every") f.every = std::max(1, std::atoi(argv[i + 1]));
      else if (flag == "--ballast-mb") f.ballast_mb = std::atoi(argv[i + 1]);
      else if (flag == "--alone") f.alone = std::atoi(argv[i + 1]) != 0;
      else if (flag == "--background") f.background = std::atoi(argv[i + 1]) != 0;
      else if (flag == "--sync" && (std::string(argv[i + 1]) == "bsp" || std::string(argv[i + 1]) == "async")) f.sync = argv[i + 1];
      else {
        std::fprintf(stderr, "psx_zmq_node: unknown flag %s\n", argv[i]);
        return 2;
      }
    }
    if (f.sync == "async") return run<psx::sync::Asynchronous>(f, psx::optim::SGD{0.05f});
    if (f.optimizer == "adam") return run<psx::sync::Synchronous>(f, psx::optim::Adam{.lr = 0.01});
    if (f.optimizer == "ftrl") return run<psx::sync::Synchronous>(f, psx::optim::Ftrl{.lr = 0.05, .l1 = 0.001, .l2 = 0.001});
    return run<psx::sync::Synchronous>(f, psx::optim::SGD{0.05f});
  } catch (const psx::error& e) {
    std::printf("psx error: %s\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 4;
  }
}
