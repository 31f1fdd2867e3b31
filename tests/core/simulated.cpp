// Tests of psx/transport/simulated.hpp: the simulated cluster gives the
// in-process result exactly under BSP, is deterministic under every policy,
// follows its network and compute model to the last bit of a double, and
// turns a cluster that can never move again into an error.
#include "../support.hpp"

#include <psx/psx.hpp>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

using psx_test::message_of;
using psx_test::Watchdog;

namespace {

constexpr std::size_t kRows = 12, kCols = 5;  // dense "w"
constexpr std::size_t kTable = 40, kDim = 4;  // sparse "emb"
constexpr float kLr = 0.05f;

std::vector<std::uint64_t> batch_ids(std::size_t w, std::size_t t) {
  std::mt19937_64 rng(1000 * w + t);
  std::vector<std::uint64_t> ids(7);
  for (auto& id : ids) id = rng() % kTable;
  ids.back() = ids.front();
  return ids;
}

void declare(auto& ps) {
  ps.declare(psx::dense("w", {kRows, kCols}, psx::Initializer::normal(0, 1, 11)));
  ps.declare(psx::sparse("emb", kTable, kDim, psx::Initializer::uniform(-1, 1, 12)));
}

// Every worker takes `steps` steps.
void train(psx::Worker& w, std::size_t steps) {
  for (std::size_t t = 0; t < steps; ++t) psx_test::toy_step(w, t, batch_ids(w.index(), t), kRows * kCols, kDim, psx_test::toy_grad);
}

using SimBsp = psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous, psx::optim::SGD,
                                    psx::transport::Simulated>;

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

psx::transport::Simulated stragglers(std::uint64_t seed) {
  return {.network = {.latency = 20e-6, .bandwidth = 1e9},
          .compute = {.step_seconds = 1e-3, .jitter = 0.3, .straggler_probability = 0.2, .straggler_slowdown = 5},
          .seed = seed};
}

struct Outcome {
  std::vector<float> w, emb;
  double now = 0;
  std::vector<double> worker_times;
  std::vector<std::uint64_t> worker_steps;
  psx::ServerStats stats;
};

template <class S>
Outcome simulate(S sync, psx::transport::Simulated sim, std::size_t workers, std::size_t steps) {
  psx::ParameterServer<psx::partition::RoundRobin, S, psx::optim::SGD, psx::transport::Simulated> ps(
      {.num_servers = 3, .num_workers = workers}, {}, sync, {kLr}, sim);
  declare(ps);
  ps.run([&](psx::Worker& w) { train(w, steps); });
  Outcome o{ps.read("w"), ps.read("emb"), sim.timeline->now(), {}, {}, ps.stats()};
  for (std::size_t k = 0; k < workers; ++k) {
    o.worker_times.push_back(sim.timeline->worker_time(k));
    o.worker_steps.push_back(sim.timeline->worker(k).steps);
  }
  return o;
}

}  // namespace

TEST_CASE("under BSP the simulated cluster reproduces the in-process parameters exactly") {
  Watchdog dog("simulated BSP");
  psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous, psx::optim::SGD> local({3, 6}, {}, {},
                                                                                                  {kLr});
  declare(local);
  local.run([](psx::Worker& w) { train(w, 8); });
  const Outcome sim = simulate(psx::sync::Synchronous{}, stragglers(1), 6, 8);
  CHECK(bit_equal(sim.w, local.read("w")));
  CHECK(bit_equal(sim.emb, local.read("emb")));
  // And the training moved the parameters (the comparison is not of two untouched tables).
  psx::ParameterServer<> fresh({1, 1});
  declare(fresh);
  CHECK_FALSE(bit_equal(sim.w, fresh.read("w")));
  CHECK_FALSE(bit_equal(sim.emb, fresh.read("emb")));
  CHECK(sim.now > 8 * 1e-3);
}

