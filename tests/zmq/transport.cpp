// psx::transport::Zmq with every task of the cluster as a thread of this
// process, each with its own ZeroMQ context and sockets over tcp or ipc: the
// same code paths as separate processes (tests/zmq/node.cpp runs those).
#include "../support.hpp"
#include "program.hpp"
#include "tasks.hpp"

#include <psx/psx.hpp>
#include <psx/transport/zmq.hpp>

#include <doctest/doctest.h>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using psx::transport::ClusterSpec;
using psx::transport::TfConfig;
using psx::transport::Zmq;
using psx_test::TempDir;
using psx_zmq_test::for_each_task;
using psx_zmq_test::settings;
using psx_zmq_test::spec;

// A tcp endpoint on loopback that nothing listens on now: the system's pick
// for a socket that is closed again at once.
std::string free_endpoint() {
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::router);
  s.bind("tcp://127.0.0.1:0");
  return s.get(zmq::sockopt::last_endpoint);
}

// One server at `endpoint` ("tcp://host:port") and a chief.
ClusterSpec one_server_at(const std::string& endpoint) {
  ClusterSpec c;
  c.ps = {endpoint.substr(6)};
  c.chief = {"127.0.0.1:0"};
  return c;
}

template <class P, class S, class O>
using ZmqCluster = psx::ParameterServer<P, S, O, Zmq>;


// Trains psx_zmq_test's program on every task; returns what the chief read
// at the end.
template <class P = psx::partition::RowRange, class S = psx::sync::Synchronous, class O = psx::optim::SGD>
std::map<std::string, std::vector<float>> run_tasks(std::size_t ps, std::size_t workers, bool ipc,
                                                    std::function<void(Zmq&)> adjust = {},
                                                    std::function<void(psx::Worker&)> train = psx_zmq_test::train) {
  const psx::ClusterConfig config{ps, workers, std::chrono::milliseconds(20000)};
  std::map<std::string, std::vector<float>> result;
  std::mutex mu;
  for_each_task(ps, workers, ipc, [&](const std::string& type, std::size_t, Zmq z) {
    if (adjust) adjust(z);
    ZmqCluster<P, S, O> cluster(config, {}, {}, O{0.05f}, z);
    psx_zmq_test::declare(cluster);
    cluster.run(train);
    if (type == "chief") {
      auto values = psx_zmq_test::read_all(cluster);
      std::lock_guard lock(mu);
      result = std::move(values);
    }
  });
  return result;
}

std::map<std::string, std::vector<float>> run_inprocess(std::size_t ps, std::size_t workers) {
  psx::ParameterServer<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD> cluster(
      psx::ClusterConfig{ps, workers}, {}, {}, psx::optim::SGD{0.05f});
  psx_zmq_test::declare(cluster);
  cluster.run(psx_zmq_test::train);
  return psx_zmq_test::read_all(cluster);
}

void check_bit_identical(const std::map<std::string, std::vector<float>>& a,
                         const std::map<std::string, std::vector<float>>& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, values] : a) {
    INFO("variable " << name);
    REQUIRE(b.at(name).size() == values.size());
    CHECK(std::memcmp(values.data(), b.at(name).data(), values.size() * sizeof(float)) == 0);
  }
}

}  // namespace

TEST_CASE("zmq: synchronous training over tcp equals the in-process cluster bit for bit") {
  psx_test::Watchdog dog("zmq tcp training", std::chrono::seconds(120));
  const auto zmq = run_tasks(2, 4, false);
  const auto local = run_inprocess(2, 4);
  check_bit_identical(zmq, local);
  // And training moved the parameters at all.
  CHECK(zmq.at("b")[0] != 0.5f);
}

TEST_CASE("zmq: the same with pipelined pushes (acknowledgements behind the next pulls)") {
  psx_test::Watchdog dog("zmq pipelined pushes", std::chrono::seconds(120));
  const auto zmq = run_tasks(2, 3, false, {}, [](psx::Worker& w) {
    w.pipeline_pushes(3);
    psx_zmq_test::train(w);
    CHECK(w.pushes_in_flight() <= 3);
  });
  check_bit_identical(zmq, run_inprocess(2, 3));
}

TEST_CASE("zmq: a waiter spins while its spins pay, and backs off 1, 2, 4 ... 256 waits after one that did not") {
  psx::transport::detail_zmq::Spin spin;
  auto skipped = [&] {  // waits that do not spin before the next that does
    int n = 0;
    while (!spin.wanted()) ++n;
    return n;
  };
  CHECK(skipped() == 0);
  spin.spun(true, false);  // answered, the CPU its own: spin again at once
  CHECK(skipped() == 0);
  std::vector<int> backoff;
  for (int k = 0; k < 11; ++k) {
    spin.spun(false, false);  // ran out
    backoff.push_back(skipped());
  }
  CHECK(backoff == std::vector<int>{1, 2, 4, 8, 16, 32, 64, 128, 256, 256, 256});
  spin.spun(true, true);  // answered, but another thread took the CPU meanwhile: no better
  CHECK(skipped() == 256);
  spin.spun(true, false);
  CHECK(skipped() == 0);
  spin.spun(true, true);
  CHECK(skipped() == 1);
  // The switches it counts: a yield that lets another thread run is involuntary.
  const long before = psx::transport::detail_zmq::Spin::ceded();
  std::atomic<bool> stop{false};
  std::thread other([&] {
    while (!stop.load()) {
    }
  });
  // Both on one CPU, so that the yields have someone to let run; this
  // thread's own CPUs back afterwards (later tests run on it).
  cpu_set_t mine, one;
  const bool had = pthread_getaffinity_np(pthread_self(), sizeof mine, &mine) == 0;
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu(), &one);
  const bool pinned = had && pthread_setaffinity_np(other.native_handle(), sizeof one, &one) == 0 &&
                      pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0;
  for (int k = 0; k < 2000 && psx::transport::detail_zmq::Spin::ceded() == before; ++k) std::this_thread::yield();
  const long after = psx::transport::detail_zmq::Spin::ceded();
  if (had) pthread_setaffinity_np(pthread_self(), sizeof mine, &mine);
  stop.store(true);
  other.join();
  if (pinned) CHECK(after > before);
}

TEST_CASE("zmq: the same over ipc, with tensors split into 1000-byte chunks") {
  psx_test::Watchdog dog("zmq ipc training", std::chrono::seconds(120));
  const auto zmq = run_tasks(2, 3, true, [](Zmq& z) { z.chunk_bytes = 1000; });
  check_bit_identical(zmq, run_inprocess(2, 3));
}

namespace {
// The tcp run above (2 ps, 3 workers) with every address's host 127.0.0.1
// written as `host`.
auto run_tasks_on(const std::string& host) {
  return run_tasks(2, 3, false, [host](Zmq& z) {
    for (auto* job : {&z.tf.cluster.chief, &z.tf.cluster.worker, &z.tf.cluster.ps})
      for (std::string& a : *job) {
        REQUIRE(a.rfind("127.0.0.1:", 0) == 0);
        a = host + a.substr(9);
      }
  });
}
}  // namespace

TEST_CASE("zmq: the same with host names, \"localhost:port\"") {
  // libzmq binds numeric addresses and interface names only: a ps task
  // named by host (TensorFlow's usual "host:port", a Kubernetes service)
  // failed to start with "No such device".
  psx_test::Watchdog dog("zmq host names", std::chrono::seconds(120));
  check_bit_identical(run_tasks_on("localhost"), run_inprocess(2, 3));
}

TEST_CASE("zmq: the same over IPv6 loopback, \"[::1]:port\"") {
  {
    zmq::context_t ctx;
    zmq::socket_t probe(ctx, zmq::socket_type::router);
    probe.set(zmq::sockopt::ipv6, 1);
    try {
      probe.bind("tcp://[::1]:0");
    } catch (const zmq::error_t& e) {
      MESSAGE("skipped: this machine has no IPv6 loopback (" << e.what() << ")");
      return;
    }
  }
  psx_test::Watchdog dog("zmq IPv6 training", std::chrono::seconds(120));
  check_bit_identical(run_tasks_on("[::1]"), run_inprocess(2, 3));
}

TEST_CASE("zmq: a peer that never appears is named in the timeout error") {
  psx_test::Watchdog dog("zmq start timeout");
  TempDir dir;
  // A port nobody listens on.
  const std::string endpoint = free_endpoint();
  const ClusterSpec c = one_server_at(endpoint);
  Zmq z = settings(c, "chief", 0, dir.path);
  z.start_timeout = std::chrono::milliseconds(300);
  ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> cluster({1, 1}, {}, {}, {}, z);
  psx_zmq_test::declare(cluster);
  CHECK(psx_test::message_of<psx::peer_lost>([&] { cluster.start(); }) ==
        "psx: worker 0: no answer within 300 ms (start_timeout) from ps task 0 (" + endpoint + ")");
}

TEST_CASE("zmq: a worker that starts late is waited for up to start_timeout, one that never starts is named") {
  psx_test::Watchdog dog("zmq late worker", std::chrono::seconds(120));
  using Sync = ZmqCluster<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD>;
  // A peer timeout shorter than the late worker's delay: without the start
  // grace, the server declared it lost while the chief waited on it. (1 s:
  // a live thread of a sanitizer build on two busy cores can stall for less.)
  const psx::ClusterConfig config{1, 2, std::chrono::milliseconds(1000)};
  SUBCASE("late, within start_timeout: training goes on") {
    for_each_task(1, 2, false, [&](const std::string& type, std::size_t, Zmq z) {
      if (type == "worker") std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      Sync cluster(config, {}, {}, psx::optim::SGD{0.05f}, z);
      psx_zmq_test::declare(cluster);
      cluster.run(psx_zmq_test::train);
    });
  }
  SUBCASE("never: the chief's wait ends with its name, after start_timeout") {
    TempDir dir;
    const ClusterSpec c = spec(1, 2, false, dir.path);
    auto with_start = [&](const char* type) {
      Zmq z = settings(c, type, 0, dir.path);
      z.start_timeout = std::chrono::milliseconds(2000);
      return z;
    };
    const auto t0 = std::chrono::steady_clock::now();  // before the server's own start
    std::thread server([&] {
      Sync ps(config, {}, {}, psx::optim::SGD{0.05f}, with_start("ps"));
      psx_zmq_test::declare(ps);
      try {
        ps.run([](psx::Worker&) {});
      } catch (const psx::peer_lost&) {  // its policy failed with the worker lost
      }
    });
    Sync chief(config, {}, {}, psx::optim::SGD{0.05f}, with_start("chief"));
    psx_zmq_test::declare(chief);
    const std::string why = psx_test::message_of<psx::peer_lost>([&] { chief.run(psx_zmq_test::train); });
    CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(2000));
    CHECK(why.find("worker 1 was lost (never appeared: nothing from it in the ") != std::string::npos);
    CHECK(why.find("(start timeout 2000 ms)") != std::string::npos);
    chief.shutdown();  // its stop lets the server go
    server.join();
  }
}

