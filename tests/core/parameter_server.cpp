// Tests of psx/parameter_server.hpp, psx/worker.hpp and psx/server.hpp on the
// in-process transport: exact synchronous semantics, asynchronous training,
// frozen variables, every error of the worker API, and shutdown in any order.
#include "../support.hpp"

#include <psx/psx.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <future>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using psx_test::message_of;
using psx_test::Watchdog;

namespace {

constexpr std::size_t kWorkers = 4;
constexpr std::size_t kServers = 2;
constexpr std::size_t kSteps = 6;
constexpr std::size_t kRows = 16, kCols = 5;   // dense "w"
constexpr std::size_t kTable = 50, kDim = 4;   // sparse "emb"
constexpr std::size_t kBatch = 9;              // ids per worker per step, with repeats
constexpr float kLr = 0.05f;

// Any difference in what a worker reads shows in the result.
const auto grad = psx_test::toy_grad;

// The ids worker `w` touches at step `t`: seeded, with repeats.
std::vector<std::uint64_t> batch_ids(std::size_t w, std::size_t t) {
  std::mt19937_64 rng(1000 * w + t);
  std::vector<std::uint64_t> ids(kBatch);
  for (auto& id : ids) id = rng() % 12 + (w % 2) * 30;  // overlapping and disjoint ranges
  ids[kBatch - 1] = ids[0];                               // always one duplicate
  return ids;
}

psx::VariableSpec dense_w() { return psx::dense("w", {kRows, kCols}, psx::Initializer::normal(0, 1, 11)); }
psx::VariableSpec sparse_emb() { return psx::sparse("emb", kTable, kDim, psx::Initializer::uniform(-1, 1, 12)); }

void train_step(psx::Worker& w, std::size_t t) {
  psx_test::toy_step(w, t, batch_ids(w.index(), t), kRows * kCols, kDim, grad);
}

// One process doing SGD on the summed (or averaged) gradients of the same
// batches, each worker's gradient added in worker order.
std::pair<std::vector<float>, std::vector<float>> reference(bool mean) {
  std::vector<float> W(kRows * kCols), E(kTable * kDim);
  dense_w().init.fill("w", 0, W);
  sparse_emb().init.fill("emb", 0, E);
  for (std::size_t t = 0; t < kSteps; ++t) {
    std::vector<float> sum_w(W.size(), 0.0f), sum_e(E.size(), 0.0f);
    for (std::size_t k = 0; k < kWorkers; ++k) {
      const auto ids = batch_ids(k, t);
      std::vector<float> gw(W.size()), ge(E.size(), 0.0f);
      for (std::size_t i = 0; i < W.size(); ++i) gw[i] = grad(W[i], k, t, i);
      for (std::size_t j = 0; j < ids.size(); ++j)
        for (std::size_t c = 0; c < kDim; ++c)
          ge[ids[j] * kDim + c] += grad(E[ids[j] * kDim + c], k, t, j * kDim + c);
      for (std::size_t i = 0; i < W.size(); ++i) sum_w[i] += gw[i];
      for (std::size_t i = 0; i < E.size(); ++i) sum_e[i] += ge[i];
    }
    if (mean) {
      for (float& x : sum_w) x /= static_cast<float>(kWorkers);
      for (float& x : sum_e) x /= static_cast<float>(kWorkers);
    }
    for (std::size_t i = 0; i < W.size(); ++i) W[i] -= kLr * sum_w[i];
    for (std::size_t i = 0; i < E.size(); ++i) E[i] -= kLr * sum_e[i];
  }
  return {W, E};
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <class P>
void check_synchronous_equals_reference(psx::sync::Aggregate aggregate) {
  Watchdog dog("synchronous training");
  psx::ParameterServer<P, psx::sync::Synchronous, psx::optim::SGD> ps({kServers, kWorkers}, P{},
                                                                       {aggregate}, {kLr});
  ps.declare(dense_w());
  ps.declare(sparse_emb());
  ps.run([](psx::Worker& w) {
    for (std::size_t t = 0; t < kSteps; ++t) train_step(w, t);
  });
  const auto [W, E] = reference(aggregate == psx::sync::Aggregate::mean);
  CHECK(bit_equal(ps.read("w"), W));
  CHECK(bit_equal(ps.read("emb"), E));
}

}  // namespace

TEST_CASE_TEMPLATE("synchronous training equals one process doing SGD on the summed gradients", P,
                   psx::partition::HashByName, psx::partition::RoundRobin, psx::partition::RowRange) {
  check_synchronous_equals_reference<P>(psx::sync::Aggregate::sum);
}

TEST_CASE("synchronous mean aggregation divides the sum by the number of workers") {
  check_synchronous_equals_reference<psx::partition::RowRange>(psx::sync::Aggregate::mean);
}

TEST_CASE_TEMPLATE("initial values do not depend on the partitioner", P, psx::partition::HashByName,
                   psx::partition::RoundRobin, psx::partition::RowRange) {
  psx::ParameterServer<P> ps({3, 1});
  ps.declare(dense_w());
  ps.declare(sparse_emb());
  std::vector<float> W(kRows * kCols), E(kTable * kDim);
  dense_w().init.fill("w", 0, W);
  sparse_emb().init.fill("emb", 0, E);
  CHECK(bit_equal(ps.read("w"), W));
  CHECK(bit_equal(ps.read("emb"), E));
}

TEST_CASE("a synchronous pull waits for every worker's step") {
  Watchdog dog("synchronous pull");
  psx::ParameterServer<> ps({1, 2}, {}, {psx::sync::Aggregate::sum}, {1.0f});
  ps.declare(psx::dense("x", {1}, psx::Initializer::constant(10.0f)));
  auto w0 = ps.worker(0), w1 = ps.worker(1);
  std::vector<float> one{1.0f}, out(1);
  w0.push("x", one);
  w0.step();
  auto pending = w0.pull_async("x", out);  // needs worker 1's step 0
  w1.pull("x", out);                       // worker 1 is still at step 0: answered at once
  CHECK(out[0] == 10.0f);
  CHECK_FALSE(pending.ready());
  std::vector<float> two{2.0f};
  w1.push("x", two);
  w1.step();
  pending.wait();
  CHECK(out[0] == 7.0f);  // 10 - 1 * (1 + 2)
}

TEST_CASE("a server counts the requests it holds: its queue's depth now and at most") {
  Watchdog dog("queue depth");
  psx::ParameterServer<> ps({1, 3}, {}, {psx::sync::Aggregate::sum}, {1.0f});
  ps.declare(psx::dense("x", {1}));
  auto w0 = ps.worker(0), w1 = ps.worker(1), w2 = ps.worker(2);
  std::vector<float> out0(1), out1(1);
  w0.step();
  w1.step();
  auto p0 = w0.pull_async("x", out0);  // both need worker 2's step 0
  auto p1 = w1.pull_async("x", out1);
  while (ps.server_stats(0).waiting < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(ps.server_stats(0).waiting == 2);
  CHECK(w2.server_stats()[0].waiting == 2);  // over the transport too
  w2.step();
  p0.wait();
  p1.wait();
  // Asked over the transport: the server answers after it finished handling
  // the step that let the pulls go (read directly, the gauge may still be
  // on its way: ServerStats is exact once the server is idle).
  const psx::ServerStats st = w2.server_stats()[0];
  CHECK(st.waiting == 0);
  CHECK(st.waiting_max == 2);
}

TEST_CASE("a worker's pushes within one step add up, a worker that pushes nothing adds nothing") {
  psx::ParameterServer<> ps({1, 3}, {}, {psx::sync::Aggregate::sum}, {1.0f});
  ps.declare(psx::dense("x", {2}));
  ps.run([](psx::Worker& w) {
    if (w.index() == 0) {
      std::vector<float> g{1.0f, 2.0f};
      w.push("x", g);
      w.push("x", g);
    } else if (w.index() == 1) {
      std::vector<float> g{0.5f, 0.5f};
      w.push("x", g);
    }
    w.step();
  });
  CHECK(ps.read("x") == std::vector<float>{-2.5f, -4.5f});
}

TEST_CASE("rows pushed beside a dense push of the same variable join the worker's gradient") {
  psx::ParameterServer<> ps({1, 2}, {}, {psx::sync::Aggregate::sum}, {1.0f});
  ps.declare(psx::sparse("e", 3, 2));
  ps.run([](psx::Worker& w) {
    std::vector<std::uint64_t> ids{2, 2};
    std::vector<float> rows{1, 1, 1, 1}, dense{10, 10, 0, 0, 0, 0};
    w.push_rows("e", ids, rows);
    if (w.index() == 1) w.push("e", dense);
    w.step();
  });
  CHECK(ps.read("e") == std::vector<float>{-10, -10, 0, 0, -4, -4});
}

TEST_CASE("asynchronous pushes apply on arrival and pulls never wait") {
  Watchdog dog("asynchronous");
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous> ps({2, 1}, {}, {}, {0.5f});
  ps.declare(psx::dense("x", {4}, psx::Initializer::constant(1.0f)));
  auto w = ps.worker(0);
  std::vector<float> g(4, 1.0f), out(4);
  w.push("x", g);
  w.pull("x", out);  // no step() needed
  CHECK(out == std::vector<float>(4, 0.5f));
  w.push("x", g);
  w.pull("x", out);
  CHECK(out == std::vector<float>(4, 0.0f));
}

// Sets each element to the gradient pushed (the last push wins) and notes,
// per update, the value set and the thread that applied it.
struct LastPushWins {
  struct Log {
    std::mutex mu;
    std::vector<float> values;
    std::vector<std::thread::id> threads;
  };
  std::shared_ptr<Log> log = std::make_shared<Log>();
  std::size_t slots() const { return 0; }
  void update(std::span<float> w, std::span<const float> g, const psx::SlotView&, const psx::UpdateContext&) const {
    std::copy(g.begin(), g.end(), w.begin());
    std::lock_guard lock(log->mu);
    log->values.push_back(g[0]);
    log->threads.push_back(std::this_thread::get_id());
  }
};

TEST_CASE("in process, a blocking call is handled by its own thread unless waiters_serve is off, order holds") {
  Watchdog dog("waiters serve");
  for (const bool waiters_serve : {true, false}) {
    CAPTURE(waiters_serve);
    const LastPushWins opt;
    psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous, LastPushWins> ps(
        {1, 1}, {}, {}, opt, psx::transport::InProcess{waiters_serve});
    ps.declare(psx::dense("x", {3}));
    auto w = ps.worker(0);
    std::vector<float> out(3);
    const auto self = std::this_thread::get_id();
    auto last_by_caller = [&] {
      std::lock_guard lock(opt.log->mu);
      return opt.log->threads.back() == self;
    };
    // Blocking pushes: left to the caller, which handles them itself when
    // the server thread is not busy at that moment (it may be, by chance:
    // then it handles the push).
    int blocking = 0, by_caller = 0;
    while (blocking < 50 || (waiters_serve && by_caller == 0 && blocking < 10000)) {
      ++blocking;
      w.push("x", std::vector<float>(3, static_cast<float>(blocking)));
      by_caller += last_by_caller();
    }
    if (waiters_serve) CHECK(by_caller > 0);
    else CHECK(by_caller == 0);
    // Pushes nobody waits for at once wake the server thread: each becomes
    // ready without a wait (a link that left them queued would hang here).
    std::vector<std::vector<float>> grads;
    for (int k = 1; k <= 100; ++k) grads.emplace_back(3, static_cast<float>(blocking + k));
    std::vector<psx::Handle> handles;
    for (const auto& g : grads) handles.push_back(w.push_async("x", g));
    for (const psx::Handle& h : handles)
      while (!h.ready()) std::this_thread::yield();
    w.pull("x", out);
    CHECK(out == std::vector<float>(3, static_cast<float>(blocking + 100)));
    std::lock_guard lock(opt.log->mu);
    // One server's requests are handled in the order one worker sent them,
    // whichever threads handled them.
    REQUIRE(opt.log->values.size() == static_cast<std::size_t>(blocking) + 100);
    CHECK(std::is_sorted(opt.log->values.begin(), opt.log->values.end()));
    for (psx::Handle& h : handles) h.wait();
  }
}

// A server side for the in-process link alone: notes which thread handled
// each request and how often it ticked; `during` runs inside the first
// request that thread `during_on` handles.
struct NotingHandler final : psx::RequestHandler {
  std::mutex mu;
  std::vector<std::thread::id> threads;
  std::size_t handled = 0, ticks = 0;
  std::string events;  // 'h' per request handled, 't' per tick, in order
  std::function<void()> during;
  std::thread::id during_on;
  void handle(psx::Request&& r) noexcept override {
    std::function<void()> first;
    {
      std::lock_guard lock(mu);
      ++handled;
      events += 'h';
      threads.push_back(std::this_thread::get_id());
      if (during && std::this_thread::get_id() == during_on) first = std::exchange(during, {});
    }
    if (first) first();
    r.finish();
  }
  void drain(const ErrorFactory&) noexcept override {}
  clock_type::time_point next_tick() const noexcept override { return due_at; }
  void tick(clock_type::time_point) noexcept override {
    std::lock_guard lock(mu);
    ++ticks;
    events += 't';
  }
  void link_event(LinkEvent) noexcept override {}
  WorkerState worker_state(std::size_t) const noexcept override { return WorkerState::active; }
  clock_type::time_point due_at = clock_type::time_point::max();
};

// The link's spins (InProcess::spin) these link tests run with: none, and
// the default.
const std::chrono::microseconds link_spins[] = {std::chrono::microseconds{0}, psx::transport::InProcess{}.spin};

TEST_CASE("in process, the tick runs between requests however busy the server, whoever handles them") {
  Watchdog dog("ticks under traffic");
  for (const auto spin : link_spins) {
    for (const bool waiters_serve : {true, false}) {
      CAPTURE(waiters_serve);
      CAPTURE(spin.count());
      psx::transport::InProcess::link_type link(1, waiters_serve, spin);
      NotingHandler h;
      h.due_at = psx::RequestHandler::clock_type::time_point::min();  // always due
      std::thread server([&] { link.serve(0, h); });
      // Bursts of requests sent before any is waited for keep the inbox full.
      std::vector<std::thread> senders;
      for (int t = 0; t < 3; ++t)
        senders.emplace_back([&] {
          for (int burst = 0; burst < 20; ++burst) {
            std::vector<std::shared_ptr<psx::Completion>> done;
            for (int k = 0; k < 20; ++k) {
              done.push_back(std::make_shared<psx::Completion>(1));
              psx::Request r;
              r.done = done.back();
              link.send(0, std::move(r));
            }
            for (auto& d : done) {
              link.await(0, *d);
              d->wait();
            }
          }
        });
      for (auto& t : senders) t.join();
      link.close();
      server.join();
      std::lock_guard lock(h.mu);
      CHECK(h.handled == 3 * 20 * 20);
      // The tick is always due: one runs after every request, before the next.
      CHECK(h.events.find("hh") == std::string::npos);
    }
  }
}

TEST_CASE("in process, a spinning server and caller see each request, answer, tick and close at once") {
  // Spins far longer than the watchdog allows for the whole case: a server
  // that did not see a request (or the close) while it looks, or a caller
  // that did not see its answer, would only move when its spin ran out.
  Watchdog dog("spin");
  const auto spin = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::seconds(100));
  for (const bool waiters_serve : {false, true}) {
    CAPTURE(waiters_serve);
    psx::transport::InProcess::link_type link(1, waiters_serve, spin);
    NotingHandler h;
    std::thread server([&] { link.serve(0, h); });
    for (int k = 0; k < 200; ++k) {
      auto done = std::make_shared<psx::Completion>(1);
      psx::Request r;
      r.done = done;
      link.send(0, std::move(r));
      link.await(0, *done);
      CHECK(done->ready());  // await saw the answer before its spin ran out
      done->wait();
    }
    link.close();
    server.join();
    std::lock_guard lock(h.mu);
    CHECK(h.handled == 200);
  }
  // A tick due while the server thread looks for requests (after handling
  // one) runs on time.
  psx::transport::InProcess::link_type link(1, false, spin);
  NotingHandler h;
  h.due_at = psx::RequestHandler::clock_type::now() + std::chrono::milliseconds(200);
  std::thread server([&] { link.serve(0, h); });
  auto done = std::make_shared<psx::Completion>(1);
  psx::Request r;
  r.done = done;
  link.send(0, std::move(r));
  done->wait();
  for (;;) {
    {
      std::lock_guard lock(h.mu);
      if (h.ticks > 0) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  link.close();
  server.join();
}

TEST_CASE("in process, a waiting caller looks for wait_spin: by default long only where each thread has a core") {
  using us = std::chrono::microseconds;
  const psx::transport::InProcess defaults;
  CHECK(defaults.wait_spin_for(2, 2) == us{1000});  // one server and one worker on 2 cores
  CHECK(defaults.wait_spin_for(4, 16) == us{1000});
  CHECK(defaults.wait_spin_for(3, 2) == defaults.spin);  // more threads than cores
  CHECK(psx::transport::InProcess{.spin = us{0}}.wait_spin_for(2, 16) == us{0});  // no spin: no look at all
  CHECK(psx::transport::InProcess{.spin = us{5000}}.wait_spin_for(2, 16) == us{5000});  // never below spin
  const psx::transport::InProcess fixed{.wait_spin = us{50}};
  CHECK(fixed.wait_spin_for(2, 16) == us{50});
  CHECK(fixed.wait_spin_for(64, 2) == us{50});
  // connect hands the link the server's spin and the caller's look for this
  // cluster's threads on this process's cores.
  const std::size_t cores = psx::detail::usable_cores();
  psx::TransportContext one_each, crowded;  // one server and one worker; more threads than cores
  one_each.num_servers = one_each.num_workers = 1;
  crowded.num_servers = 2;
  crowded.num_workers = cores;
  CHECK(defaults.connect(one_each)->spin() == us{100});
  CHECK(defaults.connect(one_each)->wait_spin() == (cores >= 2 ? us{1000} : us{100}));
  CHECK(defaults.connect(crowded)->wait_spin() == us{100});
  CHECK(psx::transport::InProcess{.spin = us{0}}.connect(one_each)->wait_spin() == us{0});
  const auto both = psx::transport::InProcess{.spin = us{7}, .wait_spin = us{9}}.connect(crowded);
  CHECK(both->spin() == us{7});
  CHECK(both->wait_spin() == us{9});

  // The caller's look is its own, not the server thread's: a handler that
  // answers only once the caller is looking, and a caller that looks for
  // 100 s at a server that does not spin returns from await with its
  // answer; one that does not look, at a server that spins for 100 s,
  // returns while the handler still holds it (had it looked for the
  // server's spin, the watchdog would end the run).
  Watchdog dog("wait_spin");
  for (const bool looks : {true, false}) {
    CAPTURE(looks);
    const us long_look{100'000'000};
    psx::transport::InProcess::link_type link(1, false, looks ? us{0} : long_look, looks ? long_look : us{0});
    NotingHandler h;
    std::promise<void> go;
    std::shared_future<void> released = go.get_future().share();
    h.during = [released] { released.wait(); };
    std::thread server([&] {
      {
        std::lock_guard lock(h.mu);
        h.during_on = std::this_thread::get_id();
      }
      link.serve(0, h);
    });
    auto done = std::make_shared<psx::Completion>(1);
    {
      psx::Request r;
      r.done = done;
      link.send(0, std::move(r));
    }
    if (looks) {
      std::thread release([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the caller looks by then
        go.set_value();
      });
      link.await(0, *done);
      CHECK(done->ready());
      release.join();
    } else {
      link.await(0, *done);
      CHECK_FALSE(done->ready());  // the handler holds the answer until go
      go.set_value();
    }
    done->wait();
    link.close();
    server.join();
  }
}

TEST_CASE("in process, spin and wait_spin must be between 0 and 1 s") {
  using PS = psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::SGD>;
  for (const auto spin : {std::chrono::microseconds{-1}, std::chrono::microseconds{1'000'001}}) {
    CAPTURE(spin.count());
    PS ps({1, 1}, {}, {}, psx::optim::SGD{0.1f}, psx::transport::InProcess{.spin = spin});
    ps.declare(psx::dense("x", {2}));
    CHECK_THROWS_WITH_AS(ps.start(), doctest::Contains("InProcess::spin must be between 0 and 1 s"), psx::config_error);
    PS waits({1, 1}, {}, {}, psx::optim::SGD{0.1f}, psx::transport::InProcess{.wait_spin = spin});
    waits.declare(psx::dense("x", {2}));
    const std::string message =
        "InProcess::wait_spin must be between 0 and 1 s, got " + std::to_string(spin.count()) + " us";
    CHECK_THROWS_WITH_AS(waits.start(), doctest::Contains(message.c_str()), psx::config_error);
  }
  for (const auto spin : {std::chrono::microseconds{0}, std::chrono::microseconds{1'000'000}}) {
    for (const bool caller : {false, true}) {
      CAPTURE(spin.count());
      CAPTURE(caller);
      psx::transport::InProcess t;
      if (caller) t.wait_spin = spin;
      else t.spin = spin;
      PS ps({1, 1}, {}, {}, psx::optim::SGD{0.1f}, t);
      ps.declare(psx::dense("x", {2}));
      ps.run([](psx::Worker& w) {
        std::vector<float> x(2);
        w.pull("x", x);
        w.push("x", std::vector<float>{1, 1});
      });
      CHECK(ps.read("x") == std::vector<float>{-0.1f, -0.1f});
    }
  }
}

TEST_CASE("in process, a thread handling a server's inbox for others takes only what was queued then") {
  Watchdog dog("bounded help");
  for (const auto spin : link_spins) {
    CAPTURE(spin.count());
    psx::transport::InProcess::link_type link(1, true, spin);
    NotingHandler h;
    std::thread server([&] { link.serve(0, h); });
    // A message nobody waits for, to an idle server, is handled by its
    // sender (tried until the server thread is idle when it arrives), while
    // three requests come from another thread: those go to the server thread.
    std::vector<std::shared_ptr<psx::Completion>> later;
    for (int k = 0; k < 3; ++k) later.push_back(std::make_shared<psx::Completion>(1));
    const auto self = std::this_thread::get_id();
    {
      std::lock_guard lock(h.mu);
      h.during = [&] {
        std::thread other([&] {
          for (auto& d : later) {
            psx::Request r;
            r.done = d;
            link.send(0, std::move(r));
          }
        });
        other.join();
      };
      h.during_on = self;
    }
    std::size_t sent = 0;
    for (;;) {
      link.send(0, psx::Request{});  // no completion: fire and forget
      ++sent;
      {
        std::lock_guard lock(h.mu);
        if (!h.during) break;  // it ran: this thread handled the message
      }
      REQUIRE(sent < 10000);
      // The server thread had not started, or was busy: let it finish.
      for (;;) {
        {
          std::lock_guard lock(h.mu);
          if (h.handled == sent) break;
        }
        std::this_thread::yield();
      }
    }
    for (auto& d : later) d->wait();
    link.close();
    server.join();
    std::lock_guard lock(h.mu);
    REQUIRE(h.threads.size() == sent + 3);
    CHECK(h.threads[sent - 1] == self);  // the message, by its sender
    for (std::size_t k = sent; k < sent + 3; ++k) CHECK(h.threads[k] != self);  // the others, by the server thread
  }
}

TEST_CASE("asynchronous training with 4 workers converges on a convex problem") {
  Watchdog dog("asynchronous convergence");
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous> ps({2, 4}, {}, {}, {0.1f});
  ps.declare(psx::dense("x", {8}));
  std::vector<float> target{1, -2, 3, -4, 5, -6, 7, -8};
  ps.run([&](psx::Worker& w) {
    std::vector<float> x(8), g(8);
    for (int t = 0; t < 200; ++t) {
      w.pull("x", x);
      for (std::size_t i = 0; i < 8; ++i) g[i] = x[i] - target[i];  // grad of |x - target|^2 / 2
      w.push("x", g);
      w.step();
    }
  });
  const auto x = ps.read("x");
  for (std::size_t i = 0; i < 8; ++i) CHECK(x[i] == doctest::Approx(target[i]).epsilon(1e-3));
}

TEST_CASE("a frozen variable is served and never changes") {
  psx::ParameterServer<psx::partition::RoundRobin> ps({2, 2}, {}, {}, {0.1f});
  ps.declare(dense_w());
  ps.declare(psx::dense("frozen", {3, 2}, psx::Initializer::normal(0, 1, 5), /*trainable=*/false));
  const auto before = ps.read("frozen");
  ps.run([](psx::Worker& w) {
    std::vector<float> f(6), g(kRows * kCols, 1.0f);
    for (int t = 0; t < 3; ++t) {
      w.pull("frozen", f);
      w.push("w", g);
      w.step();
    }
    CHECK_THROWS_AS(w.push("frozen", f), psx::frozen_variable);
  });
  CHECK(bit_equal(ps.read("frozen"), before));
  CHECK_FALSE(bit_equal(ps.read("w"), [] {
    std::vector<float> W(kRows * kCols);
    dense_w().init.fill("w", 0, W);
    return W;
  }()));
}

TEST_CASE("every misuse of the worker API raises a typed error naming the variable and sizes") {
  psx::ParameterServer<psx::partition::RowRange> ps({2, 1});
  ps.declare(dense_w());
  ps.declare(sparse_emb());
  ps.declare(psx::dense("frozen", {2}, psx::Initializer::zeros(), false));
  auto w = ps.worker(0);
  std::vector<float> small(3), rows(2 * kDim);

  CHECK(message_of<psx::unknown_variable>([&] { w.pull("nope", small); }) ==
        "psx: worker 0: pull of unknown variable 'nope' (declared: emb, frozen, w)");
  CHECK(message_of<psx::shape_error>([&] { w.pull("w", small); }) ==
        "psx: worker 0: pull of variable 'w' of shape [16, 5] (80 floats) with a buffer of 3 floats");
  CHECK(message_of<psx::shape_error>([&] { w.push("w", small); }) ==
        "psx: worker 0: push of variable 'w' of shape [16, 5] (80 floats) with a buffer of 3 floats");
  const std::vector<std::uint64_t> bad_ids{3, 50};
  CHECK(message_of<psx::row_out_of_range>([&] { w.pull_rows("emb", bad_ids, rows); }) ==
        "psx: worker 0: pull_rows of variable 'emb' (50 rows): row id 50 at position 1 is out of range");
  CHECK_THROWS_AS(w.push_rows("emb", bad_ids, rows), psx::row_out_of_range);
  const std::vector<std::uint64_t> three{1, 2, 3};
  CHECK(message_of<psx::shape_error>([&] { w.pull_rows("emb", three, rows); }) ==
        "psx: worker 0: pull_rows of 3 rows of variable 'emb' (row width 4) needs 12 floats, the buffer has 8 floats");
  std::vector<float> two(2);
  CHECK(message_of<psx::frozen_variable>([&] { w.push("frozen", two); }) ==
        "psx: worker 0: push to variable 'frozen' of shape [2], which is frozen (trainable = false)");
  CHECK(message_of<psx::unknown_variable>([&] { w.push_rows("nope", three, rows); }).find("'nope'") !=
        std::string::npos);

  CHECK(message_of<psx::duplicate_variable>([&] { ps.declare(psx::dense("w", {2, 2})); }) ==
        "psx: variable 'w' is already declared (shape [16, 5]); the second declaration has shape [2, 2]");
  CHECK(message_of<psx::config_error>([&] { ps.declare(psx::dense("late", {2})); }).find("after the cluster started") !=
        std::string::npos);
  CHECK_THROWS_AS(ps.worker(1), psx::config_error);
  CHECK_THROWS_AS((psx::ParameterServer<>({0, 1})), psx::config_error);

  ps.shutdown();
  CHECK(message_of<psx::shutdown_error>([&] { w.pull("w", small); }) ==
        "psx: worker 0: pull after the cluster shut down");
  CHECK_THROWS_AS(w.step(), psx::shutdown_error);
  CHECK_THROWS_AS(w.barrier(), psx::shutdown_error);
  CHECK(message_of<psx::shutdown_error>([&] { ps.read("w"); }) == "psx: read() after shutdown()");
  CHECK(message_of<psx::shutdown_error>([&] { ps.run([](psx::Worker&) {}); }) == "psx: run() after shutdown()");
  CHECK(message_of<psx::shutdown_error>([&] { ps.worker(0); }) == "psx: worker() after shutdown()");
  CHECK(message_of<psx::shutdown_error>([&] { ps.start(); }) == "psx: start() after shutdown()");
}

TEST_CASE("what declare returns outlives later declarations, the cluster's own lookups name themselves") {
  psx::ParameterServer<psx::partition::RowRange> ps({2, 1});
  // It was a reference into the cluster's vector, which later declarations reallocated.
  const auto& first = ps.declare(dense_w());
  for (int k = 0; k < 40; ++k) ps.declare(psx::dense("extra" + std::to_string(k), {1}));
  CHECK(first.meta.name == "w");
  CHECK(first.meta.shape == std::vector<std::size_t>{kRows, kCols});
  CHECK(first.shards.size() == 2);
  CHECK(message_of<psx::unknown_variable>([&] { (void)ps.variable("nope"); })
            .starts_with("psx: ParameterServer::variable of unknown variable 'nope' (declared: extra0, "));
  CHECK(message_of<psx::unknown_variable>([&] { (void)ps.read("nope"); })
            .starts_with("psx: ParameterServer::read of unknown variable 'nope'"));
  CHECK(message_of<psx::unknown_variable>([&] { (void)ps.table_stats("nope"); })
            .starts_with("psx: ParameterServer::table_stats of unknown variable 'nope'"));
  CHECK(message_of<psx::unknown_variable>([&] { (void)ps.export_table("nope"); })
            .starts_with("psx: ParameterServer::export_table of unknown variable 'nope'"));
}

TEST_CASE("a user partitioner whose placement does not tile the rows is refused at declaration") {
  struct Gappy {
    std::vector<psx::Shard> place(const psx::VariableMeta& v, std::size_t) const { return {{0, 1, v.rows}}; }
  };
  psx::ParameterServer<Gappy> ps({1, 1});
  CHECK(message_of<psx::config_error>([&] { ps.declare(psx::dense("w", {4})); }) ==
        "psx: invalid placement of variable 'w' (4 rows, 1 servers): shard 0 covers rows [1, 4) but the next "
        "row to cover is 0");
}

TEST_CASE("sparse rows spread over several servers come back in the caller's order") {
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous> ps({3, 1});
  ps.declare(psx::sparse("e", 30, 2, psx::Initializer::uniform(0, 1, 3)));
  const auto all = ps.read("e");
  auto w = ps.worker(0);
  const std::vector<std::uint64_t> ids{29, 0, 15, 15, 7, 22};
  std::vector<float> out(ids.size() * 2, -1.0f);
  w.pull_rows("e", ids, out);
  for (std::size_t j = 0; j < ids.size(); ++j) {
    CHECK(out[2 * j] == all[2 * ids[j]]);
    CHECK(out[2 * j + 1] == all[2 * ids[j] + 1]);
  }
  w.pull_rows("e", {}, {});  // nothing to do, nothing sent
}

TEST_CASE("batched pulls and pushes and async handles") {
  psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous> ps({1, 1}, {}, {}, {1.0f});
  ps.declare(psx::dense("a", {2}, psx::Initializer::constant(1)));
  ps.declare(psx::dense("b", {3}, psx::Initializer::constant(2)));
  auto w = ps.worker(0);
  std::vector<float> a(2), b(3), ga{1, 1}, gb{1, 1, 1};
  w.push({{"a", ga}, {"b", gb}});
  w.pull({{"a", a}, {"b", b}});
  CHECK(a == std::vector<float>{0, 0});
  CHECK(b == std::vector<float>{1, 1, 1});
  {
    auto h = w.push_async("a", ga);
  }  // a dropped handle waits
  auto h = w.pull_async("a", a);
  h.wait();
  CHECK(h.ready());
  CHECK(a == std::vector<float>{-1, -1});
  CHECK_THROWS_AS(w.pull({{"a", a}, {"c", b}}), psx::unknown_variable);
}

TEST_CASE("variables bound for one server travel in one message") {
  psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Asynchronous> ps({2, 1});
  ps.declare(psx::dense("a", {4}));  // server 0
  ps.declare(psx::dense("b", {4}));  // server 1
  ps.declare(psx::dense("c", {8}));  // server 0
  auto w = ps.worker(0);
  std::vector<float> a(4), b(4), c(8);
  const auto before0 = ps.server_stats(0), before1 = ps.server_stats(1);
  w.pull({{"a", a}, {"b", b}, {"c", c}});
  w.push({{"a", a}, {"c", c}});
  const auto after0 = ps.server_stats(0), after1 = ps.server_stats(1);
  CHECK(after0.requests - before0.requests == 2);  // one pull, one push
  CHECK(after1.requests - before1.requests == 1);  // one pull
  CHECK(after0.bytes_out - before0.bytes_out == 12 * sizeof(float));
  CHECK(after0.bytes_in - before0.bytes_in == 12 * sizeof(float));
  CHECK(after1.bytes_in == before1.bytes_in);
  CHECK_THROWS_AS(ps.server_stats(2), psx::config_error);
}

TEST_CASE("a worker collects every server's counters over the transport") {
  psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Asynchronous, psx::optim::SGD> ps({2, 1});
  ps.declare(psx::dense("a", {4}));  // server 0
  ps.declare(psx::dense("b", {6}));  // server 1
  auto w = ps.worker(0);
  std::vector<float> a(4), b(6, 1.0f);
  w.pull({{"a", a}, {"b", b}});
  w.push("b", b);
  w.push("b", b);
  const std::vector<psx::ServerStats> got = w.server_stats();
  REQUIRE(got.size() == 2);
  // What the servers hold now, the stats request itself included.
  CHECK(got[0] == ps.server_stats(0));
  CHECK(got[1] == ps.server_stats(1));
  CHECK(got[0].requests == 2);  // the pull, the stats request
  CHECK(got[1].requests == 4);  // the pull, two pushes, the stats request
  CHECK(got[1].pushes == 2);
  CHECK(got[1].bytes_in == 12 * sizeof(float));
  CHECK(got[0].bytes_out == 4 * sizeof(float));
  CHECK(got[1].parameter_bytes == 6 * sizeof(float));
  CHECK(got[1].staleness.size() == psx::staleness_buckets);
  std::uint64_t applied = 0;
  for (auto n : got[1].staleness) applied += n;
  CHECK(applied == 2);
  CHECK(got[1].staleness[0] == 1);  // the first push: against the version pulled
  CHECK(got[1].staleness[1] == 1);  // the second: one update later
  psx::ServerStats sum = got[0];
  sum += got[1];
  CHECK(sum.requests == 6);
  CHECK(sum.parameter_bytes == 10 * sizeof(float));
}

TEST_CASE("barrier releases every worker together") {
  Watchdog dog("barrier");
  psx::ParameterServer<> ps({2, 4});
  std::atomic<int> arrived{0};
  std::atomic<bool> early{false};
  ps.run([&](psx::Worker& w) {
    for (int round = 1; round <= 3; ++round) {
      arrived.fetch_add(1);
      w.barrier();
      if (arrived.load() < round * 4) early = true;
      w.barrier();
    }
  });
  CHECK_FALSE(early.load());
}

TEST_CASE("workers with unequal step counts finish") {
  Watchdog dog("unequal steps");
  psx::ParameterServer<> ps({2, 4}, {}, {}, {0.1f});
  ps.declare(psx::dense("x", {4}));
  ps.run([](psx::Worker& w) {
    std::vector<float> x(4), g(4, 1.0f);
    for (std::size_t t = 0; t < 2 + w.index(); ++t) {
      w.pull("x", x);
      w.push("x", g);
      w.step();
    }
  });
  // A second run continues the clocks where they stopped.
  ps.run([](psx::Worker& w) {
    std::vector<float> x(4), g(4, 1.0f);
    w.pull("x", x);
    w.push("x", g);
    w.step();
  });
  CHECK(ps.read("x")[0] < 0.0f);
}

TEST_CASE("a worker that throws under Synchronous fails the others with peer_lost, run() rethrows its exception") {
  Watchdog dog("worker failure");
  psx::ParameterServer<> ps({2, 4}, {}, {}, {0.1f});
  ps.declare(psx::dense("x", {4}));
  std::atomic<int> lost{0};
  CHECK_THROWS_WITH_AS(ps.run([&](psx::Worker& w) {
    std::vector<float> x(4), g(4, 1.0f);
    try {
      for (int t = 0; t < 10; ++t) {
        if (w.index() == 2 && t == 3) throw std::runtime_error("boom");
        w.pull("x", x);  // the others end up waiting here for worker 2
        w.push("x", g);
        w.step();
      }
    } catch (const psx::peer_lost& e) {
      if (std::string(e.what()).find("worker 2 was lost (its function threw: boom)") != std::string::npos) ++lost;
      throw;
    }
  }), "boom", std::runtime_error);
  CHECK(lost.load() == 3);
  // The failure is final for this cluster: a second run is told why, and
  // reads are still answered.
  const std::string again = psx_test::message_of<psx::peer_lost>([&] { ps.run([](psx::Worker&) {}); });
  CHECK(again.find("worker 2 was lost (its function threw: boom)") != std::string::npos);
  CHECK(again.find("since then this cluster answers reads and stats only (to go on, make a new ParameterServer and "
                   "restore a checkpoint)") != std::string::npos);
  CHECK(ps.read("x").size() == 4);
}

// psx_test::drop_a_kept_pull on a cluster of 2 workers.
template <class Cluster>
void drop_a_kept_pull(Cluster& ps, const std::function<void(psx::Handle&)>& drop) {
  ps.declare(psx::dense("x", {4}));
  ps.run([&](psx::Worker& w) { psx_test::drop_a_kept_pull(w, drop); });
}

TEST_CASE("a pull left unwaited that waits on a worker waiting for this one is cancelled, not waited for") {
  Watchdog dog("unwaited pull");
  SUBCASE("the worker throws: run() rethrows, the others are told") {
    psx::ParameterServer<> ps({2, 2}, {}, {}, {0.1f});
    CHECK_THROWS_WITH_AS(drop_a_kept_pull(ps, [](psx::Handle&) { throw std::runtime_error("boom"); }), "boom",
                         std::runtime_error);
  }
  SUBCASE("the handle is assigned over: the worker goes on, its pull answers nothing") {
    psx::ParameterServer<> ps({2, 2}, {}, {}, {0.1f});
    drop_a_kept_pull(ps, [](psx::Handle& h) { h = psx::Handle(); });
    CHECK(ps.read("x") == std::vector<float>(4, -0.2f));  // both steps: 0.1 x the mean gradient, 1, twice
    for (std::size_t s = 0; s < 2; ++s) {
      CHECK(ps.server_stats(s).errors == 0);  // a cancelled pull is not a failed request
      CHECK(ps.server_stats(s).waiting == 0);
    }
  }
  SUBCASE("the same with the waiting callers serving the inboxes") {
    psx::ParameterServer<> ps({2, 2}, {}, {}, {0.1f}, psx::transport::InProcess{.waiters_serve = true});
    drop_a_kept_pull(ps, [](psx::Handle& h) { h = psx::Handle(); });
    CHECK(ps.read("x") == std::vector<float>(4, -0.2f));
  }
  SUBCASE("the same in a simulated cluster, where the cancel travels as a message too") {
    // (Without the cancel the simulation finds every worker waiting and
    // fails the run with sync_error.)
    psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD, psx::transport::Simulated>
        ps({2, 2}, {}, {}, {0.1f});
    drop_a_kept_pull(ps, [](psx::Handle& h) { h = psx::Handle(); });
    CHECK(ps.read("x") == std::vector<float>(4, -0.2f));
  }
}

TEST_CASE("a pull dropped unwaited that no server keeps is answered as before") {
  Watchdog dog("cancel");
  psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous> ps({1, 1});
  ps.declare(psx::dense("x", {4}, psx::Initializer::constant(3.0f)));
  auto w = ps.worker(0);
  std::vector<float> x(4);
  for (int k = 0; k < 100; ++k) {
    psx::Handle dropped = w.pull_async("x", x);  // never kept (Asynchronous): a cancel finds it answered
  }
  CHECK(x == std::vector<float>(4, 3.0f));
  CHECK(ps.server_stats(0).errors == 0);
  CHECK(ps.server_stats(0).pulls == 100);
  w.leave();
}

TEST_CASE("shutdown releases a worker blocked in a pull") {
  Watchdog dog("shutdown while blocked");
  psx::ParameterServer<> ps({1, 2});
  ps.declare(psx::dense("x", {1}));
  auto w0 = ps.worker(0);
  std::vector<float> out(1);
  w0.step();  // worker 1 never steps: the pull can never be answered
  auto blocked = std::async(std::launch::async, [&] { w0.pull("x", out); });
  ps.shutdown();
  CHECK_THROWS_AS(blocked.get(), psx::shutdown_error);
  ps.shutdown();  // twice is fine
}

TEST_CASE("clusters shut down in any state") {
  Watchdog dog("shutdown orders");
  { psx::ParameterServer<> never_started({2, 2}); }
  {
    psx::ParameterServer<> started({2, 2});
    started.start();
  }
  {
    psx::ParameterServer<> ps({2, 2});
    auto w = ps.worker(1);
    w.step();
    auto blocked = std::async(std::launch::async, [&] { w.barrier(); });  // worker 0 never comes
    ps.shutdown();
    CHECK_THROWS_AS(blocked.get(), psx::shutdown_error);
  }
}

TEST_CASE("a Handle may outlive its cluster, waiting on it then reads nothing of the cluster") {
  // Its waiter used the cluster's state, freed with it: a heap-use-after-free
  // that only the AddressSanitizer preset sees (the result here is right
  // either way).
  std::vector<float> out(4), other(4);
  psx::Handle finished, dropped;
  {
    psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous> ps({1, 1, std::chrono::seconds(1)});
    ps.declare(psx::dense("x", {4}, psx::Initializer::constant(2.0f)));
    auto w = ps.worker(0);
    finished = w.pull_async("x", out);
    dropped = w.pull_async("x", other);
    while (!finished.ready() || !dropped.ready()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  finished.wait();
  CHECK(out == std::vector<float>(4, 2.0f));
}

namespace {
// The k-th allocation of the calling thread fails, for k = 0, 1, ...: before
// the workers joined, while their threads start (each std::thread allocates
// its state; a failure there was std::terminate: threads started were still
// joinable), or not at all. The workers started wait for each other's steps
// (Synchronous): the missing ones must fail, not be waited for (a simulated
// cluster also waited for them to end). Returns whether some k failed with
// worker threads running.
template <class Cluster>
bool run_without_memory(const std::function<std::unique_ptr<Cluster>()>& make) {
  bool failed_with_threads_running = false;
  for (long k = 0; k < 80; ++k) {
    CAPTURE(k);
    Watchdog dog("run without memory");
    std::unique_ptr<Cluster> ps = make();
    ps->declare(psx::dense("x", {4}));
    ps->start();
    std::atomic<int> entered{0};
    std::string outcome = "returned";
    psx_test::fail_allocation(k);
    try {
      ps->run([&](psx::Worker& w) {
        ++entered;
        std::vector<float> x(4), g(4, 1.0f);
        for (int s = 0; s < 3; ++s) {
          w.pull("x", x);
          w.push("x", g);
          w.step();
        }
      });
    } catch (const std::bad_alloc&) {
      outcome = "bad_alloc";
    } catch (const std::exception& e) {
      outcome = e.what();
    }
    psx_test::fail_allocation(-1);
    CHECK((outcome == "returned" || outcome == "bad_alloc"));
    if (outcome == "bad_alloc" && entered > 0) failed_with_threads_running = true;
    if (outcome == "returned") break;  // k is past run()'s allocations
  }
  return failed_with_threads_running;
}
}  // namespace

TEST_CASE("run() without memory or a thread for a worker throws, and no worker waits for the missing one") {
  if (!psx_test::can_fail_allocations()) {
    MESSAGE("skipped: no allocation-failure hook in this build (ThreadSanitizer)");
    return;
  }
  using InProcess = psx::ParameterServer<>;
  CHECK(run_without_memory<InProcess>([] { return std::make_unique<InProcess>(psx::ClusterConfig{2, 3}); }));
  using Simulated = psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous, psx::optim::SGD,
                                         psx::transport::Simulated>;
  CHECK(run_without_memory<Simulated>([] {
    return std::make_unique<Simulated>(psx::ClusterConfig{2, 3}, psx::partition::RoundRobin{},
                                       psx::sync::Synchronous{}, psx::optim::SGD{0.1f}, psx::transport::Simulated{});
  }));
}

TEST_CASE("a start that fails leaves nothing half-started") {
  Watchdog dog("failed start");
  psx::ParameterServer<psx::partition::HashByName, psx::sync::SyncReplicas<3>> ps({1, 2});
  ps.declare(psx::dense("x", {1}));
  CHECK_THROWS_AS(ps.start(), psx::config_error);
  CHECK_FALSE(ps.running());
  CHECK_THROWS_AS(ps.start(), psx::config_error);   // the same answer again, not a silent success
  CHECK_THROWS_AS(ps.read("x"), psx::config_error);  // and nothing waits on servers that never ran
}

TEST_CASE("peer_timeout is checked") {
  CHECK_THROWS_AS((psx::ParameterServer<>({.num_servers = 1, .num_workers = 1,
                                           .peer_timeout = std::chrono::hours(24 * 400)})),
                  psx::config_error);
  CHECK_THROWS_AS((psx::ParameterServer<>({.num_servers = 1, .num_workers = 1,
                                           .peer_timeout = std::chrono::milliseconds(-1)})),
                  psx::config_error);
}

TEST_CASE("read() watches a running cluster from another thread, and from a worker's function") {
  // The watcher's read must not touch worker 0's clock, which worker 0's
  // thread steps meanwhile (ThreadSanitizer saw that race).
  Watchdog dog("read while running");
  psx::ParameterServer<psx::partition::RoundRobin, psx::sync::Synchronous, psx::optim::SGD> ps({2, 3}, {}, {},
                                                                                              {0.5f});
  ps.declare(psx::dense("v", {8}, psx::Initializer::zeros()));
  std::atomic<bool> done{false};
  std::atomic<int> reads{0};
  std::thread watcher([&] {
    float last = 0;
    while (!done) {
      const float now = ps.read("v")[0];
      CHECK(now <= last);  // steps only ever lower it
      last = now;
      ++reads;
    }
  });
  std::vector<float> seen;
  ps.run([&](psx::Worker& w) {
    std::vector<float> v(8);
    const std::vector<float> g(8, 1.0f);
    for (std::size_t t = 0; t < 50; ++t) {
      w.pull("v", v);
      if (w.index() == 1 && t == 20) seen = ps.read("v");
      w.push("v", g);
      w.step();
    }
  });
  done = true;
  watcher.join();
  CHECK(reads > 0);
  REQUIRE(seen.size() == 8);
  CHECK(seen[0] == -10.0f);  // 20 steps of 0.5 x the mean gradient, 1
  CHECK(ps.read("v")[0] == -25.0f);
}

TEST_CASE("workers on threads of one's own leave explicitly") {
  Watchdog dog("explicit leave");
  psx::ParameterServer<> ps({1, 2}, {}, {}, {1.0f});
  ps.declare(psx::dense("x", {1}));
  auto w0 = ps.worker(0), w1 = ps.worker(1);
  std::thread t0([&] {
    std::vector<float> x(1), g{1.0f};
    w0.pull("x", x);
    w0.push("x", g);
    w0.step();
    w0.leave();  // done after one step
  });
  std::thread t1([&] {
    std::vector<float> x(1), g{1.0f};
    for (int t = 0; t < 3; ++t) {  // would wait for worker 0 forever without leave()
      w1.pull("x", x);
      w1.push("x", g);
      w1.step();
    }
    w1.pull("x", x);
  });
  t0.join();
  t1.join();
  CHECK(ps.read("x")[0] == -3.0f);  // step 0: mean of 1 and 1; steps 1, 2: worker 1 alone
}

TEST_CASE("a worker that left cannot enter a barrier (it would let a worker still training through early)") {
  Watchdog dog("barrier after leave");
  psx::ParameterServer<> ps({2, 3});
  ps.declare(psx::dense("x", {4}));
  auto w0 = ps.worker(0), w1 = ps.worker(1), w2 = ps.worker(2);
  w0.leave();
  const std::string m = message_of<psx::sync_error>([&] { w0.barrier(); });  // from either server
  const std::string left = ": a barrier from worker 0, which has left the cluster (Worker::leave, or the end of its "
                           "function in run(); it counts again from the next run())";
  CHECK((m == "psx: server 0" + left || m == "psx: server 1" + left));
  std::thread t1([&] { w1.barrier(); });
  w2.barrier();  // the two still training meet
  t1.join();
}

namespace {
// A server driven by hand, as a transport between processes would drive it.
template <class Sync = psx::sync::Synchronous>
struct HandServer {
  std::vector<psx::VariableInfo> vars;
  std::unique_ptr<psx::Server<Sync, psx::optim::SGD>> server;
  explicit HandServer(Sync sync = {}, std::size_t workers = 2) {
    psx::VariableInfo x;
    x.meta = psx::detail::make_meta(psx::dense("x", {4}), 0);
    x.shards = {{0, 0, 4}};
    vars.push_back(x);
    psx::VariableInfo e;  // rows [0, 3) on another server, [3, 8) here
    e.meta = psx::detail::make_meta(psx::sparse("e", 8, 2), 1);
    e.shards = {{1, 0, 3}, {0, 3, 8}};
    vars.push_back(e);
    server = std::make_unique<psx::Server<Sync, psx::optim::SGD>>(0, workers, vars, sync, psx::optim::SGD{1.0f});
  }
  // Handles `r` and returns the error it finished with ("" if none).
  std::string send(psx::Request r) {
    auto done = std::make_shared<psx::Completion>(1);
    r.done = done;
    server->handle(std::move(r));
    REQUIRE(done->ready());
    try {
      done->wait();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }
  // Everything this server holds, read without touching any clock.
  std::vector<float> snapshot() {
    std::vector<float> all(4 + 5 * 2);
    psx::Request r;
    r.op = psx::Op::read;
    r.items.push_back({0, 0, {}, {}, {}, std::span(all).first(4), {}});
    r.items.push_back({1, 1, {}, {}, {}, std::span(all).subspan(4), {}});
    REQUIRE(send(std::move(r)).empty());
    return all;
  }
};
psx::Request op(psx::Op o, std::uint32_t worker, std::uint64_t clock = 0) {
  psx::Request r;
  r.op = o;
  r.worker = worker;
  r.clock = clock;
  return r;
}
}  // namespace

TEST_CASE("a server refuses requests it cannot trust, and keeps serving") {
  HandServer<> h;
  CHECK(h.send(op(psx::Op::clock, 0, 1)).empty());
  CHECK(h.send(op(psx::Op::clock, 0, 1'000'000'000)) == "psx: server 0: worker 0 jumped from clock 1 to 1000000000");
  CHECK(h.send(op(psx::Op::join, 1, 99)) == "psx: server 0: worker 1 joins at clock 99, beyond every clock seen (1)");
  CHECK(h.send(op(psx::Op::pull, 7)) == "psx: server 0: request from worker 7 of 2");
  psx::Request bad = op(psx::Op::pull, 0, 0);
  std::vector<float> out(3);
  bad.items.push_back({0, 0, {}, {}, {}, out, {}});
  CHECK(h.send(std::move(bad)) == "psx: server 0, request from worker 0: variable 'x' shard has 4 floats, the request "
                                  "carries 3");
  psx::Request ghost = op(psx::Op::pull, 0, 0);
  ghost.items.push_back({5, 0, {}, {}, {}, out, {}});
  CHECK(h.send(std::move(ghost)).find("which this server does not hold") != std::string::npos);
  const std::vector<float> before = h.snapshot();
  // Row buffers of whole rows, one per id where no positions say otherwise:
  // the floats beyond them were ignored, and a table refused a pull halfway.
  std::vector<std::uint64_t> ids = {3, 4};
  std::vector<float> grads(6, 1.0f);
  for (const std::size_t floats : {6, 5, 3}) {
    psx::Request push = op(psx::Op::push_rows, 0, 0);
    push.items.push_back({1, 1, ids, {}, std::span(grads).first(floats), {}, {}});
    CHECK(h.send(std::move(push)) == "psx: server 0, request from worker 0: variable 'e': a buffer of " +
                                         std::to_string(floats) + " elements, not 2 rows of 2");
  }
  std::vector<std::uint32_t> positions = {0, 1};
  psx::Request placed = op(psx::Op::pull_rows, 0, 0);
  placed.items.push_back({1, 1, ids, positions, {}, std::span(grads).first(5), {}});
  CHECK(h.send(std::move(placed)) ==
        "psx: server 0, request from worker 0: variable 'e': a buffer of 5 elements, not whole rows of 2");
  // A step counts from 1 (clock + 1): the last clock would make it 0.
  psx::Request wrapping = op(psx::Op::push_rows, 0, std::numeric_limits<std::uint64_t>::max());
  wrapping.items.push_back({1, 1, ids, {}, std::span(grads).first(4), {}, {}});
  CHECK(h.send(std::move(wrapping)) == "psx: server 0, request from worker 0: clock 18446744073709551615, whose "
                                       "step would wrap to 0");
  CHECK(h.server->stats().errors == 10);
  CHECK(h.snapshot() == before);
}

TEST_CASE("a cancel finishes the kept pull it names (that worker's, that call) with an error, nothing else") {
  HandServer<> h;  // Synchronous, 2 workers
  CHECK(h.send(op(psx::Op::clock, 0, 1)).empty());
  std::vector<float> out(4, 9.0f);
  psx::Request pull = op(psx::Op::pull, 0, 1);  // waits for worker 1's step
  pull.call = 7;
  pull.items.push_back({0, 0, {}, {}, {}, out, {}});
  auto done = std::make_shared<psx::Completion>(1);
  pull.done = done;
  h.server->handle(std::move(pull));
  REQUIRE_FALSE(done->ready());
  CHECK(h.server->stats().waiting == 1);
  auto cancel = [&](std::uint32_t worker, std::uint64_t call) {
    psx::Request c = op(psx::Op::cancel, worker);
    c.call = call;
    return h.send(std::move(c));
  };
  CHECK(cancel(1, 7).empty());  // worker 1's call 7
  CHECK(cancel(0, 8).empty());  // worker 0's call 8
  CHECK(cancel(0, 0).empty());  // no call
  CHECK_FALSE(done->ready());
  psx::Request with_item = op(psx::Op::cancel, 0);
  with_item.call = 7;
  with_item.items.push_back({0, 0, {}, {}, {}, out, {}});
  CHECK(h.send(std::move(with_item)) == "psx: server 0, request from worker 0: a cancel carries no item");
  CHECK_FALSE(done->ready());
  CHECK(cancel(0, 7).empty());
  REQUIRE(done->ready());
  CHECK(message_of<psx::error>([&] { done->wait(); }) ==
        "psx: server 0: worker 0's pull cancelled: its handle was let go before the answer");
  CHECK(out == std::vector<float>(4, 9.0f));  // nothing written
  CHECK(h.server->stats().waiting == 0);
  CHECK(cancel(0, 7).empty());  // again: nothing kept
  CHECK(h.send(op(psx::Op::clock, 1, 1)).empty());  // the step completes with nothing to answer
  CHECK(h.server->stats().pulls == 0);              // the cancelled pull was not answered
  CHECK(h.snapshot()[0] == 0.0f);
}

TEST_CASE("random and malformed requests never crash a server, and a refused one changes nothing") {
  HandServer<psx::sync::Asynchronous> h;  // pulls never wait, so every request is answered at once
  std::mt19937_64 rng(2026);
  auto pick = [&](std::uint64_t n) { return rng() % n; };
  std::vector<float> buffer(64, 0.25f);
  std::vector<std::uint64_t> ids(16);
  std::vector<std::uint32_t> positions(16);
  std::size_t refused = 0, applied = 0;
  for (int i = 0; i < 3000; ++i) {
    psx::Request r;
    r.op = static_cast<psx::Op>(pick(12));  // valid operations and a few that are not
    r.worker = static_cast<std::uint32_t>(pick(3));
    r.clock = pick(4);
    if (r.op == psx::Op::barrier) continue;  // waits for the other worker by design
    const std::size_t items = pick(3);
    for (std::size_t k = 0; k < items; ++k) {
      psx::Item item;
      item.variable = static_cast<std::uint32_t>(pick(3));
      item.shard = static_cast<std::uint32_t>(pick(3));
      const std::size_t n_ids = pick(5);
      for (std::size_t j = 0; j < n_ids; ++j) {
        ids[k * 5 + j] = pick(10);
        positions[k * 5 + j] = static_cast<std::uint32_t>(pick(6));
      }
      item.ids = std::span(ids).subspan(k * 5, n_ids);
      if (pick(2)) item.positions = std::span(positions).subspan(k * 5, pick(2) ? n_ids : pick(5));
      const std::size_t len = pick(2) ? 4 : pick(20);
      item.in = std::span(buffer).first(len);
      item.out = std::span(buffer).subspan(32, len);
      r.items.push_back(item);
    }
    const bool push = r.op == psx::Op::push || r.op == psx::Op::push_rows;
    const auto before = h.snapshot();
    const std::string error = h.send(std::move(r));
    if (!error.empty()) {
      ++refused;
      CHECK_MESSAGE(error.rfind("psx: ", 0) == 0, error);
      if (push) CHECK(h.snapshot() == before);
    } else if (push) {
      ++applied;
    }
  }
  CHECK(refused > 500);  // most random requests are malformed
  CHECK(applied > 10);   // and some well-formed pushes got through
}

TEST_CASE("a save request without a directory is refused") {
  // The random requests above include saves without one: they once wrote
  // server-00000.psx into the working directory.
  HandServer<psx::sync::Asynchronous> h;
  CHECK(h.send(op(psx::Op::save, 0)) ==
        "psx: server 0, request from worker 0: a save request names no checkpoint directory");
}

TEST_CASE("a lost worker's barrier part does not stand in for a live worker") {
  // The barrier counted parts: with workers 0 and 1 waiting in it and 1
  // lost, two parts for two live workers let 0 through without 2.
  HandServer<> h({psx::sync::Aggregate::mean, psx::OnWorkerLost::shrink}, 3);
  auto barrier = [&](std::uint32_t w) {
    psx::Request r = op(psx::Op::barrier, w);
    auto done = std::make_shared<psx::Completion>(1);
    r.done = done;
    h.server->handle(std::move(r));
    return done;
  };
  const auto b0 = barrier(0), b1 = barrier(1);
  CHECK_FALSE(b0->ready());
  psx::Request fail = op(psx::Op::fail, 1);
  fail.reason = "its function threw";
  CHECK(h.send(std::move(fail)).empty());
  REQUIRE(b1->ready());
  CHECK(message_of<psx::peer_lost>([&] { b1->wait(); }) ==
        "psx: server 0: worker 1 was lost (its function threw)");
  CHECK_FALSE(b0->ready());  // still waiting for worker 2
  const auto b2 = barrier(2);
  CHECK(b0->ready());
  CHECK(b2->ready());
}

TEST_CASE("a lost worker that joins again resumes at the step of the others still training, and its join says so") {
  HandServer<psx::sync::BoundedStaleness<1>> h({psx::sync::Aggregate::mean, psx::OnWorkerLost::shrink}, 3);
  // Answers a join of worker w at `clock` with the clock the server counts it at.
  auto join = [&](std::uint32_t w, std::uint64_t clock) {
    psx::Request r = op(psx::Op::join, w, clock);
    std::array<float, 2> at{};
    r.items.push_back({0, 0, {}, {}, {}, at, {}});
    REQUIRE(h.send(std::move(r)).empty());
    std::uint64_t v;
    std::memcpy(&v, at.data(), sizeof v);
    return v;
  };
  // A fresh start: every worker joins at 0, and stays there.
  for (std::uint32_t w = 0; w < 3; ++w) CHECK(join(w, 0) == 0);
  // Worker 2 dies at 1; the others (a policy that goes on without it) reach 5 and 4.
  CHECK(h.send(op(psx::Op::clock, 2, 1)).empty());
  psx::Request fail = op(psx::Op::fail, 2);
  fail.reason = "its process died";
  CHECK(h.send(std::move(fail)).empty());
  for (std::uint64_t c = 1; c <= 5; ++c) CHECK(h.send(op(psx::Op::clock, 0, c)).empty());
  for (std::uint64_t c = 1; c <= 4; ++c) CHECK(h.send(op(psx::Op::clock, 1, c)).empty());
  // Its restarted process joins at 0: counted at 4, the slowest of the others.
  CHECK(join(2, 0) == 4);
  CHECK(h.send(op(psx::Op::clock, 2, 5)).empty());  // its next step is 5: no jump
  // A worker that was not lost is counted where it was (a second run()).
  CHECK(join(1, 4) == 4);
  // A join's answer is 2 floats, or none.
  psx::Request bad = op(psx::Op::join, 0, 5);
  std::array<float, 3> three{};
  bad.items.push_back({0, 0, {}, {}, {}, three, {}});
  CHECK(h.send(std::move(bad)) == "psx: server 0, request from worker 0: a join carries no item, or one answer of 2 floats");
}

TEST_CASE("a worker declared lost is told so when it comes back") {
  HandServer<> h({psx::sync::Aggregate::mean, psx::OnWorkerLost::shrink});
  psx::Request fail = op(psx::Op::fail, 1);
  fail.reason = "its function threw: disk full";
  CHECK(h.send(std::move(fail)).empty());
  CHECK(h.send(op(psx::Op::clock, 1, 1)) ==
        "psx: server 0: worker 1 was declared lost earlier (its function threw: disk full) and is no longer served");
  CHECK(h.send(op(psx::Op::join, 1, 0)).empty());  // a new run() admits it again
  CHECK(h.send(op(psx::Op::clock, 1, 1)).empty());
}

// -- pipelined pushes (Worker::pipeline_pushes) ---------------------------------

// Refuses every push stamped with step 3, whatever the shard: a failure only
// a server finds.
struct RefuseStep3 : psx::sync::Asynchronous {
  struct State : psx::sync::Asynchronous::State {
    psx::PushAction on_push(const psx::PushInfo& p, const psx::ShardProgress& s, const psx::ServerClock& c) const {
      if (p.clock == 3) return {psx::PushAction::Kind::reject, 1.0f, 0};
      return psx::sync::Asynchronous::State::on_push(p, s, c);
    }
  };
  State make_state(std::size_t) const { return {{false, 0.0f}}; }
};

TEST_CASE("pipelined pushes: copied, applied in order, bounded, and waited for by flush and by run") {
  Watchdog dog("pipelined pushes");
  for (const bool synchronous : {false, true}) {
    INFO((synchronous ? "Synchronous" : "Asynchronous"));
    auto train = [&](psx::Worker& w, std::size_t depth) {
      w.pipeline_pushes(depth);
      std::vector<float> x(6), g(6), rows(2 * 3);
      const std::vector<std::uint64_t> ids{1, 0};
      for (int t = 0; t < 20; ++t) {
        w.pull("x", x);
        // The gradient depends on what was pulled: a push applied late or
        // out of order changes every step after it.
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.5f * x[i] + static_cast<float>(t + 1);
        w.push("x", g);
        std::fill(g.begin(), g.end(), -1e9f);  // the caller's buffer is free once push returns
        for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i + t);
        w.push_rows("e", ids, rows);
        std::fill(rows.begin(), rows.end(), -1e9f);
        CHECK(w.pushes_in_flight() <= depth);
        w.step();
      }
      w.flush();
      CHECK(w.pushes_in_flight() == 0);
    };
    auto run = [&](std::size_t depth) {
      auto result = [&](auto& ps) {
        ps.declare(psx::dense("x", {3, 2}));
        ps.declare(psx::sparse("e", 4, 3));
        ps.run([&](psx::Worker& w) { train(w, depth); });
        std::vector<float> out = ps.read("x");
        const std::vector<float> e = ps.read("e");
        out.insert(out.end(), e.begin(), e.end());
        return out;
      };
      if (synchronous) {
        psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous> ps({2, 1}, {}, {}, {0.01f});
        return result(ps);
      }
      psx::ParameterServer<psx::partition::RowRange, psx::sync::Asynchronous> ps({2, 1}, {}, {}, {0.01f});
      return result(ps);
    };
    const std::vector<float> waited = run(0);
    CHECK(run(1) == waited);
    CHECK(run(4) == waited);
  }
}

TEST_CASE("pipelined pushes: a push a server refused is thrown by the worker's next call, unchanged") {
  Watchdog dog("pipelined push errors");
  psx::ParameterServer<psx::partition::RowRange, RefuseStep3> ps({1, 1}, {}, {}, {1.0f});
  ps.declare(psx::dense("x", {2}));
  ps.start();
  psx::Worker w = ps.worker(0);
  w.pipeline_pushes(8);
  std::vector<float> x(2);
  const std::vector<float> g{1.0f, 2.0f};
  for (int t = 0; t < 3; ++t) {
    w.push("x", g);
    w.step();
  }
  w.push("x", g);  // stamped with step 3: refused by the server, after this returns
  w.step();
  // The next call that waits (here a pull) reports it before it sends anything.
  const std::string error = message_of<psx::sync_error>([&] {
    for (int k = 0; k < 1000; ++k) w.pull("x", x);  // a pull may come before the refusal is in: ask again
  });
  CHECK(error.find("refused a push to 'x' stamped with step 3") != std::string::npos);
  CHECK(w.pushes_in_flight() == 0);
  w.push("x", g);  // the worker goes on; nothing else failed
  w.flush();
  w.pull("x", x);
  CHECK(x == std::vector<float>{-4.0f, -8.0f});  // 4 pushes of 5 applied
  // flush() reports a refused push too.
  for (int t = 4; t < 7; ++t) w.step();
  psx::ParameterServer<psx::partition::RowRange, RefuseStep3> ps2({1, 1}, {}, {}, {1.0f});
  ps2.declare(psx::dense("x", {2}));
  ps2.start();
  psx::Worker w2 = ps2.worker(0);
  w2.pipeline_pushes(8);
  for (int t = 0; t < 3; ++t) w2.step();
  w2.push("x", g);
  CHECK(message_of<psx::sync_error>([&] { w2.flush(); }).find("stamped with step 3") != std::string::npos);
  w2.flush();  // reported once
  w.leave();
  w2.leave();
}

TEST_CASE("pipelined pushes: the loop of docs/architecture.md trains as the waiting one does") {
  Watchdog dog("pipelined pushes, documented");
  const std::vector<std::uint64_t> ids{3, 1, 3, 0};
  auto compute = [](const std::vector<float>& rows, std::vector<float>& grads) {
    for (std::size_t i = 0; i < rows.size(); ++i) grads[i] = rows[i] - 1.0f;
  };
  auto train = [&](bool pipelined) {
    psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous> ps({2, 1}, {}, {}, {0.5f});
    ps.declare(psx::sparse("emb", 5, 2, psx::Initializer::uniform(-1, 1, 4)));
    ps.start();
    psx::Worker w = ps.worker(0);
    std::vector<float> rows(ids.size() * 2), grads(rows.size());
    const int steps = 10;
    if (pipelined) {
      w.pipeline_pushes(2);  // at most 2 pushes unacknowledged
      for (int t = 0; t < steps; ++t) {
        w.pull_rows("emb", ids, rows);
        compute(rows, grads);
        w.push_rows("emb", ids, grads);  // returns once sent: grads may be reused at once
        w.step();
      }
      w.flush();  // waits for the last ones (ParameterServer::run does it too)
    } else {
      for (int t = 0; t < steps; ++t) {
        w.pull_rows("emb", ids, rows);
        compute(rows, grads);
        w.push_rows("emb", ids, grads);
        w.step();
      }
    }
    w.leave();
    return ps.read("emb");
  };
  CHECK(train(true) == train(false));
}