TEST_CASE_TEMPLATE("the simulated cluster is deterministic: same seed, same parameters, times and counters", S,
                   psx::sync::Asynchronous, psx::sync::BoundedStaleness<2>, psx::sync::SyncReplicas<5>,
                   psx::sync::Synchronous) {
  Watchdog dog("simulated determinism");
  const Outcome a = simulate(S{}, stragglers(7), 6, 10);
  for (int again = 0; again < 3; ++again) {
    const Outcome b = simulate(S{}, stragglers(7), 6, 10);
    CHECK(bit_equal(a.w, b.w));
    CHECK(bit_equal(a.emb, b.emb));
    CHECK(a.now == b.now);
    CHECK(a.worker_times == b.worker_times);
    CHECK(a.stats.staleness == b.stats.staleness);
    CHECK(a.stats.dropped == b.stats.dropped);
  }
  // Another seed draws other straggler steps: other times.
  const Outcome c = simulate(S{}, stragglers(8), 6, 10);
  CHECK(c.now != a.now);
}

TEST_CASE("a pull and a push take the times the network and compute model say") {
  Watchdog dog("simulated timing");
  const double L = 1e-4, B = 1e8, C = 2e-3;
  psx::transport::Simulated sim{.network = {.latency = L, .bandwidth = B, .header_bytes = 100},
                                .compute = {.step_seconds = C}};
  psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Asynchronous, psx::optim::SGD,
                       psx::transport::Simulated>
      ps({1, 1}, {}, {}, {1.0f}, sim);
  const std::size_t n = 1000;
  ps.declare(psx::dense("v", {n}, psx::Initializer::zeros()));
  std::vector<double> times;
  ps.run([&](psx::Worker& w) {
    std::vector<float> v(n), g(n, 1.0f);
    w.pull("v", v);
    times.push_back(sim.timeline->worker_time(0));
    w.push("v", g);
    times.push_back(sim.timeline->worker_time(0));
    w.step();
  });
  // The join: 116 B out (the header and its one item), 108 B back (the
  // header and the clock it is counted at, 2 floats), through both links
  // and the network each way.
  const auto hop = [&](double bytes) { return 2 * bytes / B + L; };
  const double join = hop(116) + hop(108);
  // A pull: the request (100 B + 16 B for its one item), then the answer with 4000 B of floats.
  const double pull = (2 * 116.0 / B + L) + (2 * 4100.0 / B + L);
  // A push: compute first, then 4116 B out, a 100 B answer back.
  const double push = C + (2 * 4116.0 / B + L) + hop(100);
  REQUIRE(times.size() == 2);
  CHECK(times[0] == doctest::Approx(join + pull).epsilon(1e-12));
  CHECK(times[1] == doctest::Approx(join + pull + push).epsilon(1e-12));
  CHECK(ps.read("v")[0] == -1.0f);
  const psx::transport::SimulatedWorker me = sim.timeline->worker(0);
  CHECK(me.compute == C);
  CHECK(me.steps == 1);
  CHECK(me.waiting == doctest::Approx(pull + push - C).epsilon(1e-12));
}

TEST_CASE("a persistent straggler sets the pace under BSP and not under ASP") {
  Watchdog dog("simulated straggler");
  const std::size_t workers = 8, steps = 20;
  const psx::transport::Simulated slow{.network = {.latency = 1e-6, .bandwidth = 0},
                                       .compute = {.step_seconds = 1e-3, .slow_workers = 1, .slow_factor = 4}};
  const Outcome bsp = simulate(psx::sync::Synchronous{}, slow, workers, steps);
  const Outcome asp = simulate(psx::sync::Asynchronous{}, slow, workers, steps);
  // BSP: every step but the last (no pull follows it) waits for the slow worker's 4 ms.
  CHECK(bsp.worker_times[0] >= (steps - 1) * 4e-3);
  CHECK(bsp.worker_times[0] < steps * 4e-3);
  // ASP: a fast worker needs about its own 1 ms per step; the slow one 4 ms.
  CHECK(asp.worker_times[0] < steps * 1.2e-3);
  CHECK(asp.worker_times[workers - 1] >= steps * 4e-3);
  CHECK(asp.stats.staleness.size() > 1);
}

TEST_CASE("64 workers and 256 workers run in simulated time") {
  Watchdog dog("simulated scale", std::chrono::seconds(120));
  for (std::size_t workers : {64u, 256u}) {
    const Outcome o = simulate(psx::sync::BoundedStaleness<2>{}, stragglers(3), workers, 4);
    CHECK(o.now > 4 * 1e-3);
    CHECK(o.worker_steps == std::vector<std::uint64_t>(workers, 4));
    for (double t : o.worker_times) CHECK(t > 4 * 1e-3);
  }
}