TEST_CASE("zmq: an address in use is named") {
  zmq::context_t ctx;
  zmq::socket_t taken(ctx, zmq::socket_type::router);
  taken.bind("tcp://127.0.0.1:0");
  const std::string endpoint = taken.get(zmq::sockopt::last_endpoint);
  TempDir dir;
  ClusterSpec c;
  c.ps = {endpoint.substr(6)};
  c.chief = {"127.0.0.1:0"};
  ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> cluster(
      {1, 1}, {}, {}, {}, settings(c, "ps", 0, dir.path));
  psx_zmq_test::declare(cluster);
  CHECK(psx_test::message_of<psx::config_error>([&] { cluster.start(); }) ==
        "psx: ps task 0 cannot bind " + endpoint + ": Address already in use");
  // ipc: libzmq removes the socket file before it binds, so a second server
  // would take a live one's path over in silence; it is refused instead.
  const std::string path = (dir.path / "ps").string();
  zmq::socket_t live(ctx, zmq::socket_type::router);
  live.bind("ipc://" + path);
  c.ps = {"ipc://" + path};
  ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> second(
      {1, 1}, {}, {}, {}, settings(c, "ps", 0, dir.path));
  psx_zmq_test::declare(second);
  CHECK(psx_test::message_of<psx::config_error>([&] { second.start(); }) ==
        "psx: ps task 0 cannot bind ipc://" + path + ": Address already in use (a process accepts connections on it)");
  CHECK(fs::exists(path));
  // A file left by a process that died (bound, never listened on or
  // removed) is taken over, as libzmq does.
  const std::string stale = (dir.path / "stale").string();
  {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    ::sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, stale.data(), stale.size());
    REQUIRE(::bind(fd, reinterpret_cast<const ::sockaddr*>(&addr), sizeof addr) == 0);
    ::close(fd);
  }
  REQUIRE(fs::exists(stale));
  c.ps = {"ipc://" + stale};
  ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> restarted(
      {1, 1}, {}, {}, {}, settings(c, "ps", 0, dir.path));
  psx_zmq_test::declare(restarted);
  CHECK_NOTHROW(restarted.start());
  restarted.shutdown();
}

TEST_CASE("zmq: the cluster spec must match ClusterConfig") {
  TempDir dir;
  ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> cluster(
      {2, 1}, {}, {}, {}, settings(spec(1, 1, false, dir.path), "ps", 0, dir.path));
  CHECK(psx_test::message_of<psx::config_error>([&] { cluster.start(); }) ==
        "psx: the cluster spec has 1 ps and 1 workers (chief included), ClusterConfig says 2 servers and 1 workers");
}

TEST_CASE("zmq: a server bound to port 0 takes its published endpoint back when it closes") {
  // Left behind, it sent a later run's worker in the same directory to a
  // dead port until its start_timeout.
  TempDir dir;
  const fs::path published = dir.path / "ps-0";
  {
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> server(
        {1, 1}, {}, {}, {}, settings(spec(1, 1, false, dir.path), "ps", 0, dir.path));
    server.start();
    std::ifstream in(published);
    std::string endpoint;
    REQUIRE(std::getline(in, endpoint));
    CHECK(endpoint.rfind("tcp://127.0.0.1:", 0) == 0);
    CHECK(endpoint != "tcp://127.0.0.1:0");
  }
  CHECK_FALSE(fs::exists(published));
  // One another server has since published in its place is left alone.
  {
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> server(
        {1, 1}, {}, {}, {}, settings(spec(1, 1, false, dir.path), "ps", 0, dir.path));
    server.start();
    std::ofstream(published, std::ios::trunc) << "tcp://127.0.0.1:1\n";
  }
  CHECK(fs::exists(published));
}

TEST_CASE("zmq: settings out of range are refused at start, naming the setting") {
  // start_timeout = milliseconds::max() ("for ever") overflowed every
  // deadline: every peer lost at once; a negative io_threads made libzmq
  // assert; an allow-list key that could never match (40 characters, not
  // Z85) refused every client with no word why.
  TempDir dir;
  auto refused = [&](const std::function<void(Zmq&)>& adjust) {
    Zmq z = settings(spec(1, 1, false, dir.path), "ps", 0, dir.path);
    adjust(z);
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> cluster({1, 1}, {}, {}, {}, z);
    return psx_test::message_of<psx::config_error>([&] { cluster.start(); });
  };
  CHECK(refused([](Zmq& z) { z.start_timeout = std::chrono::milliseconds::max(); }) ==
        "psx: Zmq::start_timeout must be from 1 ms to 366 days, got 9223372036854775807 ms");
  CHECK(refused([](Zmq& z) { z.start_timeout = std::chrono::milliseconds(0); }).find("got 0 ms") != std::string::npos);
  CHECK(refused([](Zmq& z) { z.io_threads = -1; }) == "psx: Zmq::io_threads must be from 1 to 1024, got -1");
  CHECK(refused([](Zmq& z) { z.io_threads = 0; }).find("got 0") != std::string::npos);
  const auto [server_pub, server_sec] = psx::transport::Curve::keypair();
  const auto [client_pub, client_sec] = psx::transport::Curve::keypair();
  CHECK(refused([&](Zmq& z) {
          z.curve.server_public_key = server_pub;
          z.curve.server_secret_key = server_sec;
          z.curve.allowed_clients = {client_pub, std::string(40, '~')};
        }) == "psx: Curve::allowed_clients[1] is not Z85 (40 characters of its alphabet)");
  CHECK(refused([&](Zmq& z) {
          z.curve.server_public_key = server_pub;
          z.curve.server_secret_key = server_sec;
          z.curve.allowed_clients = {client_pub + "\n"};
        }) == "psx: Curve::allowed_clients[0] must be 40 Z85 characters, got 41");
}

