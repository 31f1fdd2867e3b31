// bench_sync: step throughput and barrier latency of each sync policy for 1,
// 2, 4 and 8 workers (2 servers, in-process), next to a no-sync baseline in
// the same run: the same per-step work (copy a 64 KiB variable in, apply a
// gradient to it) on a private array per thread, with no server at all.
//
//   ./bench_sync [steps]
//   PSX_SPIN_US=n ./bench_sync ...        with InProcess{.spin = n us} (default 100)
//   PSX_WAIT_SPIN_US=n ./bench_sync ...   with InProcess{.wait_spin = n us} (default: automatic)
#include <psx/psx.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kFloats = 16 * 1024;  // 64 KiB, split by rows over 2 servers
constexpr std::size_t kBarriers = 200;

struct Result {
  double steps_per_s;  // worker-steps per second, all workers together
  double barrier_us;   // mean time of one barrier
};

psx::transport::InProcess transport() {
  psx::transport::InProcess t;
  if (const char* us = std::getenv("PSX_SPIN_US")) t.spin = std::chrono::microseconds(std::atoi(us));
  if (const char* us = std::getenv("PSX_WAIT_SPIN_US")) t.wait_spin = std::chrono::microseconds(std::atoi(us));
  return t;
}

template <class Sync>
Result measure(std::size_t workers, std::size_t steps) {
  psx::ParameterServer<psx::partition::RowRange, Sync, psx::optim::SGD> ps({2, workers}, {}, Sync{}, {1e-6f},
                                                                          transport());
  ps.declare(psx::dense("x", {kFloats / 16, 16}));
  ps.start();
  const auto start = Clock::now();
  ps.run([&](psx::Worker& w) {
    std::vector<float> x(kFloats), g(kFloats, 1.0f);
    for (std::size_t t = 0; t < steps; ++t) {
      w.pull("x", x);
      w.push("x", g);
      w.step();
    }
  });
  const double train_s = std::chrono::duration<double>(Clock::now() - start).count();
  double barrier_s = 0;
  ps.run([&](psx::Worker& w) {
    w.barrier();  // line up before timing
    const auto b0 = Clock::now();
    for (std::size_t i = 0; i < kBarriers; ++i) w.barrier();
    if (w.is_chief()) barrier_s = std::chrono::duration<double>(Clock::now() - b0).count();
  });
  return {static_cast<double>(workers * steps) / train_s, barrier_s / kBarriers * 1e6};
}

// The same work with no synchronization: each thread copies its own 64 KiB
// "pull" and applies its own gradient.
Result baseline(std::size_t workers, std::size_t steps) {
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (std::size_t w = 0; w < workers; ++w)
    threads.emplace_back([&] {
      std::vector<float> server(kFloats, 0.5f), x(kFloats), g(kFloats, 1.0f);
      for (std::size_t t = 0; t < steps; ++t) {
        std::memcpy(x.data(), server.data(), kFloats * sizeof(float));
        for (std::size_t i = 0; i < kFloats; ++i) server[i] -= 1e-6f * g[i];
      }
      volatile float sink = x[kFloats / 2];
      (void)sink;
    });
  for (auto& t : threads) t.join();
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  return {static_cast<double>(workers * steps) / s, 0.0};
}

// SyncReplicas aggregates N-1 of N gradients (one backup worker), M >= 1.
Result sync_replicas(std::size_t workers, std::size_t steps) {
  switch (workers) {
    case 1: return measure<psx::sync::SyncReplicas<1>>(1, steps);
    case 2: return measure<psx::sync::SyncReplicas<1>>(2, steps);
    case 4: return measure<psx::sync::SyncReplicas<3>>(4, steps);
    default: return measure<psx::sync::SyncReplicas<7>>(8, steps);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t steps = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 300;
  const std::size_t counts[] = {1, 2, 4, 8};
  struct Row {
    std::string name;
    Result (*run)(std::size_t, std::size_t);
  };
  const Row rows[] = {
      {"no-sync baseline (no server)", baseline},
      {"Asynchronous", measure<psx::sync::Asynchronous>},
      {"Synchronous (BSP)", measure<psx::sync::Synchronous>},
      {"BoundedStaleness<2> (SSP)", measure<psx::sync::BoundedStaleness<2>>},
      {"SyncReplicas<N-1> (1 backup)", sync_replicas},
  };
  // Each cell is the median of kRepeats runs; the rows are interleaved per
  // repeat so every policy sees the machine in the same states.
  constexpr int kRepeats = 5;
  std::vector<std::vector<std::vector<Result>>> runs(std::size(rows),
                                                      std::vector<std::vector<Result>>(std::size(counts)));
  for (int rep = 0; rep < kRepeats; ++rep)
    for (std::size_t r = 0; r < std::size(rows); ++r)
      for (std::size_t c = 0; c < std::size(counts); ++c) runs[r][c].push_back(rows[r].run(counts[c], steps));
  auto median = [](std::vector<Result> v, double Result::*field) {
    std::sort(v.begin(), v.end(), [&](const Result& a, const Result& b) { return a.*field < b.*field; });
    return v[v.size() / 2].*field;
  };
  std::vector<std::vector<Result>> results(std::size(rows));
  for (std::size_t r = 0; r < std::size(rows); ++r)
    for (std::size_t c = 0; c < std::size(counts); ++c)
      results[r].push_back({median(runs[r][c], &Result::steps_per_s), median(runs[r][c], &Result::barrier_us)});

  std::printf("psx sync policies: %zu steps per worker, each a pull and a push of 64 KiB on 2 servers "
              "(%s), %u hardware threads; medians of %d runs\n\n", steps,
              (std::ostringstream() << transport()).str().c_str(), std::thread::hardware_concurrency(), kRepeats);
  std::printf("step throughput, worker-steps/s (all workers together)\n");
  std::printf("%-30s %10s %10s %10s %10s\n", "policy", "1 worker", "2", "4", "8");
  for (std::size_t r = 0; r < std::size(rows); ++r) {
    std::printf("%-30s", rows[r].name.c_str());
    for (const Result& res : results[r]) std::printf(" %10.0f", res.steps_per_s);
    std::printf("\n");
  }
  std::printf("\nbarrier latency, microseconds per barrier (every worker calls it; served by server 0)\n");
  std::printf("%-30s %10s %10s %10s %10s\n", "policy", "1 worker", "2", "4", "8");
  for (std::size_t r = 1; r < std::size(rows); ++r) {
    std::printf("%-30s", rows[r].name.c_str());
    for (const Result& res : results[r]) std::printf(" %10.1f", res.barrier_us);
    std::printf("\n");
  }
}