TEST_CASE("a simulated cluster that can never move again fails every waiting call with sync_error") {
  Watchdog dog("simulated deadlock");
  psx::transport::Simulated sim;
  SimBsp ps({2, 2}, {}, {}, {}, sim);
  ps.declare(psx::dense("v", {4}, psx::Initializer::zeros()));
  // Worker 0 waits at a barrier for worker 1, which waits in a pull for
  // worker 0's step: in one process this hangs forever.
  const std::string what = message_of<psx::sync_error>([&] {
    ps.run([](psx::Worker& w) {
      std::vector<float> v(4);
      if (w.index() == 0) {
        w.barrier();
      } else {
        w.step();
        w.pull("v", v);
      }
    });
  });
  CHECK(what.find("deadlocked") != std::string::npos);
  CHECK(what.find("every worker waits") != std::string::npos);
}

TEST_CASE("a worker that throws in a simulated cluster is lost like in one process") {
  Watchdog dog("simulated worker failure");
  psx::transport::Simulated sim;
  SimBsp ps({2, 3}, {}, {}, {}, sim);
  ps.declare(psx::dense("v", {4}, psx::Initializer::zeros()));
  CHECK_THROWS_WITH_AS(ps.run([](psx::Worker& w) {
    std::vector<float> v(4), g(4, 1.0f);
    for (int t = 0; t < 5; ++t) {
      if (w.index() == 2 && t == 2) throw std::runtime_error("worker 2 broke");
      w.pull("v", v);
      w.push("v", g);
      w.step();
    }
  }),
                       "worker 2 broke", std::runtime_error);
}

TEST_CASE("the simulated transport refuses settings it cannot honour") {
  using PS = SimBsp;
  {
    PS ps({.num_servers = 1, .num_workers = 1, .peer_timeout = std::chrono::milliseconds(100)}, {}, {}, {},
          psx::transport::Simulated{});
    CHECK_THROWS_WITH_AS(ps.start(), doctest::Contains("peer_timeout"), psx::config_error);
  }
  {
    PS ps({1, 1}, {}, {}, {}, psx::transport::Simulated{.network = {.latency = -1}});
    CHECK_THROWS_WITH_AS(ps.start(), doctest::Contains("network.latency"), psx::config_error);
  }
  {
    PS ps({1, 1}, {}, {}, {}, psx::transport::Simulated{.compute = {.straggler_probability = 2}});
    CHECK_THROWS_AS(ps.start(), psx::config_error);
  }
  {
    // One Simulated value drives one cluster at a time; after shutdown it may drive another.
    psx::transport::Simulated sim;
    auto first = std::make_unique<PS>(psx::ClusterConfig{1, 1}, psx::partition::RoundRobin{},
                                      psx::sync::Synchronous{}, psx::optim::SGD{}, sim);
    first->start();
    PS second({1, 1}, {}, {}, {}, sim);
    CHECK_THROWS_WITH_AS(second.start(), doctest::Contains("already drives"), psx::config_error);
    first.reset();
    CHECK_NOTHROW(second.start());
  }
  CHECK(psx::transport::Simulated{} == psx::transport::Simulated{});
  CHECK_FALSE(psx::transport::Simulated{.seed = 1} == psx::transport::Simulated{});
  std::ostringstream os;
  os << stragglers(3);
  CHECK(os.str().find("stragglers p 0.2 x5") != std::string::npos);
}

TEST_CASE("shutting a simulated cluster down releases its waiting workers") {
  Watchdog dog("simulated shutdown");
  psx::transport::Simulated sim;
  SimBsp ps({1, 2}, {}, {}, {}, sim);
  ps.declare(psx::dense("v", {4}, psx::Initializer::zeros()));
  ps.start();
  // Worker 1 is driven from a thread the link does not know of: worker 0's
  // pull of step 1 waits for it, with no deadlock verdict, until shutdown.
  psx::Worker w0 = ps.worker(0);
  std::promise<void> stepped;
  std::thread t([&] {
    std::vector<float> v(4);
    w0.step();
    stepped.set_value();
    CHECK_THROWS_AS(w0.pull("v", v), psx::shutdown_error);  // waiting, or (late) refused: either way released
  });
  // Not before the step: a step() after shutdown threw outside any check.
  stepped.get_future().wait();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ps.shutdown();
  t.join();
}