namespace {

namespace wire = psx::detail::wire;

// Runs a ps task on a thread for a test body that plays the workers itself;
// `stats` is read when the server has stopped.
template <class Declare>
struct ServerThread {
  psx::ServerStats stats;
  std::exception_ptr error;
  std::thread thread;
  ServerThread(const ClusterSpec& c, const fs::path& dir, std::size_t workers, Declare declare,
               std::function<void(Zmq&)> adjust = {}) {
    thread = std::thread([=, this] {
      try {
        Zmq z = settings(c, "ps", 0, dir);
        if (adjust) adjust(z);
        ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> ps(
            {1, workers, std::chrono::milliseconds(2000)}, {}, {}, psx::optim::SGD{0.05f}, z);
        declare(ps);
        try {
          ps.run([](psx::Worker&) {});
        } catch (const psx::peer_lost&) {  // a fuzzed message may have made the chief look lost
        }
        stats = ps.stats();
      } catch (...) {
        error = std::current_exception();
      }
    });
  }
  ~ServerThread() {
    if (thread.joinable()) thread.join();
  }
};

std::string published_endpoint(const fs::path& dir) {
  for (int k = 0; k < 2000; ++k) {
    std::ifstream in(dir / "ps-0");
    std::string e;
    if (in && std::getline(in, e) && !e.empty()) return e;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  FAIL("the server never published its endpoint");
  return {};
}

template <class PS>
void declare_fuzz(PS& ps) {
  ps.declare({.name = "w", .shape = {1000}, .init = psx::Initializer::uniform(-1.0f, 1.0f, 1)});
  ps.declare({.name = "emb", .shape = {500, 8}, .kind = psx::VariableKind::sparse,
              .init = psx::Initializer::normal(0.0f, 1.0f, 2)});
  ps.declare({.name = "frozen", .shape = {777}, .init = psx::Initializer::constant(3.0f), .trainable = false});
}

std::vector<zmq::message_t> frames_of(const std::vector<std::byte>& header, const std::vector<wire::Segment>& segs) {
  std::vector<zmq::message_t> out;
  out.emplace_back(header.data(), header.size());
  for (const auto& s : segs) out.emplace_back(s.data, s.size);
  return out;
}

}  // namespace

TEST_CASE("zmq: thousands of random and mutated messages: the server survives, counts them, changes nothing") {
  psx_test::Watchdog dog("zmq bad input", std::chrono::seconds(120));
  TempDir dir;
  const ClusterSpec c = spec(1, 1, false, dir.path);
  ServerThread server(c, dir.path, 1, [](auto& ps) { declare_fuzz(ps); });
  std::map<std::string, std::vector<float>> before, after;
  std::uint64_t fingerprint = 0;
  const int messages = 5000;
  {
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> chief(
        {1, 1, std::chrono::milliseconds(1000)}, {}, {}, psx::optim::SGD{0.05f}, settings(c, "chief", 0, dir.path));
    declare_fuzz(chief);
    chief.run([](psx::Worker&) {});
    for (const char* n : {"w", "emb", "frozen"}) before[n] = chief.read(n);
    fingerprint = wire::fingerprint(1, 1, chief.variables());

    // Templates: every kind of message a worker sends, well formed.
    std::vector<float> out(4000), grad(777, 1.0f);
    std::vector<std::uint64_t> ids = {0, 7, 499};
    std::vector<std::pair<std::vector<std::byte>, std::vector<wire::Segment>>> templates;
    auto add = [&](psx::Op op, std::vector<psx::Item> items, std::uint64_t call, std::uint64_t fp) {
      psx::Request r;
      r.op = op;
      r.worker = 0;
      r.items = std::move(items);
      std::vector<wire::Segment> segs;
      auto h = wire::encode_request(r, {call, fp, 64}, segs);
      templates.emplace_back(std::move(h), std::move(segs));
    };
    psx::Item read_w;
    read_w.variable = 0;
    read_w.out = std::span<float>(out).first(1000);
    add(psx::Op::read, {read_w}, 1, fingerprint);
    psx::Item rows;
    rows.variable = 1;
    rows.ids = ids;
    rows.out = std::span<float>(out).first(24);
    add(psx::Op::pull_rows, {rows}, 2, fingerprint);
    psx::Item push_frozen;
    push_frozen.variable = 2;
    push_frozen.in = grad;
    add(psx::Op::push, {push_frozen}, 3, fingerprint);
    add(psx::Op::heartbeat, {}, 0, fingerprint);
    // Pushes to trainable variables from another program: every byte of
    // the fingerprint differs, more than a mutation below changes, so each
    // must be refused by it (a well-formed one would change parameters).
    psx::Item push_w;
    push_w.variable = 0;
    std::vector<float> grad_w(1000, 1.0f), grad_rows(24, 1.0f);
    push_w.in = grad_w;
    add(psx::Op::push, {push_w}, 4, ~fingerprint);
    psx::Item push_rows;
    push_rows.variable = 1;
    push_rows.ids = ids;
    push_rows.in = grad_rows;
    add(psx::Op::push_rows, {push_rows}, 5, ~fingerprint);
    templates.emplace_back(wire::encode_hello({fingerprint, 0, 1, 1}), std::vector<wire::Segment>{});

    zmq::context_t ctx;
    zmq::socket_t raw(ctx, zmq::socket_type::dealer);
    raw.set(zmq::sockopt::linger, 0);
    raw.connect(published_endpoint(dir.path));
    std::mt19937_64 rng(20261130);
    for (int k = 0; k < messages; ++k) {
      std::vector<zmq::message_t> msg;
      const auto& [h, segs] = templates[rng() % templates.size()];
      switch (rng() % 6) {
        case 0: {  // random bytes, sometimes behind a valid prefix
          std::vector<std::byte> junk(rng() % 200);
          for (auto& b : junk) b = static_cast<std::byte>(rng());
          if (junk.size() >= 8 && rng() % 2) std::memcpy(junk.data(), h.data(), 8);
          msg.emplace_back(junk.data(), junk.size());
          break;
        }
        case 1: {  // a header truncated
          msg.emplace_back(h.data(), rng() % h.size());
          break;
        }
        case 2: {  // frames missing or added
          msg = frames_of(h, segs);
          if (msg.size() > 1 && rng() % 2) msg.pop_back();
          else msg.emplace_back(static_cast<std::size_t>(rng() % 100));
          break;
        }
        default: {  // one to four bytes of the header changed
          auto m = h;
          for (int f = 0, n = 1 + static_cast<int>(rng() % 4); f < n; ++f)
            m[rng() % m.size()] = static_cast<std::byte>(rng());
          msg = frames_of(m, segs);
        }
      }
      zmq::send_multipart(raw, msg);
    }
    // The server answers one connection in order: when this read's answer
    // comes, every message above has been handled.
    {
      psx::Request r;
      r.op = psx::Op::read;
      r.items = {read_w};
      std::vector<wire::Segment> segs;
      zmq::send_multipart(raw, frames_of(wire::encode_request(r, {424242, fingerprint, 64}, segs), segs));
      bool answered = false;
      while (!answered) {
        std::vector<zmq::message_t> reply;
        std::vector<zmq::pollitem_t> items{{raw.handle(), 0, ZMQ_POLLIN, 0}};
        REQUIRE(zmq::poll(items, std::chrono::milliseconds(20000)) == 1);
        (void)zmq::recv_multipart(raw, std::back_inserter(reply));
        const auto head = psx::transport::detail_zmq::bytes_of(reply[0]);
        if (head.size() >= 16 && head[6] == std::byte{5} && wire::get<std::uint64_t>(head, 8) == 424242) {
          REQUIRE(head[7] == std::byte{0});
          answered = true;
        }
      }
    }
    for (const char* n : {"w", "emb", "frozen"}) after[n] = chief.read(n);
  }
  server.thread.join();
  REQUIRE_FALSE(server.error);
  check_bit_identical(before, after);
  INFO("rejected " << server.stats.rejected << ", errors " << server.stats.errors);
  // Most messages are malformed; the well-formed rest is answered (pushes to
  // the frozen variable with errors).
  CHECK(server.stats.rejected + server.stats.errors >= messages / 2);
  CHECK(server.stats.rejected > 0);
}

TEST_CASE("zmq: a refused request's answer names the server and the sender, a worker id out of range too") {
  psx_test::Watchdog dog("zmq error context", std::chrono::seconds(60));
  TempDir dir;
  const ClusterSpec c = spec(1, 1, false, dir.path);
  ServerThread server(c, dir.path, 1, [](auto& ps) { declare_fuzz(ps); });
  {
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> chief(
        {1, 1, std::chrono::milliseconds(1000)}, {}, {}, psx::optim::SGD{0.05f}, settings(c, "chief", 0, dir.path));
    declare_fuzz(chief);
    chief.run([](psx::Worker&) {});
    const std::uint64_t fingerprint = wire::fingerprint(1, 1, chief.variables());
    zmq::context_t ctx;
    zmq::socket_t raw(ctx, zmq::socket_type::dealer);
    raw.set(zmq::sockopt::linger, 0);
    raw.connect(published_endpoint(dir.path));
    // A read of "w" as `worker`, stamped with `fp`: the text of the error it is answered with.
    auto refusal = [&](std::uint32_t worker, std::uint64_t fp, std::uint64_t call) {
      std::vector<float> out(1000);
      psx::Item item;
      item.variable = 0;
      item.out = out;
      psx::Request r;
      r.op = psx::Op::read;
      r.worker = worker;
      r.items = {item};
      std::vector<wire::Segment> segs;
      zmq::send_multipart(raw, frames_of(wire::encode_request(r, {call, fp, 64}, segs), segs));
      std::vector<zmq::pollitem_t> items{{raw.handle(), 0, ZMQ_POLLIN, 0}};
      REQUIRE(zmq::poll(items, std::chrono::milliseconds(20000)) == 1);
      std::vector<zmq::message_t> reply;
      REQUIRE(zmq::recv_multipart(raw, std::back_inserter(reply)));
      const auto rh = wire::decode_reply_head(psx::transport::detail_zmq::bytes_of(reply[0]), "test");
      CHECK(rh.call == call);
      CHECK(rh.status == wire::Status::wire_error);
      return rh.text;
    };
    // Worker ids past the cluster's are named as sent, each its own.
    CHECK(refusal(7, fingerprint, 1) == "psx: ps task 0: a message from worker 7: no such worker in a cluster of 1");
    CHECK(refusal(4000000000u, fingerprint, 2) ==
          "psx: ps task 0: a message from worker 4000000000: no such worker in a cluster of 1");
    const std::string other = refusal(0, fingerprint + 1, 3);
    CHECK(other.starts_with("psx: ps task 0: a message from worker 0 was built from other declarations (fingerprint " +
                            std::to_string(fingerprint + 1) + ", this server " + std::to_string(fingerprint) + ")"));
  }
  server.thread.join();
  REQUIRE_FALSE(server.error);
  CHECK(server.stats.rejected >= 3);
}

TEST_CASE("zmq: a message over the server's max_message_bytes is answered with wire_error, not dropped") {
  // The server's socket refused frames above max_message_bytes itself:
  // libzmq dropped the connection, nobody answered, and the worker's push
  // waited for ever (its pongs kept the server looking alive).
  psx_test::Watchdog dog("zmq message limit", std::chrono::seconds(60));
  TempDir dir;
  const ClusterSpec c = spec(1, 1, false, dir.path);
  ServerThread server(c, dir.path, 1, [](auto& ps) { declare_fuzz(ps); },
                      [](Zmq& z) { z.limits.max_message_bytes = 2048; });
  {
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> chief(
        {1, 1, std::chrono::milliseconds(1000)}, {}, {}, psx::optim::SGD{0.05f}, settings(c, "chief", 0, dir.path));
    declare_fuzz(chief);
    chief.run([](psx::Worker& w) {
      std::vector<float> small(8, 1.0f), big(1000, 1.0f);
      const std::vector<std::uint64_t> ids{3};
      w.push_rows("emb", ids, small);  // 8 floats: within the limit
      const std::string m = psx_test::message_of<psx::wire_error>([&] { w.push("w", big); });  // 4000 bytes
      CHECK(m.find("message is over the limit of 2048 bytes") != std::string::npos);
      w.push_rows("emb", ids, small);  // the server still serves
    });
  }
  server.thread.join();
  REQUIRE_FALSE(server.error);
  CHECK(server.stats.rejected == 1);
  CHECK(server.stats.pushes == 2);
}

TEST_CASE("zmq: a peer of another wire version is refused at the handshake, naming both versions") {
  psx_test::Watchdog dog("zmq version refusal");
  TempDir dir;
  const ClusterSpec c = spec(1, 1, false, dir.path);
  SUBCASE("a worker from the future says hello to this server") {
    ServerThread server(c, dir.path, 1, [](auto& ps) { declare_fuzz(ps); });
    zmq::context_t ctx;
    zmq::socket_t raw(ctx, zmq::socket_type::dealer);
    raw.set(zmq::sockopt::linger, 0);
    raw.connect(published_endpoint(dir.path));
    auto hello = wire::encode_hello({1, 0, 1, 1});
    const auto future = static_cast<std::uint16_t>(wire::version + 1);
    std::memcpy(hello.data() + 4, &future, sizeof future);  // the next version
    raw.send(zmq::buffer(hello));
    std::vector<zmq::message_t> reply;
    (void)zmq::recv_multipart(raw, std::back_inserter(reply));
    const auto head = psx::transport::detail_zmq::bytes_of(reply[0]);
    const auto p = wire::read_prefix(head, "test");
    CHECK(p.kind == wire::Kind::refuse);
    CHECK(wire::decode_refuse(head, "test") == "psx: ps task 0 speaks " + wire::version_text(wire::version) +
                                                   ", the peer " + wire::version_text(future) +
                                                   ": build every process with the same psx");
    // Let the server go: a chief that joins, leaves and stops it.
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> chief(
        {1, 1, std::chrono::milliseconds(1000)}, {}, {}, {}, settings(c, "chief", 0, dir.path));
    declare_fuzz(chief);
    chief.run([](psx::Worker&) {});
  }
  SUBCASE("a server from the future welcomes this worker") {
    zmq::context_t ctx;
    zmq::socket_t fake(ctx, zmq::socket_type::router);
    fake.bind("tcp://127.0.0.1:0");
    const std::string endpoint = fake.get(zmq::sockopt::last_endpoint);
    const auto future = static_cast<std::uint16_t>(wire::version + 1);
    std::thread answer([&] {
      std::vector<zmq::message_t> hello;
      (void)zmq::recv_multipart(fake, std::back_inserter(hello));
      auto welcome = wire::encode_signal(wire::Kind::welcome, 0);
      std::memcpy(welcome.data() + 4, &future, sizeof future);
      std::vector<zmq::message_t> reply;
      reply.push_back(std::move(hello[0]));
      reply.emplace_back(welcome.data(), welcome.size());
      zmq::send_multipart(fake, reply);
    });
    ClusterSpec one;
    one.ps = {endpoint.substr(6)};
    one.chief = {"127.0.0.1:0"};
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> chief(
        {1, 1}, {}, {}, {}, settings(one, "chief", 0, dir.path));
    declare_fuzz(chief);
    CHECK(psx_test::message_of<psx::wire_error>([&] { chief.start(); }) ==
          "psx: worker 0: ps task 0 (" + endpoint + ") speaks " + wire::version_text(future) + ", this worker " +
              wire::version_text(wire::version));
    answer.join();
  }
}

TEST_CASE("zmq: CURVE: an allowed client trains, a client not on the list changes nothing and is counted") {
  psx_test::Watchdog dog("zmq curve", std::chrono::seconds(120));
  TempDir dir;
  const ClusterSpec c = spec(1, 1, false, dir.path);
  const auto [server_pub, server_sec] = psx::transport::Curve::keypair();
  const auto [good_pub, good_sec] = psx::transport::Curve::keypair();
  const auto [bad_pub, bad_sec] = psx::transport::Curve::keypair();
  ServerThread server(
      c, dir.path, 1, [](auto& ps) { declare_fuzz(ps); },
      [&](Zmq& z) {
        z.curve.server_public_key = server_pub;
        z.curve.server_secret_key = server_sec;
        z.curve.allowed_clients = {good_pub};
      });
  auto client = [&](const std::string& pub, const std::string& sec) {
    Zmq z = settings(c, "chief", 0, dir.path);
    z.curve.server_public_key = server_pub;
    z.curve.client_public_key = pub;
    z.curve.client_secret_key = sec;
    if (pub == bad_pub) z.start_timeout = std::chrono::milliseconds(500);  // it waits in vain
    return z;
  };
  {
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> intruder(
        {1, 1}, {}, {}, {}, client(bad_pub, bad_sec));
    declare_fuzz(intruder);
    CHECK(psx_test::message_of<psx::peer_lost>([&] { intruder.start(); }).find("no answer within 500 ms") !=
          std::string::npos);
  }
  std::vector<float> w;
  {
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> chief(
        {1, 1}, {}, {}, {}, client(good_pub, good_sec));
    declare_fuzz(chief);
    const auto w0 = chief.read("w");
    chief.run([](psx::Worker& worker) {
      std::vector<float> g(1000, 1.0f);
      worker.push("w", g);
      worker.step();
    });
    w = chief.read("w");
    // The server applies its own optimizer (SGD with lr 0.05), not the chief's.
    CHECK(w[0] == doctest::Approx(w0[0] - 0.05f));
  }
  server.thread.join();
  REQUIRE_FALSE(server.error);
  CHECK(server.stats.rejected >= 1);
  // Keys or an allow-list without the server's public key are refused at
  // start, on either side, where they would have run in plain text.
  for (const char* role : {"ps", "chief"}) {
    CAPTURE(role);
    Zmq z = settings(c, role, 0, dir.path);
    if (std::string(role) == "ps") {
      z.curve.server_secret_key = server_sec;
      z.curve.allowed_clients = {good_pub};
    } else {
      z.curve.client_public_key = good_pub;
      z.curve.client_secret_key = good_sec;
    }
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> half({1, 1}, {}, {}, {}, z);
    declare_fuzz(half);
    CHECK(psx_test::message_of<psx::config_error>([&] { half.start(); })
              .find("Curve has keys or an allow-list but no server_public_key") != std::string::npos);
  }
}

TEST_CASE("zmq: CURVE: a client with another server key fails the handshake and is counted") {
  psx_test::Watchdog dog("zmq curve handshakes", std::chrono::seconds(120));
  TempDir dir;
  const ClusterSpec c = spec(1, 1, false, dir.path);
  const auto [server_pub, server_sec] = psx::transport::Curve::keypair();
  const auto [other_pub, other_sec] = psx::transport::Curve::keypair();
  const auto [third_pub, third_sec] = psx::transport::Curve::keypair();
  const auto [client_pub, client_sec] = psx::transport::Curve::keypair();
  // No allow-list: any client that knows the key gets in, so the ZAP
  // handler refuses nobody and every refusal counted is a handshake's.
  ServerThread server(
      c, dir.path, 1, [](auto& ps) { declare_fuzz(ps); },
      [&](Zmq& z) {
        z.curve.server_public_key = server_pub;
        z.curve.server_secret_key = server_sec;
      });
  Zmq z = settings(c, "chief", 0, dir.path);
  z.curve.server_public_key = server_pub;
  z.curve.client_public_key = client_pub;
  z.curve.client_secret_key = client_sec;
  {
    // A client with the right key trains and reads the server's counters
    // over the wire while two with other server keys try once each (no
    // reconnection: one failed handshake apiece at most). The server finds
    // the key wrong when it cannot decrypt the client's HELLO, always. (A
    // client in plain text is counted too when the server reads its
    // greeting before it hangs up, seeing CURVE; not always, so not here.)
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> chief({1, 1}, {}, {}, {}, z);
    declare_fuzz(chief);
    chief.run([&](psx::Worker& worker) {
      std::vector<float> g(1000, 1.0f);
      worker.push("w", g);
      worker.step();
      zmq::context_t ctx;
      const std::string endpoint = published_endpoint(dir.path);
      zmq::socket_t a(ctx, zmq::socket_type::dealer), b(ctx, zmq::socket_type::dealer);
      for (auto [s, key] : {std::pair{&a, other_pub}, std::pair{&b, third_pub}}) {
        s->set(zmq::sockopt::linger, 0);
        s->set(zmq::sockopt::reconnect_ivl, -1);
        s->set(zmq::sockopt::curve_serverkey, key);
        s->set(zmq::sockopt::curve_publickey, client_pub);
        s->set(zmq::sockopt::curve_secretkey, client_sec);
        s->connect(endpoint);
        (void)s->send(zmq::str_buffer("x"), zmq::send_flags::dontwait);
      }
      std::uint64_t rejected = 0;
      for (int k = 0; k < 1000 && rejected < 2; ++k) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        rejected = worker.server_stats()[0].rejected;
      }
      CHECK(rejected == 2);
    });
  }
  server.thread.join();
  REQUIRE_FALSE(server.error);
  CHECK(server.stats.rejected == 2);
}

TEST_CASE("zmq: a server restarted on the same endpoint: the worker refuses to go on with it") {
  psx_test::Watchdog dog("zmq restart", std::chrono::seconds(120));
  TempDir dir;
  // A fixed port both server incarnations bind.
  const ClusterSpec c = one_server_at(free_endpoint());
  using Async = ZmqCluster<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::SGD>;
  // A server on its own thread, up until told to go; it shuts itself down
  // (no other thread may touch it while it is destroyed).
  struct Incarnation {
    std::atomic<bool> up{false}, down{false};
    std::thread thread;
  };
  auto launch = [&](float lr, Incarnation& inc) {
    inc.thread = std::thread([&c, &dir, lr, &inc] {
      Async ps({1, 1, std::chrono::milliseconds(2000)}, {}, {}, psx::optim::SGD{lr}, settings(c, "ps", 0, dir.path));
      declare_fuzz(ps);
      ps.start();
      inc.up = true;
      while (!inc.down) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ps.shutdown();
    });
  };
  Incarnation first, second;
  launch(0.5f, first);
  Async chief({1, 1, std::chrono::milliseconds(2000)}, {}, {}, {}, settings(c, "chief", 0, dir.path));
  declare_fuzz(chief);
  psx::Worker w = chief.worker(0);
  std::vector<float> g(1000, 1.0f), v(1000);
  w.pull("w", v);
  const float initial = v[0];
  w.push("w", g);
  w.pull("w", v);
  CHECK(v[0] == doctest::Approx(initial - 0.5f));
  // The first server goes away; a second one comes up on the same endpoint.
  first.down = true;
  first.thread.join();
  launch(0.25f, second);
  // The worker's first call was for the server it knew: the new one refuses
  // it unexecuted (never applied to a server it was not meant for), and
  // names itself; from then on no call goes on with a server that lost
  // what this worker trained there (the job returns to its checkpoint).
  CHECK_THROWS_WITH_AS(w.pull("w", v), doctest::Contains("restarted"), psx::peer_lost);
  CHECK_THROWS_WITH_AS(w.pull("w", v), doctest::Contains("no call goes on with it"), psx::peer_lost);
  CHECK_THROWS_WITH_AS(w.push("w", g), doctest::Contains("no call goes on with it"), psx::peer_lost);
  w.leave();
  chief.shutdown();
  second.down = true;
  second.thread.join();
}