namespace {
// Stands for the user's gradient computation in the docs/studies.md example.
void gradient(const std::vector<float>& v, std::vector<float>& g) {
  for (std::size_t i = 0; i < v.size(); ++i) g[i] = v[i] - static_cast<float>(i % 7);
}
}  // namespace

TEST_CASE("the docs/studies.md example: 64 workers under SSP in simulated time") {
  Watchdog dog("simulated example", std::chrono::seconds(120));
  // example-begin simulated
  psx::transport::Simulated sim{.network = {.latency = 100e-6, .bandwidth = 1.25e9},
                                .compute = {.step_seconds = 5e-3, .straggler_probability = 0.05,
                                            .straggler_slowdown = 4},
                                .seed = 7};
  psx::ParameterServer<psx::partition::RowRange, psx::sync::BoundedStaleness<4>, psx::optim::SGD,
                       psx::transport::Simulated>
      ps({.num_servers = 4, .num_workers = 64}, {}, {}, {0.01f}, sim);
  ps.declare(psx::dense("w", {1024}, psx::Initializer::zeros()));
  ps.run([&](psx::Worker& w) {
    std::vector<float> v(1024), g(1024);
    for (int t = 0; t < 20; ++t) {
      w.pull("w", v);
      gradient(v, g);  // the worker's real code; its time is not measured
      w.push("w", g);
      w.step();
    }
  });
  std::printf("%.3f simulated seconds\n", sim.timeline->now());
  // example-end simulated
  CHECK(sim.timeline->now() > 20 * 5e-3);
  CHECK(sim.timeline->now() < 20 * 4 * 5e-3);  // SSP absorbs most straggler steps
  for (std::size_t k = 0; k < 64; ++k) CHECK(sim.timeline->worker(k).steps == 20);
  CHECK(ps.read("w")[1] > 0.0f);  // moved towards 1
}

TEST_CASE("ParameterServer::read from a worker's function, and from a thread watching the run, in simulated time") {
  // A worker's own read waits as that worker (as worker 0 it would wait
  // for an answer only its own thread could let run: the run hung). A
  // watcher's read waits as a thread of its own (standing in for worker 0
  // it let events run before that worker's clock: time went backwards).
  Watchdog dog("reads during a simulated run");
  const psx::transport::Simulated sim{.network = {.latency = 1e-5, .bandwidth = 1e9},
                                      .compute = {.step_seconds = 1e-3, .jitter = 0.5}};
  SimBsp ps({2, 3}, {}, {}, psx::optim::SGD{.lr = kLr}, sim);
  ps.declare(psx::dense("v", {16}, psx::Initializer::zeros()));
  std::atomic<bool> done{false}, watching{false};
  std::atomic<int> backwards{0}, watched{0};
  std::thread clock_watch([&] {
    double last = 0;
    while (!done) {
      const double now = sim.timeline->now();
      if (now < last) ++backwards;
      last = now;
    }
  });
  // The watcher's first read begins before the run does (on a loaded
  // machine its thread once started only after the run had ended).
  std::thread watcher([&] {
    watching = true;
    do {
      const std::vector<float> v = ps.read("v");
      CHECK(v.size() == 16);
      ++watched;
    } while (!done);
  });
  while (!watching) std::this_thread::yield();
  std::vector<float> seen;
  ps.run([&](psx::Worker& w) {
    std::vector<float> v(16);
    const std::vector<float> g(16, 1.0f);
    for (std::size_t t = 0; t < 40; ++t) {
      w.pull("v", v);
      if (w.index() == 2 && t == 30) seen = ps.read("v");  // worker 2, as an evaluator would
      w.push("v", g);
      w.step();
    }
  });
  done = true;
  clock_watch.join();
  watcher.join();
  CHECK(backwards == 0);
  CHECK(watched > 0);
  // Under BSP worker 2 read after 30 steps were applied: -30 * 3 * lr / 3 each.
  REQUIRE(seen.size() == 16);
  for (const float x : seen) CHECK(x == doctest::Approx(-30 * kLr));
  CHECK(ps.read("v")[0] == doctest::Approx(-40 * kLr));
}