namespace {

// A worker played by a raw DEALER: hello, join and heartbeats as a psx
// worker sends them, then silence (it died: no leave, no stop).
struct RawWorker {
  zmq::context_t ctx;
  zmq::socket_t sock{ctx, zmq::socket_type::dealer};
  std::uint32_t index;
  std::uint64_t fingerprint;
  RawWorker(const std::string& endpoint, std::uint32_t worker, std::uint64_t fp, std::uint32_t workers)
      : index(worker), fingerprint(fp) {
    sock.set(zmq::sockopt::linger, 0);
    sock.connect(endpoint);
    const auto h = wire::encode_hello({fp, worker, workers, 1});
    sock.send(zmq::buffer(h.data(), h.size()));
    std::vector<zmq::message_t> welcome;
    REQUIRE(zmq::recv_multipart(sock, std::back_inserter(welcome)));
    send(psx::Op::join, 1);
  }
  void send(psx::Op op, std::uint64_t call = 0) {
    psx::Request r;
    r.op = op;
    r.worker = index;
    std::vector<wire::Segment> segs;
    const auto h = wire::encode_request(r, {call, fingerprint, wire::max_chunk_bytes}, segs);
    sock.send(zmq::buffer(h.data(), h.size()));
  }
};

// A ps process of `Cluster` on its own thread: `how` it ended ("returned",
// or the peer_lost message), then `ended`.
template <class Cluster, class Declare, class Dir>
std::thread serve(const psx::ClusterConfig& config, const ClusterSpec& c, const Dir& dir, Declare declare,
                  std::atomic<bool>& ended, std::string& how) {
  return std::thread([&c, &dir, &ended, &how, config, declare] {
    Cluster ps(config, {}, {}, {0.1f}, settings(c, "ps", 0, dir));
    declare(ps);
    try {
      ps.run([](psx::Worker&) {});
      how = "returned";
    } catch (const psx::peer_lost& e) {
      how = e.what();
    }
    ended = true;
  });
}

}  // namespace

TEST_CASE("zmq: a worker process's messages are executed once each and in order, resent, stale and other processes' too") {
  // Worker 1 is a raw DEALER that names itself as a psx worker process does
  // (routing id and hello with its incarnation, numbered messages) and
  // sends what a worker sends after a reconnect: messages again, and later
  // ones before earlier ones. The chief reads what the server applied.
  psx_test::Watchdog dog("zmq exactly once", std::chrono::seconds(60));
  TempDir dir;
  const ClusterSpec c = spec(1, 2, false, dir.path);
  using Async = ZmqCluster<psx::partition::HashByName, psx::sync::Asynchronous, psx::optim::SGD>;
  const psx::ClusterConfig config{1, 2, std::chrono::milliseconds(5000)};
  std::atomic<bool> ended{false};
  std::string how;
  std::thread server = serve<Async>(config, c, dir.path, [](auto& ps) { declare_fuzz(ps); }, ended, how);
  {
    Async chief(config, {}, {}, {0.1f}, settings(c, "chief", 0, dir.path));
    declare_fuzz(chief);
    psx::Worker w = chief.worker(0);
    std::vector<float> v(1000), initial(1000);
    w.pull("w", initial);
    const std::uint64_t fp = wire::fingerprint(1, 2, chief.variables());

    zmq::context_t ctx;
    std::uint64_t server_inc = 0;
    // A worker-1 process of incarnation `inc`: its socket, welcomed.
    auto process = [&](std::uint64_t inc) {
      zmq::socket_t sock(ctx, zmq::socket_type::dealer);
      std::string id = "P";
      const std::uint32_t worker = 1;
      id.append(reinterpret_cast<const char*>(&worker), 4);
      id.append(reinterpret_cast<const char*>(&inc), 8);
      sock.set(zmq::sockopt::routing_id, zmq::buffer(id));
      sock.set(zmq::sockopt::linger, 0);
      sock.connect(published_endpoint(dir.path));
      const auto h = wire::encode_hello({fp, 1, 2, 1, inc});
      sock.send(zmq::buffer(h.data(), h.size()));
      std::vector<zmq::message_t> welcome;
      REQUIRE(zmq::recv_multipart(sock, std::back_inserter(welcome)));
      server_inc = wire::decode_signal(psx::transport::detail_zmq::bytes_of(welcome[0]), "test");
      return sock;
    };
    const std::vector<float> g(1000, 1.0f);
    std::vector<float> out(1000);
    // Sends message `id` of process `inc`: a push of g, a read into `out`,
    // or a join.
    auto send = [&](zmq::socket_t& s, std::uint64_t inc, std::uint64_t id, std::uint64_t floor, bool resend,
                    std::uint64_t incarnation, psx::Op op = psx::Op::push) {
      psx::Request r;
      r.op = op;
      r.worker = 1;
      if (op == psx::Op::push || op == psx::Op::read) {
        psx::Item item;
        item.variable = 0;
        if (op == psx::Op::push) item.in = g;
        else item.out = out;
        r.items = {item};
      }
      std::vector<wire::Segment> segs;
      wire::RequestHead head{id, fp, wire::max_chunk_bytes};
      head.floor = floor;
      head.incarnation = incarnation;
      head.resend = resend;
      head.process = inc;
      zmq::send_multipart(s, frames_of(wire::encode_request(r, head, segs), segs));
    };
    std::vector<zmq::message_t> reply;  // the last answer's frames
    auto answer = [&](zmq::socket_t& s) {
      std::vector<zmq::pollitem_t> items{{s.handle(), 0, ZMQ_POLLIN, 0}};
      REQUIRE(zmq::poll(items, std::chrono::milliseconds(20000)) == 1);
      for (;;) {  // pongs (a server names its incarnation with one before a refusal) aside
        reply.clear();
        REQUIRE(zmq::recv_multipart(s, std::back_inserter(reply)));
        if (wire::read_prefix(psx::transport::detail_zmq::bytes_of(reply[0]), "test").kind != wire::Kind::pong) break;
      }
      return wire::decode_reply_head(psx::transport::detail_zmq::bytes_of(reply[0]), "test");
    };
    auto applied = [&] {  // how many pushes of g "w" has had (lr 0.1, SGD)
      w.pull("w", v);
      return std::lround((initial[0] - v[0]) / 0.1f);
    };

    zmq::socket_t sock = process(0x1111);
    send(sock, 0x1111, 1, 1, false, server_inc, psx::Op::join);
    CHECK(answer(sock).call == 1);
    send(sock, 0x1111, 2, 2, false, server_inc);
    auto rh = answer(sock);
    CHECK(rh.call == 2);
    CHECK(rh.status == wire::Status::ok);
    // Sent again twice (its answer was lost, say): answered again, applied once.
    send(sock, 0x1111, 2, 2, true, server_inc);
    CHECK(answer(sock).call == 2);
    send(sock, 0x1111, 2, 2, true, server_inc);
    CHECK(answer(sock).call == 2);
    CHECK(applied() == 1);
    // Message 4 comes before 3 (3 was lost with a connection): held back
    // until 3 is in, then both run, in order.
    send(sock, 0x1111, 4, 3, false, server_inc, psx::Op::read);
    send(sock, 0x1111, 3, 3, true, server_inc);
    rh = answer(sock);
    CHECK(rh.call == 3);
    rh = answer(sock);
    CHECK(rh.call == 4);
    CHECK(rh.status == wire::Status::ok);
    CHECK(applied() == 2);
    REQUIRE(reply.size() == 2);
    REQUIRE(reply[1].size() == 1000 * sizeof(float));
    CHECK(std::memcmp(reply[1].data(), v.data(), 1000 * sizeof(float)) == 0);  // the read saw push 3
    // Below the floor the worker acknowledged: dropped, unanswered (the
    // next answer is the next message's).
    send(sock, 0x1111, 3, 5, true, server_inc);
    send(sock, 0x1111, 5, 5, false, server_inc, psx::Op::read);
    CHECK(answer(sock).call == 5);
    // For another incarnation of the server: refused unexecuted.
    send(sock, 0x1111, 6, 6, false, server_inc + 1);
    rh = answer(sock);
    CHECK(rh.call == 6);
    CHECK(rh.status == wire::Status::peer_lost);
    CHECK(rh.text.find("restarted after this request was sent to it") != std::string::npos);
    CHECK(applied() == 2);
    // A new process of worker 1: its hello makes the server lose the one
    // before (the policy goes on without it), and it numbers from 1 again.
    zmq::socket_t again = process(0x2222);
    send(again, 0x2222, 1, 1, false, server_inc, psx::Op::join);
    CHECK(answer(again).call == 1);
    send(again, 0x2222, 2, 2, false, server_inc);
    CHECK(answer(again).status == wire::Status::ok);
    CHECK(applied() == 3);
    // The process before, still alive, is refused: it is not the worker's now.
    send(sock, 0x1111, 7, 7, false, server_inc);
    rh = answer(sock);
    CHECK(rh.status == wire::Status::peer_lost);
    CHECK(rh.text.find("serves another process of this worker") != std::string::npos);
    CHECK(applied() == 3);
    const psx::ServerStats st = w.server_stats().at(0);
    CHECK(st.retried == 4);
    CHECK(st.duplicates == 3);
    CHECK(st.pushes == 3);
    send(again, 0x2222, 3, 3, false, server_inc, psx::Op::leave);
    CHECK(answer(again).call == 3);
    w.leave();
    chief.shutdown();
  }
  server.join();
  CHECK(how == "returned");
}

namespace {

// SGD with lr 1 that takes `delay` per update: a deliberately slow server.
struct SlowSgd {
  std::chrono::microseconds delay{20};
  std::size_t slots() const { return 0; }
  void update(std::span<float> p, std::span<const float> g, const psx::SlotView&, const psx::UpdateContext&) const {
    for (std::size_t i = 0; i < p.size(); ++i) p[i] -= g[i];
    const auto until = std::chrono::steady_clock::now() + delay;
    while (std::chrono::steady_clock::now() < until) {
    }
  }
};
static_assert(psx::Optimizer<SlowSgd>);

}  // namespace

TEST_CASE("zmq: pushes far beyond max_in_flight against a slow server wait for room: all applied once, in order") {
  // PSX_ZMQ_SOAK=n pushes n (docs/faults.md reports 1,000,000); 20,000 by default.
  const char* soak = std::getenv("PSX_ZMQ_SOAK");
  const std::size_t n = soak ? std::strtoull(soak, nullptr, 10) : 20000;
  psx_test::Watchdog dog("zmq backpressure soak", std::chrono::seconds(soak ? 3600 : 240));
  TempDir dir;
  const ClusterSpec c = spec(1, 1, false, dir.path);
  using Slow = ZmqCluster<psx::partition::HashByName, psx::sync::Asynchronous, SlowSgd>;
  const psx::ClusterConfig config{1, 1, std::chrono::milliseconds(20000)};
  auto cap = [](Zmq z) {
    z.max_in_flight = 64;
    return z;
  };
  std::exception_ptr server_error;
  std::thread server([&] {
    try {
      Slow ps(config, {}, {}, {}, cap(settings(c, "ps", 0, dir.path)));
      ps.declare({.name = "w", .shape = {4}, .init = psx::Initializer::constant(0.0f)});
      ps.run([](psx::Worker&) {});
    } catch (...) {
      server_error = std::current_exception();
    }
  });
  {
    Slow chief(config, {}, {}, {}, cap(settings(c, "chief", 0, dir.path)));
    chief.declare({.name = "w", .shape = {4}, .init = psx::Initializer::constant(0.0f)});
    const auto started = std::chrono::steady_clock::now();
    chief.run([&](psx::Worker& w) {
      // Up to 4096 handles held here, 64 messages in flight at the server:
      // push_async waits for room.
      const std::vector<float> g{1.0f, 0.5f, 0.25f, 0.125f};
      std::deque<psx::Handle> held;
      for (std::size_t k = 0; k < n; ++k) {
        held.push_back(w.push_async("w", g));
        if (held.size() == 4096) {
          held.front().wait();
          held.pop_front();
        }
      }
      for (auto& h : held) h.wait();
      std::vector<float> v(4);
      w.pull("w", v);
      // Every push applied once: n times g, exactly (small integers and halves).
      CHECK(v == std::vector<float>{-1.0f * static_cast<float>(n), -0.5f * static_cast<float>(n),
                                    -0.25f * static_cast<float>(n), -0.125f * static_cast<float>(n)});
      const psx::ServerStats st = w.server_stats().at(0);
      CHECK(st.pushes == n);
      CHECK(st.errors == 0);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      std::ifstream status("/proc/self/status");
      std::string line, peak;
      while (std::getline(status, line))
        if (line.starts_with("VmHWM:")) peak = line.substr(6);
      MESSAGE(n << " pushes against a server taking 20 us per update, 64 in flight: " << s << " s, "
                << static_cast<double>(n) / s << " per second; this process's peak resident memory" << peak);
    });
  }
  server.join();
  if (server_error) std::rethrow_exception(server_error);
}

TEST_CASE("zmq: a server stops when the chief dies while others wait, when a worker died before the stop, and after a chief that never left") {
  psx_test::Watchdog dog("zmq dead peers", std::chrono::seconds(120));
  using namespace std::chrono_literals;
  auto declare = [](auto& ps) { ps.declare(psx::dense("w", {100}, psx::Initializer::constant(1.0f))); };
  auto fingerprint_of = [&](auto sync) {
    psx::ParameterServer<psx::partition::RowRange, decltype(sync), psx::optim::SGD> ps({1, 2}, {}, {}, {0.1f});
    declare(ps);
    return wire::fingerprint(1, 2, ps.variables());
  };
  const psx::ClusterConfig config{1, 2, 1000ms};  // a real peer beats every 250 ms
  SUBCASE("the chief dies while worker 1 waits on its step: the server stops with peer_lost") {
    // When the server itself declared the chief lost (worker 1's pull waits
    // on it) before its loop saw the silence, the loop took that for a chief
    // that had left and served on for ever: a race, which a run catches
    // about once in four without the fix; eight runs (9 in 10 catch it).
    using Sync = ZmqCluster<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD>;
    // 400 ms: the server's tick (every timeout / 4) then ends nearly every
    // pass of its loop, which is what the race needs; 300 ms of starvation
    // of worker 1's beats would fail the check below, not hang.
    const psx::ClusterConfig fast{1, 2, 400ms};
    for (int trial = 0; trial < 8; ++trial) {
      TempDir dir;
      const ClusterSpec c = spec(1, 2, false, dir.path);
      std::atomic<bool> ended{false};
      std::string how;
      std::thread server = serve<Sync>(fast, c, dir.path, declare, ended, how);
      std::thread worker1([&] {
        Sync w(fast, {}, {}, {0.1f}, settings(c, "worker", 0, dir.path));
        declare(w);
        try {
          w.run([](psx::Worker& wk) {
            std::vector<float> v(100), g(100, 1.0f);
            wk.pull("w", v);
            wk.push("w", g);
            wk.step();
            wk.pull("w", v);  // waits for the chief's step 0, which never comes
          });
        } catch (const psx::error&) {  // the chief was lost: expected
        }
      });
      {
        RawWorker chief(published_endpoint(dir.path), 0, fingerprint_of(psx::sync::Synchronous{}), 2);
        for (int k = 0; k < 6; ++k) {
          chief.send(psx::Op::heartbeat);
          std::this_thread::sleep_for(100ms);
        }
      }  // the chief dies
      const auto died = std::chrono::steady_clock::now();
      while (!ended && std::chrono::steady_clock::now() - died < 10s) std::this_thread::sleep_for(10ms);
      CHECK_MESSAGE(ended.load(), "trial " << trial << ": the server still serves 10 s after the chief died");
      server.join();
      worker1.join();
      CHECK(how.find("the chief (worker 0) sent nothing for") != std::string::npos);
    }
  }
  SUBCASE("the chief left, then died before its stop: the server stops with peer_lost") {
    // A chief that had left was never lost: a crash after training (in an
    // export, say) kept every server serving for ever.
    using Async = ZmqCluster<psx::partition::RowRange, psx::sync::Asynchronous, psx::optim::SGD>;
    TempDir dir;
    const ClusterSpec c = spec(1, 2, false, dir.path);
    std::atomic<bool> ended{false};
    std::string how;
    std::thread server = serve<Async>(config, c, dir.path, declare, ended, how);
    {
      RawWorker chief(published_endpoint(dir.path), 0, fingerprint_of(psx::sync::Asynchronous{}), 2);
      chief.send(psx::Op::leave, 2);
      std::this_thread::sleep_for(100ms);
    }  // the chief dies
    const auto died = std::chrono::steady_clock::now();
    while (!ended && std::chrono::steady_clock::now() - died < 10s) std::this_thread::sleep_for(10ms);
    CHECK_MESSAGE(ended.load(), "the server still serves 10 s after the chief died");
    server.join();
    CHECK(how.find("the chief (worker 0) sent nothing for") != std::string::npos);
  }
  SUBCASE("worker 1 died, then the chief finished and said stop: the server stops after the peer timeout") {
    // After the stop nobody waits on progress, so the server loses no
    // silent worker itself, and the dead one kept it serving for ever.
    using Async = ZmqCluster<psx::partition::RowRange, psx::sync::Asynchronous, psx::optim::SGD>;
    TempDir dir;
    const ClusterSpec c = spec(1, 2, false, dir.path);
    std::atomic<bool> ended{false};
    std::string how;
    std::thread server = serve<Async>(config, c, dir.path, declare, ended, how);
    {
      RawWorker w1(published_endpoint(dir.path), 1, fingerprint_of(psx::sync::Asynchronous{}), 2);
      w1.send(psx::Op::heartbeat);
      std::this_thread::sleep_for(100ms);
    }  // worker 1 dies
    {
      Async chief(config, {}, {}, {0.1f}, settings(c, "chief", 0, dir.path));
      declare(chief);
      chief.run([](psx::Worker& w) {
        std::vector<float> v(100), g(100, 1.0f);
        w.pull("w", v);
        w.push("w", g);
        w.step();
      });
    }  // stop sent
    const auto stopped = std::chrono::steady_clock::now();
    while (!ended && std::chrono::steady_clock::now() - stopped < 10s) std::this_thread::sleep_for(10ms);
    CHECK_MESSAGE(ended.load(), "the server still serves 10 s after the chief's stop");
    server.join();
    CHECK(how == "returned");
  }
  SUBCASE("the chief drove its worker by hand and never called leave(): its stop lets worker 1 and the server go") {
    // No peer timeout: worker 1's step waited for ever on a worker 0 that
    // could send nothing more once its process had closed the cluster, and
    // the server served for ever for both.
    using Sync = ZmqCluster<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD>;
    const psx::ClusterConfig untimed{1, 2};
    TempDir dir;
    const ClusterSpec c = spec(1, 2, false, dir.path);
    std::atomic<bool> ended{false};
    std::string how;
    std::thread server = serve<Sync>(untimed, c, dir.path, declare, ended, how);
    Sync other(untimed, {}, {}, {0.1f}, settings(c, "worker", 0, dir.path));
    declare(other);
    std::atomic<bool> trained{false};
    std::string other_how = "running";
    std::thread worker1([&] {
      try {
        other.run([](psx::Worker& wk) {
          std::vector<float> v(100), g(100, 1.0f);
          wk.push("w", g);
          wk.step();
          wk.pull("w", v);  // step 1 of both
          wk.push("w", g);
          wk.step();
          wk.pull("w", v);  // waits for the chief's step 2, which never comes
        });
        other_how = "returned";
      } catch (const std::exception& e) {
        other_how = e.what();
      }
      trained = true;
    });
    std::vector<float> v(100);
    {
      Sync chief(untimed, {}, {}, {0.1f}, settings(c, "chief", 0, dir.path));
      declare(chief);
      psx::Worker w = chief.worker(0);
      w.push("w", std::vector<float>(100, 1.0f));
      w.step();
      w.pull("w", v);
    }  // no leave(); the cluster's close sends the stop
    CHECK(v[0] == doctest::Approx(0.9f));  // the mean of both step-0 gradients applied
    const auto stopped = std::chrono::steady_clock::now();
    while (!(trained && ended) && std::chrono::steady_clock::now() - stopped < 10s)
      std::this_thread::sleep_for(10ms);
    CHECK_MESSAGE(trained.load(), "worker 1 still waits 10 s after the chief's stop");
    if (!trained) other.shutdown();  // a clean failure rather than the watchdog's abort
    worker1.join();
    CHECK(other_how == "returned");
    CHECK_MESSAGE(ended.load(), "the server still serves 10 s after the chief's stop");
    server.join();
    CHECK(how == "returned");
  }
}

TEST_CASE("wire: sizes whose frame arithmetic would overflow are refused before anything is allocated") {
  // A push_rows item of one id whose gradient count claims 2^62 - 1 floats:
  // 2^64 - 4 bytes, which must not wrap into "no frames needed".
  std::vector<std::uint64_t> ids = {3};
  psx::Request r;
  r.op = psx::Op::push_rows;
  psx::Item item;
  item.variable = 1;
  item.ids = ids;
  r.items.push_back(item);
  std::vector<wire::Segment> segs;
  auto h = wire::encode_request(r, {1, 2, 64}, segs);
  wire::put(h, wire::request_fixed_bytes + 16, (std::uint64_t{1} << 62) - 1);
  std::vector<std::span<const std::byte>> frames = {h, std::as_bytes(std::span(ids))};
  CHECK(psx_test::message_of<psx::wire_error>([&] { (void)wire::decode_request(frames, {}, "test"); }) ==
        "psx: test, item 0: a 18446744073709551612-byte tensor, but only 0 bytes follow");
  // Ids that claim more than what follows.
  wire::put(h, wire::request_fixed_bytes + 16, std::uint64_t{0});
  wire::put(h, wire::request_fixed_bytes + 8, std::uint64_t{1} << 61);
  CHECK(psx_test::message_of<psx::wire_error>([&] { (void)wire::decode_request(frames, {}, "test"); }) ==
        "psx: test, item 0: a size overflows 64 bits (2305843009213693952 x 8)");
  wire::put(h, wire::request_fixed_bytes + 8, std::uint64_t{1} << 40);
  CHECK(psx_test::message_of<psx::wire_error>([&] { (void)wire::decode_request(frames, {}, "test"); }) ==
        "psx: test, item 0: a 8796093022208-byte tensor, but only 8 bytes follow");
}

TEST_CASE("wire: answers asked for in all beyond the message limit are refused before anything is allocated") {
  // Each item was held to the limit, not their sum: a million items naming
  // one 64 MiB shard made a server allocate 64 TiB of answers.
  psx::Request r;
  r.op = psx::Op::pull;
  std::vector<float> out(100);  // 400 bytes back per item
  for (std::uint32_t k = 0; k < 11; ++k) {
    psx::Item item;
    item.variable = 1;
    item.out = out;
    r.items.push_back(item);
  }
  wire::Limits limits;
  limits.max_message_bytes = 4400;
  std::vector<wire::Segment> segs;
  const auto h = wire::encode_request(r, {1, 2, 64}, segs);
  std::vector<std::span<const std::byte>> frames = {h};
  CHECK(wire::decode_request(frames, limits, "test").request.items.size() == 11);  // 4400 bytes: at the limit
  limits.max_message_bytes = 4399;
  CHECK(psx_test::message_of<psx::wire_error>([&] { (void)wire::decode_request(frames, limits, "test"); }) ==
        "psx: test: items 0 to 10 ask for 4400 bytes back, over the message limit of 4399");
}

TEST_CASE("wire: a failure reason longer than a receiver takes is cut, not refused") {
  psx::Request r;
  r.op = psx::Op::fail;
  r.reason = std::string(100000, 'x');
  std::vector<wire::Segment> segs;
  const auto h = wire::encode_request(r, {0, 2, 64}, segs);
  std::vector<std::span<const std::byte>> frames = {h};
  CHECK(wire::decode_request(frames, {}, "test").request.reason == std::string(wire::Limits{}.max_text_bytes, 'x'));
}

// One server (declare_fuzz) on a thread and a chief here, over tcp: `body`
// gets the chief and what it read of each variable before anything ran.
template <class Body>
void with_one_server(const char* name, Body&& body) {
  psx_test::Watchdog dog(name);
  TempDir dir;
  const ClusterSpec c = spec(1, 1, false, dir.path);
  ServerThread server(c, dir.path, 1, [](auto& ps) { declare_fuzz(ps); });
  {
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::SGD> chief(
        {1, 1, std::chrono::milliseconds(2000)}, {}, {}, {}, settings(c, "chief", 0, dir.path));
    declare_fuzz(chief);
    body(chief, chief.read("w"), chief.read("emb"), chief.read("frozen"));
    chief.worker(0).leave();
  }
  server.thread.join();
  REQUIRE_FALSE(server.error);
}

TEST_CASE("zmq: many requests in flight from one worker, answered into the right buffers") {
  with_one_server("zmq in flight", [](auto& chief, const auto& w0, const auto& e0, const auto&) {
    psx::Worker w = chief.worker(0);
    // 16 pulls of different rows, all sent before any is waited for.
    std::vector<std::vector<std::uint64_t>> ids(16);
    std::vector<std::vector<float>> rows(16, std::vector<float>(3 * 8));
    std::vector<std::vector<float>> dense(16, std::vector<float>(1000));
    std::vector<psx::Handle> handles;
    for (std::size_t k = 0; k < 16; ++k) {
      ids[k] = {k, 100 + k, 499 - k};
      handles.push_back(w.pull_rows_async("emb", ids[k], rows[k]));
      handles.push_back(w.pull_async("w", dense[k]));
    }
    for (auto& h : handles) h.wait();
    for (std::size_t k = 0; k < 16; ++k) {
      CHECK(dense[k] == w0);
      for (std::size_t j = 0; j < 3; ++j)
        for (std::size_t d = 0; d < 8; ++d) CHECK(rows[k][j * 8 + d] == e0[ids[k][j] * 8 + d]);
    }
  });
}

TEST_CASE("zmq: a pull left unwaited that waits on a worker waiting for this one is cancelled at its server") {
  // As in process (tests/core/parameter_server.cpp): the chief leaves a pull
  // unwaited that waits for worker 1's second step while worker 1 waits for
  // the chief in a barrier, then throws or lets the handle go
  // (psx_test::drop_a_kept_pull).
  psx_test::Watchdog dog("zmq unwaited pull", std::chrono::seconds(120));
  for (const bool throws : {true, false}) {
    CAPTURE(throws);
    std::mutex mu;
    std::vector<std::string> outcomes;
    std::vector<float> end;
    for_each_task(1, 2, false, [&](const std::string& type, std::size_t, Zmq z) {
      std::string outcome = "returned";
      try {
        ZmqCluster<psx::partition::RowRange, psx::sync::Synchronous, psx::optim::SGD> cluster(
            {1, 2, std::chrono::milliseconds(20000)}, {}, {}, psx::optim::SGD{0.1f}, z);
        cluster.declare(psx::dense("x", {4}));
        cluster.run([&](psx::Worker& w) {
          psx_test::drop_a_kept_pull(w, [&](psx::Handle& h) {
            if (throws) throw std::runtime_error("boom");
            h = psx::Handle();
          });
        });
        if (type == "chief") {
          std::lock_guard lock(mu);
          end = cluster.read("x");
        }
      } catch (const std::exception& e) {
        outcome = e.what();
      }
      std::lock_guard lock(mu);
      outcomes.push_back(type + ": " + outcome);
    });
    std::sort(outcomes.begin(), outcomes.end());
    REQUIRE(outcomes.size() == 3);
    INFO("outcomes: " << outcomes[0] << " | " << outcomes[1] << " | " << outcomes[2]);
    if (throws) {
      CHECK(outcomes[0] == "chief: boom");
      CHECK(outcomes[2].find("worker: ") == 0);
      CHECK(outcomes[2].find("worker 0 was lost (its function threw: boom)") != std::string::npos);
    } else {
      CHECK(outcomes == std::vector<std::string>{"chief: returned", "ps: returned", "worker: returned"});
      CHECK(end == std::vector<float>(4, -0.2f));
    }
  }
}

TEST_CASE("zmq: callers on several threads send on the worker's sockets at once, each answer lands in its buffer") {
  // Callers send on the server's socket themselves (no hand-off to the I/O
  // thread) while the I/O thread receives on it: 4 threads, each with its
  // own handle on the worker, keep pulls in flight at the same time.
  with_one_server("zmq callers on threads", [](auto& chief, const auto& w0, const auto& e0, const auto& f0) {
    std::atomic<int> wrong{0};
    std::vector<std::thread> callers;
    for (std::size_t t = 0; t < 4; ++t)
      callers.emplace_back([&, t] {
        psx::Worker w = chief.worker(0);
        std::mt19937_64 rng(t);
        for (int round = 0; round < 100; ++round) {
          std::vector<std::uint64_t> ids(1 + rng() % 20);
          for (auto& id : ids) id = rng() % 500;
          std::vector<float> rows(ids.size() * 8), dense(1000), frozen(777);
          auto a = w.pull_rows_async("emb", ids, rows);
          auto b = w.pull_async("w", dense);
          auto d = w.pull_async("frozen", frozen);
          a.wait();
          b.wait();
          d.wait();
          bool ok = dense == w0 && frozen == f0;
          for (std::size_t j = 0; j < ids.size(); ++j)
            ok = ok && std::memcmp(rows.data() + j * 8, e0.data() + ids[j] * 8, 8 * sizeof(float)) == 0;
          if (!ok) ++wrong;
        }
      });
    for (auto& t : callers) t.join();
    CHECK(wrong.load() == 0);
  });
}

TEST_CASE("zmq: a call finished on another thread wakes the thread waiting for it, and only that one") {
  // A waiter sleeps on an eventfd of its own (detail_zmq::Sleepers): no
  // other waiter can drain its wake-up, so its sleep needs no short timeout.
  using psx::transport::detail_zmq::Sleepers;
  Sleepers sleepers;
  psx::Completion a(1), b(1);
  auto readable = [](const Sleepers::Entry& e) {
    ::pollfd p{e.waker->fd(), POLLIN, 0};
    return ::poll(&p, 1, 0) == 1;
  };
  // The steps of two waiting threads (one for `a`, one for `b`) and the
  // main thread, in turn; the waiters' eventfds live as long as they do.
  std::mutex mu;
  std::condition_variable cv;
  int stage = 0;
  auto at = [&](int n) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return stage >= n; });
  };
  auto next = [&] {
    {
      std::lock_guard lock(mu);
      ++stage;
    }
    cv.notify_all();
  };
  Sleepers::Entry ea, eb;
  std::thread ta([&] {
    ea = sleepers.enter(a);
    next();  // 1
    at(3);
    sleepers.leave(ea);
    next();  // 4
    at(6);
  });
  at(1);
  std::thread tb([&] {
    eb = sleepers.enter(b);
    next();  // 2
    at(4);
    sleepers.wake(&b);  // a waiter does not wake itself
    next();  // 5
    at(6);
  });
  at(2);
  REQUIRE(ea.waker != nullptr);
  REQUIRE(eb.waker != nullptr);
  REQUIRE(ea.waker->fd() != eb.waker->fd());
  a.finish();
  sleepers.wake(&a);
  CHECK(readable(ea));
  CHECK_FALSE(readable(eb));
  ea.waker->drain();
  next();  // 3: a's thread leaves
  at(5);   // and b's has tried to wake itself
  CHECK_FALSE(readable(eb));
  sleepers.wake(&a);  // nobody waits for `a` any more
  CHECK_FALSE(readable(ea));
  b.finish();
  sleepers.wake(&b);
  CHECK(readable(eb));
  sleepers.leave(eb);  // the main thread may take a waiter's entry off
  eb.waker->drain();
  sleepers.wake(&b);
  CHECK_FALSE(readable(eb));
  next();  // 6: both end
  ta.join();
  tb.join();
}

TEST_CASE("zmq: a wait at a thread's exit, after its eventfd is closed, goes without one") {
  // The destructor of a Handle held in a thread_local (or a static) made
  // before the thread's first wait runs after the thread's eventfd is
  // closed; a wait there must not poll, drain or register that descriptor
  // (its number may be another file's by then).
  using psx::transport::detail_zmq::Sleepers;
  Sleepers sleepers;
  psx::Completion a(1);
  struct AtExit {
    Sleepers* sleepers = nullptr;
    const psx::Completion* done = nullptr;
    int* waker = nullptr;  // 1: the wait at exit had an eventfd
    ~AtExit() {
      if (!sleepers) return;
      const Sleepers::Entry e = sleepers->enter(*done);
      *waker = e.waker != nullptr;
      sleepers->leave(e);
    }
  };
  int first = -1, at_exit = -1;
  std::thread t([&] {
    thread_local AtExit late;  // made before the eventfd, so destroyed after it
    late.sleepers = &sleepers;
    late.done = &a;
    late.waker = &at_exit;
    const Sleepers::Entry e = sleepers.enter(a);
    first = e.waker != nullptr;
    sleepers.leave(e);
  });
  t.join();
  CHECK(first == 1);
  CHECK(at_exit == 0);
}

TEST_CASE("zmq: the chief collects the counters of a server in another process") {
  with_one_server("zmq stats", [](auto& chief, const auto& w0, const auto&, const auto&) {
    psx::Worker w = chief.worker(0);
    std::vector<float> dense(1000);
    w.pull("w", dense);
    w.pull("w", dense);
    CHECK(dense == w0);
    // This process runs no server: its own counters say nothing of it.
    CHECK_THROWS_AS(chief.server_stats(0), psx::config_error);
    const std::vector<psx::ServerStats> got = w.server_stats();
    REQUIRE(got.size() == 1);
    CHECK(got[0].pulls >= 2);  // and the chief's reads of the variables
    CHECK(got[0].bytes_out >= 2 * 1000 * sizeof(float));
    CHECK(got[0].parameter_bytes == (1000 + 500 * 8 + 777) * sizeof(float));
    CHECK(got[0].slot_bytes == 0);
    CHECK(got[0].errors == 0);
    CHECK(got[0].staleness.size() == psx::staleness_buckets);
    // A second snapshot counts the first stats request.
    const auto again = w.server_stats();
    CHECK(again[0].requests == got[0].requests + 1);
  });
}

namespace {

// A dynamic table trained by every worker; after the last step the chief
// pulls the rows of every id it ever pushed.
constexpr std::uint64_t dynamic_ids[] = {0, 1, 77, 1ull << 40, 0x9e3779b97f4a7c15ull, UINT64_MAX};

template <class PS>
std::vector<float> train_dynamic(PS& cluster) {
  cluster.declare(psx::embedding("emb", 4, psx::Initializer::uniform(-1.0f, 1.0f, 3)));
  std::vector<float> result;
  cluster.run([&](psx::Worker& w) {
    std::vector<float> rows(std::size(dynamic_ids) * 4), g(rows.size());
    for (std::size_t step = 0; step < 6; ++step) {
      w.pull_rows("emb", dynamic_ids, rows);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = psx_test::toy_grad(rows[i], w.index(), step, i);
      w.push_rows("emb", std::span(dynamic_ids).subspan(w.index() % 2), std::span<const float>(g).subspan((w.index() % 2) * 4));
      w.step();
    }
    w.barrier();
    if (w.index() == 0) {
      result.resize(rows.size());
      w.pull_rows("emb", dynamic_ids, result);
    }
  });
  return result;
}

}  // namespace

TEST_CASE("zmq: a dynamic embedding table trains over tcp as in process, bit for bit") {
  psx_test::Watchdog dog("zmq dynamic table", std::chrono::seconds(120));
  const psx::ClusterConfig config{2, 3, std::chrono::milliseconds(20000)};
  std::vector<float> over_zmq;
  std::mutex mu;
  for_each_task(2, 3, false, [&](const std::string& type, std::size_t, Zmq z) {
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::Adagrad> cluster(
        config, {}, {}, psx::optim::Adagrad{.lr = 0.1}, z);
    auto rows = train_dynamic(cluster);
    std::lock_guard lock(mu);
    if (type == "chief") over_zmq = std::move(rows);
  });
  psx::LocalCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::Adagrad> local(
      config, {}, {}, psx::optim::Adagrad{.lr = 0.1});
  const std::vector<float> in_process = train_dynamic(local);
  REQUIRE(over_zmq.size() == in_process.size());
  CHECK(std::memcmp(over_zmq.data(), in_process.data(), in_process.size() * sizeof(float)) == 0);
  // Training moved every row away from its initial value.
  std::vector<float> initial(4);
  psx::Initializer::uniform(-1.0f, 1.0f, 3).fill_row("emb", UINT64_MAX, initial);
  CHECK(std::vector<float>(in_process.end() - 4, in_process.end()) != initial);
}

namespace {

// What the chief sees of a table trained by train_dynamic, and how it sees it.
struct TableViews {
  std::vector<psx::TableStats> stats;
  psx::TableExport whole, pages, delta, merged, after;
};

// train_dynamic's training, then the chief's table_stats, a full export (in
// one page a server, and in pages of 3 rows), more training, a delta (in
// pages of 2 entries) merged into the export, and a full export again.
template <class PS>
TableViews table_views(PS& cluster) {
  cluster.declare(psx::embedding("emb", 4, psx::Initializer::uniform(-1.0f, 1.0f, 3)));
  TableViews v;
  const std::size_t page3 = (psx::detail::page_header_floats + 3 * (2 + 4)) * sizeof(float);
  const std::size_t page2 = (psx::detail::page_header_floats + 2 * (2 + 4)) * sizeof(float);
  cluster.run([&](psx::Worker& w) {
    auto train = [&](std::size_t from, std::size_t to) {
      std::vector<float> rows(std::size(dynamic_ids) * 4), g(rows.size());
      for (std::size_t step = from; step < to; ++step) {
        w.pull_rows("emb", dynamic_ids, rows);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = psx_test::toy_grad(rows[i], w.index(), step, i);
        const std::size_t skip = (w.index() + step) % 3;  // some rows change, some do not
        w.push_rows("emb", std::span(dynamic_ids).subspan(skip), std::span<const float>(g).subspan(skip * 4));
        w.step();
      }
      w.barrier();  // every push in before the chief looks
    };
    train(0, 6);
    if (w.is_chief()) {
      v.stats = cluster.table_stats("emb");
      v.whole = cluster.export_table("emb");
      v.pages = w.export_table("emb", {}, page3);
    }
    w.barrier();
    train(6, 9);
    if (w.is_chief()) {
      v.delta = cluster.export_table("emb", v.whole.cursor, page2);
      v.merged = v.whole;
      v.merged.merge(v.delta);
      v.after = w.export_table("emb");
    }
  });
  return v;
}

}  // namespace

TEST_CASE("zmq: table_stats and export_table reach every server process, and equal the in-process cluster's") {
  psx_test::Watchdog dog("zmq table exports", std::chrono::seconds(120));
  const psx::ClusterConfig config{2, 3, std::chrono::milliseconds(20000)};
  TableViews over_zmq;
  std::mutex mu;
  for_each_task(2, 3, false, [&](const std::string& type, std::size_t, Zmq z) {
    ZmqCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::Adagrad> cluster(
        config, {}, {}, psx::optim::Adagrad{.lr = 0.1}, z);
    TableViews v = table_views(cluster);
    if (type == "ps") CHECK_THROWS_WITH_AS(cluster.table_stats("emb"), doctest::Contains("a process without workers"),
                                           psx::config_error);
    std::lock_guard lock(mu);
    if (type == "chief") over_zmq = std::move(v);
  });
  psx::LocalCluster<psx::partition::HashByName, psx::sync::Synchronous, psx::optim::Adagrad> local(
      config, {}, {}, psx::optim::Adagrad{.lr = 0.1});
  const TableViews in_process = table_views(local);
  REQUIRE(over_zmq.stats.size() == 2);
  std::uint64_t rows = 0;
  for (std::size_t s = 0; s < 2; ++s) {
    CHECK(over_zmq.stats[s].rows == in_process.stats[s].rows);
    CHECK(over_zmq.stats[s].admitted == in_process.stats[s].admitted);
    rows += over_zmq.stats[s].rows;
  }
  CHECK(rows == std::size(dynamic_ids));
  CHECK(over_zmq.whole.ids.size() == std::size(dynamic_ids));
  CHECK(over_zmq.whole.sorted() == in_process.whole.sorted());
  CHECK(over_zmq.pages.sorted() == over_zmq.whole.sorted());
  CHECK(over_zmq.pages.cursor == over_zmq.whole.cursor);
  CHECK(!over_zmq.delta.ids.empty());
  CHECK(over_zmq.delta.sorted() == in_process.delta.sorted());
  CHECK(over_zmq.merged.sorted() == over_zmq.after.sorted());
  CHECK(over_zmq.after.sorted() == in_process.after.sorted());
  CHECK(over_zmq.after.sorted() != over_zmq.whole.sorted());
}
