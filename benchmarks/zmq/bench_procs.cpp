// bench_procs: a psx worker and a psx server in two processes, next to raw
// cppzmq moving the same bytes between the same two processes, in the same
// run (bench_zmq.cpp is the one-process version, over tcp and ipc; this is
// what a real job runs: two processes, two address spaces, tcp loopback).
//
// The program forks before any ZeroMQ context exists. The child is the
// server process: a psx server (one ps task) and a raw ROUTER on a thread of
// its own; the parent is the worker process: the psx chief (worker 0) and a
// raw DEALER. The raw ROUTER's endpoint comes back over a socketpair, psx's
// through a rendezvous directory. The child dies with the parent
// (PR_SET_PDEATHSIG) and is killed and reaped on every way out of main;
// every wait between the two (the endpoint, each raw answer, psx's peer
// timeout, the child's exit) has a deadline.
//
// What is measured, each psx figure next to a reference timed back to back
// with it in the same round:
//   round trips: a push of 64 B and of 4 KiB, answered (raw: the bytes as a
//       borrowed frame, answered with 1 byte);
//   pipelined pushes of 1 MiB, 16 MiB and 256 MiB, several in flight
//       (Worker::push_async and a window of Handles; raw: the same number of
//       borrowed messages in flight, each answered with 1 byte): GB/s;
//   sparse pushes of 100k ids at row widths 8, 16 and 64 into a 2^20-row
//       table, ids distinct (a sample without repeats) or Zipf(1.1) (with
//       repeats, which the server sums), next to two references: raw, the
//       ids and the rows as two borrowed frames answered with 1 byte, and
//       the floor, a dense psx push of the same bytes (ids + rows) as one
//       message (issue 36: a sparse push within 1.1x of it for distinct ids,
//       1.3x for Zipf); the floor's own line puts it next to raw;
//   sparse pulls of the same ids (raw: the ids go, the raw server gathers
//       their rows from a table of its own and answers them, the client
//       copies them into its buffer, as psx's worker does).
// The server runs three times, as three clusters one after the other: with
// an optimizer that does nothing (so the round trips, streams and pulls
// measure the transport and the server's handling alone), with plain SGD
// and with Adagrad; the sparse pushes and their floor (a dense push with
// the same optimizer) are measured in each. Raw is measured again in each,
// so that every ratio compares two things timed in the same rounds.
//
// Timing, as bench_zmq's: each round times every contestant of a figure
// back to back, a different one first in each round; a contestant's time
// is that of enough calls to last a few tens of milliseconds (a stream: at
// least twice as many pushes as it keeps in flight); the times printed are
// medians over the rounds, and a ratio is the median of the rounds' own
// ratios with their range (this VM's speed drifts by up to 30% between
// rounds; a ratio within a round compares two things under the same
// conditions). Round trips run three times as many rounds (they are short).
//
// Where the process may run on two CPUs or more, each process runs on a CPU
// of its own, as on two hosts: the worker process on the first CPU of its
// affinity set, the server process on the second (PSX_BENCH_PIN=0 leaves
// them to the scheduler). A pinned process may run on one CPU, so psx's
// waiting thread does not spin there (Zmq::busy_poll applies only to a
// process that may run on two CPUs or more): PSX_BUSY_POLL_US=n sets
// busy_poll, which matters only with PSX_BENCH_PIN=0.
//
//   ./bench_procs [reps] [--quick]   (reps: rounds, 9 by default; --quick:
//                                     2 rounds and shorter batches, ~20 s)
#include "placement.hpp"

#include <psx/psx.hpp>
#include <psx/transport/zmq.hpp>

#include "../zipf.hpp"

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

constexpr std::size_t table_rows = std::size_t{1} << 20, sparse_ids = 100000;
constexpr std::array<std::size_t, 3> widths = {8, 16, 64};
constexpr std::size_t max_width = 64;
// Bounds every wait on the other process (a raw answer, the endpoint, the
// child's exit); psx's own waits have its peer timeout (30 s).
constexpr auto deadline = std::chrono::seconds(30);

// The transport and the server alone: gradients are received and dropped.
struct Discard {
  std::size_t slots() const { return 0; }
  void update(std::span<float>, std::span<const float>, const psx::SlotView&, const psx::UpdateContext&) const {}
};

template <class O>
using Cluster = psx::ParameterServer<psx::partition::HashByName, psx::sync::Asynchronous, O, psx::transport::Zmq>;

// A pipelined push: `in_flight` pushes of `floats` unanswered at most, for
// `target` seconds a round (and twice `in_flight` pushes at least: 256 MiB
// pushes make rounds of 4, about a second each way; with 2 in flight, the
// server process holds up to 512 MiB of them at once).
struct Stream {
  const char* name;  // the label and the variable
  std::size_t floats;
  std::size_t in_flight;
  double target;
};
constexpr std::array<Stream, 3> streams = {
    {{"1 MiB", 1 << 18, 4, 0.15}, {"16 MiB", 1 << 22, 4, 0.15}, {"256 MiB", 1 << 26, 2, 0.0}}};
constexpr std::array<std::size_t, 2> round_trip_floats = {16, 1024};  // 64 B, 4 KiB

std::string table_name(std::size_t width) { return "emb" + std::to_string(width); }
std::string floor_name(std::size_t width) { return "floor" + std::to_string(width); }
// The floor's floats: the bytes of the ids (8 each) and of the rows.
std::size_t floor_floats(std::size_t width) { return sparse_ids * (width + sizeof(std::uint64_t) / sizeof(float)); }

// The same variables in both processes; the dense ones of the round trips
// and the streams only where they are measured (the first cluster).
template <class PS>
void declare(PS& ps, bool transport_figures) {
  if (transport_figures) {
    for (const std::size_t n : round_trip_floats) ps.declare(psx::dense("rt" + std::to_string(n), {n}));
    for (const Stream& s : streams) ps.declare(psx::dense(std::string("stream ") + s.name, {s.floats}));
  }
  for (const std::size_t w : widths) {
    ps.declare(psx::sparse(table_name(w), table_rows, w));
    ps.declare(psx::dense(floor_name(w), {floor_floats(w)}));
  }
}

psx::transport::Zmq task(const fs::path& rendezvous, const char* type) {
  psx::transport::Zmq z;
  z.tf.cluster = psx::transport::ClusterSpec::local(1, 1);
  z.tf.task = {type, 0};
  z.rendezvous = rendezvous.string();
  if (const char* b = std::getenv("PSX_BUSY_POLL_US")) z.busy_poll = std::chrono::microseconds(std::atoi(b));
  return z;
}

// --- the two processes ---------------------------------------------------------

using psx_bench::Placement;
using psx_bench::placement;

void run_on(int cpu) { psx_bench::run_on(cpu, "bench_procs"); }

// The server process: forked at construction, running `serve(fd)` with one
// end of a socketpair (the other is this side's); killed and reaped by the
// destructor unless `finish` reaped it first.
class ServerProcess {
 public:
  template <class Serve>
  explicit ServerProcess(Serve&& serve) {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0)
      throw std::runtime_error(std::string("socketpair: ") + std::strerror(errno));
    const pid_t parent = ::getpid();
    std::fflush(nullptr);  // nothing buffered gets printed twice
    pid_ = ::fork();
    if (pid_ < 0) {
      ::close(fds[0]);
      ::close(fds[1]);
      throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    }
    if (pid_ == 0) {
      ::close(fds[0]);
      // Dies with the worker process, whatever kills it.
      if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(2);
      int status = 1;
      try {
        status = serve(fds[1]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_procs (server process): %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "bench_procs (server process): an exception of unknown type\n");
      }
      ::_exit(status);  // no atexit handlers or stdio buffers of the parent's
    }
    ::close(fds[1]);
    fd_ = fds[0];
  }
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;
  ~ServerProcess() {
    if (fd_ >= 0) ::close(fd_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  // A line the child wrote, without its newline; throws when none comes
  // within `deadline` or the child closed its end.
  std::string read_line() {
    std::string line;
    const auto until = Clock::now() + deadline;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
      pollfd p{fd_, POLLIN, 0};
      const int ready = left > 0 ? ::poll(&p, 1, static_cast<int>(left)) : 0;
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0)
        throw std::runtime_error("the server process said nothing for " + std::to_string(deadline.count()) + " s");
      char c;
      const ssize_t n = ::read(fd_, &c, 1);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw std::runtime_error("the server process ended (" + status_text(reap(Clock::now())) + ")");
      if (c == '\n') return line;
      line += c;
    }
  }

  // Closes the socketpair (the child's cue to exit) and reaps the child,
  // killing it after `deadline`; its exit status, as text.
  std::string finish() {
    ::close(fd_);
    fd_ = -1;
    return status_text(reap(Clock::now() + deadline));
  }

 private:
  // Waits for the child until `until`, then kills it; its wait status.
  int reap(Clock::time_point until) {
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_ || (r < 0 && errno != EINTR)) break;
      if (Clock::now() >= until) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    pid_ = -1;
    return status;
  }
  static std::string status_text(int status) {
    if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) return std::string("killed by ") + strsignal(WTERMSIG(status));
    return "status " + std::to_string(status);
  }

  pid_t pid_ = -1;
  int fd_ = -1;
};

// The rendezvous directory and its three subdirectories (one per cluster:
// a server publishes its port there, and the next one must not find the
// last one's file); removed at the end, after the child is gone.
struct ScratchDir {
  fs::path path;
  ScratchDir() {
    std::string templ = (fs::temp_directory_path() / "psx-bench-procs-XXXXXX").string();
    if (!::mkdtemp(templ.data())) throw std::runtime_error(std::string("mkdtemp: ") + std::strerror(errno));
    path = templ;
    for (const char* sub : {"0", "1", "2"}) fs::create_directory(path / sub);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// --- raw cppzmq ----------------------------------------------------------------

// The raw messages' first frame: a push (any frames after it, answered with
// 1 byte) or a pull of rows (the ids as the next frame, answered with their
// rows of the table of that width).
struct RawHead {
  std::uint32_t op;  // 0: push, 1: pull rows
  std::uint32_t width;
};

// A ROUTER on a thread of its own, with a context of its own, as a process
// has; tables of the same shapes as psx's, for the pulls.
class RawServer {
 public:
  RawServer() : sock_(ctx_, zmq::socket_type::router) {
    for (const std::size_t w : widths) tables_.emplace_back(table_rows * w, 0.25f);
    sock_.set(zmq::sockopt::linger, 0);
    sock_.bind("tcp://127.0.0.1:0");
    endpoint_ = sock_.get(zmq::sockopt::last_endpoint);
    thread_ = std::thread([this] { loop(); });
  }
  RawServer(const RawServer&) = delete;
  RawServer& operator=(const RawServer&) = delete;
  ~RawServer() {
    ctx_.shutdown();  // the loop's receive fails with ETERM
    thread_.join();
  }
  const std::string& endpoint() const { return endpoint_; }

 private:
  void loop() {
    std::vector<zmq::message_t> msg;
    for (;;) {
      msg.clear();
      try {
        if (!zmq::recv_multipart(sock_, std::back_inserter(msg))) continue;
      } catch (const zmq::error_t&) {
        return;
      }
      if (msg.size() < 2 || msg[1].size() != sizeof(RawHead)) continue;
      RawHead head;
      std::memcpy(&head, msg[1].data(), sizeof head);
      std::array<zmq::message_t, 2> reply{std::move(msg[0]), zmq::message_t(1)};
      const auto t = std::find(widths.begin(), widths.end(), head.width);
      if (head.op == 1 && msg.size() == 3 && t != widths.end()) {
        // The rows of the ids, in their order, gathered into the answer.
        const std::size_t w = head.width;
        const std::vector<float>& table = tables_[static_cast<std::size_t>(t - widths.begin())];
        const auto* ids = static_cast<const std::uint64_t*>(msg[2].data());
        const std::size_t n = msg[2].size() / sizeof(std::uint64_t);
        zmq::message_t rows(n * w * sizeof(float));
        auto* out = static_cast<float*>(rows.data());
        for (std::size_t j = 0; j < n; ++j)
          std::memcpy(out + j * w, table.data() + (ids[j] % table_rows) * w, w * sizeof(float));
        reply[1] = std::move(rows);
      }
      try {
        zmq::send_multipart(sock_, reply);
      } catch (const zmq::error_t&) {
        return;
      }
    }
  }

  zmq::context_t ctx_;
  zmq::socket_t sock_;
  std::vector<std::vector<float>> tables_;
  std::string endpoint_;
  std::thread thread_;
};

// A DEALER with a context of its own; sends borrowed frames (the caller's
// buffers stay alive until the answers came), waits at most `deadline`.
class RawClient {
 public:
  explicit RawClient(const std::string& endpoint) : sock_(ctx_, zmq::socket_type::dealer), endpoint_(endpoint) {
    sock_.set(zmq::sockopt::linger, 0);
    sock_.set(zmq::sockopt::rcvtimeo, static_cast<int>(std::chrono::milliseconds(deadline).count()));
    sock_.set(zmq::sockopt::sndtimeo, static_cast<int>(std::chrono::milliseconds(deadline).count()));
    sock_.connect(endpoint);
  }

  // Sends `frames` as one push message (not waiting for its answer).
  void send_push(std::initializer_list<std::span<const std::byte>> frames) {
    RawHead head{0, 0};
    std::vector<zmq::message_t> msg;
    msg.emplace_back(&head, sizeof head);
    for (const auto f : frames) msg.emplace_back(const_cast<std::byte*>(f.data()), f.size(), nullptr, nullptr);
    if (!zmq::send_multipart(sock_, msg)) fail("send");
  }
  void receive(zmq::message_t& answer) {
    if (!sock_.recv(answer)) fail("an answer");
  }
  void push(std::initializer_list<std::span<const std::byte>> frames) {
    send_push(frames);
    zmq::message_t ack;
    receive(ack);
  }
  // `n` pushes of `data`, `in_flight` of them unanswered at most.
  void stream(std::span<const std::byte> data, std::size_t n, std::size_t in_flight) {
    zmq::message_t ack;
    for (std::size_t sent = 0, answered = 0; answered < n;) {
      if (sent < n && sent - answered < in_flight) {
        send_push({data});
        ++sent;
      } else {
        receive(ack);
        ++answered;
      }
    }
  }
  // Sends `ids`; the server answers their rows of width `width`, copied into `out`.
  void pull_rows(std::span<const std::uint64_t> ids, std::size_t width, std::span<float> out) {
    RawHead head{1, static_cast<std::uint32_t>(width)};
    std::vector<zmq::message_t> msg;
    msg.emplace_back(&head, sizeof head);
    msg.emplace_back(const_cast<std::uint64_t*>(ids.data()), ids.size_bytes(), nullptr, nullptr);
    if (!zmq::send_multipart(sock_, msg)) fail("send");
    zmq::message_t rows;
    receive(rows);
    std::memcpy(out.data(), rows.data(), std::min(rows.size(), out.size_bytes()));
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw std::runtime_error("raw DEALER to " + endpoint_ + ": no " + what + " within " +
                             std::to_string(deadline.count()) + " s");
  }
  zmq::context_t ctx_;
  zmq::socket_t sock_;
  std::string endpoint_;
};

// --- timing --------------------------------------------------------------------

double elapsed(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One thing timed: `batch(n)` makes n calls; `seconds` gets each round's
// time per call.
struct Timed {
  Timed(std::function<void(std::size_t)> f, double target_seconds, std::size_t min = 1)
      : batch(std::move(f)), target(target_seconds), min_calls(min) {}
  std::function<void(std::size_t)> batch;
  double target;          // how long a round's batch should last, seconds
  std::size_t min_calls;  // a stream: twice the pushes it keeps in flight
  std::size_t calls = 0;  // set at the first round
  std::vector<double> seconds;

  void time() {
    if (calls == 0) {
      // The first round warms up, and counts the calls that fill `target`.
      const double t = elapsed([&] { batch(min_calls); }) / static_cast<double>(min_calls);
      calls = std::clamp<std::size_t>(static_cast<std::size_t>(std::ceil(target / t)), min_calls, 1 << 16);
    }
    seconds.push_back(elapsed([&] { batch(calls); }) / static_cast<double>(calls));
  }
};

// `rounds` rounds of `group`, each round all of them back to back, a
// different one first each round.
void rounds_of(std::initializer_list<Timed*> group, int rounds) {
  const std::vector<Timed*> g(group);
  for (int r = 0; r < rounds; ++r)
    for (std::size_t k = 0; k < g.size(); ++k) g[(static_cast<std::size_t>(r) + k) % g.size()]->time();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 != 0 ? v[m] : (v[m - 1] + v[m]) / 2;
}

struct Spread {
  double median, lo, hi;
};

// The rounds' own ratios of `a`'s time to `b`'s (`speed`: b's to a's, a
// ratio of throughputs).
Spread ratios(const Timed& a, const Timed& b, bool speed = false) {
  std::vector<double> r(a.seconds.size());
  for (std::size_t i = 0; i < r.size(); ++i)
    r[i] = speed ? b.seconds[i] / a.seconds[i] : a.seconds[i] / b.seconds[i];
  const auto [lo, hi] = std::minmax_element(r.begin(), r.end());
  return {median(r), *lo, *hi};
}

std::string time_text(const Timed& t) {
  const double s = median(t.seconds);
  char buf[32];
  if (s < 1e-3) std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  else std::snprintf(buf, sizeof buf, "%.2f ms", s * 1e3);
  return buf;
}

std::string rate_text(const Timed& t, double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GB/s", bytes / median(t.seconds) / 1e9);
  return buf;
}

// One line of the table: a psx figure, a reference and their ratio.
void row(const std::string& figure, const std::string& psx, const char* ref, const std::string& ref_value, Spread s,
         const char* unit, const std::string& note = {}) {
  std::printf("%-42s %11s   %-5s %11s   %5.2fx %-4s (%.2f-%.2f)%s\n", figure.c_str(), psx.c_str(), ref,
              ref_value.c_str(), s.median, unit, s.lo, s.hi, note.c_str());
  std::fflush(stdout);
}

// --- the worker process -----------------------------------------------------------

struct Options {
  int reps = 9;
  bool quick = false;
  double scale() const { return quick ? 0.5 : 1.0; }  // of every batch's target time
};

// The worker's buffers and ids, made once.
struct Data {
  std::vector<float> dense;                    // the largest stream's, read by every dense push
  std::vector<float> grads;                    // sparse_ids rows of the widest width
  std::vector<float> out;                      // pulled rows
  std::vector<std::uint64_t> distinct, zipf;  // sparse_ids each
  std::size_t zipf_distinct = 0;

  Data() : dense(streams.back().floats, 1e-3f), grads(sparse_ids * max_width, 1e-3f), out(sparse_ids * max_width) {
    // A sample without repeats: the start of a shuffle of every row.
    std::vector<std::uint64_t> all(table_rows);
    std::iota(all.begin(), all.end(), 0);
    std::mt19937_64 rng(1);
    for (std::size_t j = 0; j < sparse_ids; ++j)
      std::swap(all[j], all[j + std::uniform_int_distribution<std::size_t>(0, table_rows - 1 - j)(rng)]);
    distinct.assign(all.begin(), all.begin() + sparse_ids);
    zipf = psx_bench::zipf_ids(sparse_ids, table_rows, 1.1, 2);
    std::vector<std::uint64_t> u = zipf;
    std::sort(u.begin(), u.end());
    zipf_distinct = static_cast<std::size_t>(std::unique(u.begin(), u.end()) - u.begin());
  }
};

// The sparse pushes (and their floor) with the optimizer of `w`'s cluster.
void sparse_pushes(psx::Worker& w, RawClient& raw, Data& d, const Options& o, const char* optimizer) {
  for (const std::size_t width : widths) {
    const std::string table = table_name(width), floor_var = floor_name(width);
    const std::span<const float> grads(d.grads.data(), sparse_ids * width);
    const std::span<const float> dense(d.dense.data(), floor_floats(width));
    const double target = 0.04 * o.scale();
    Timed psx_floor{[&](std::size_t n) {
                      for (std::size_t i = 0; i < n; ++i) w.push(floor_var, dense);
                    },
                    target};
    Timed raw_push{[&](std::size_t n) {
                     for (std::size_t i = 0; i < n; ++i)
                       raw.push({std::as_bytes(std::span<const std::uint64_t>(d.distinct)), std::as_bytes(grads)});
                   },
                   target};
    Timed psx_distinct{[&](std::size_t n) {
                         for (std::size_t i = 0; i < n; ++i) w.push_rows(table, d.distinct, grads);
                       },
                       target};
    Timed psx_zipf{[&](std::size_t n) {
                     for (std::size_t i = 0; i < n; ++i) w.push_rows(table, d.zipf, grads);
                   },
                   target};
    rounds_of({&psx_floor, &raw_push, &psx_distinct, &psx_zipf}, o.reps);
    const std::string x = " x" + std::to_string(width);
    char mb[32];
    std::snprintf(mb, sizeof mb, "%.1f MB", static_cast<double>(dense.size_bytes()) / 1e6);
    row("floor" + x + ": dense push " + mb + ", " + optimizer, time_text(psx_floor), "raw", time_text(raw_push),
        ratios(psx_floor, raw_push), "time", "  (raw: ids + rows, two frames)");
    for (const auto& [label, t, goal] :
         {std::tuple{"distinct", &psx_distinct, "  goal <= 1.1x"}, std::tuple{"Zipf", &psx_zipf, "  goal <= 1.3x"}}) {
      const std::string figure = "sparse push 100k" + x + " " + label + ", " + optimizer;
      row(figure, time_text(*t), "raw", time_text(raw_push), ratios(*t, raw_push), "time");
      row("", "", "floor", time_text(psx_floor), ratios(*t, psx_floor), "time", goal);
    }
  }
}

// The first cluster's figures: round trips, streams, sparse pulls, and the
// sparse pushes with an optimizer that does nothing.
void transport_figures(psx::Worker& w, RawClient& raw, Data& d, const Options& o) {
  for (const std::size_t floats : round_trip_floats) {
    const std::string name = "rt" + std::to_string(floats);
    const std::span<const float> buf(d.dense.data(), floats);
    const double target = 0.02 * o.scale();
    Timed p{[&](std::size_t n) {
              for (std::size_t i = 0; i < n; ++i) w.push(name, buf);
            },
            target};
    Timed r{[&](std::size_t n) {
              for (std::size_t i = 0; i < n; ++i) raw.push({std::as_bytes(buf)});
            },
            target};
    rounds_of({&p, &r}, 3 * o.reps);
    row("push round trip, " + std::string(floats == 16 ? "64 B" : "4 KiB"), time_text(p), "raw", time_text(r),
        ratios(p, r), "time", "  goal <= 1.5x");
  }
  for (const Stream& s : streams) {
    const std::string name = std::string("stream ") + s.name;
    const std::span<const float> buf(d.dense.data(), s.floats);
    const std::size_t k = s.in_flight;
    const double target = s.target * o.scale();
    Timed p{[&](std::size_t n) {
              std::vector<psx::Handle> window(k);
              for (std::size_t i = 0; i < n; ++i) {
                psx::Handle& h = window[i % k];
                h.wait();  // the push `k` before this one
                h = w.push_async(name, buf);
              }
              for (auto& h : window) h.wait();
            },
            target, 2 * k};
    Timed r{[&](std::size_t n) { raw.stream(std::as_bytes(buf), n, k); }, target, 2 * k};
    rounds_of({&p, &r}, o.reps);
    const double bytes = static_cast<double>(buf.size_bytes());
    row("pipelined push " + std::string(s.name) + ", " + std::to_string(k) + " in flight", rate_text(p, bytes), "raw",
        rate_text(r, bytes), ratios(p, r, true), "GB/s", "  goal >= 0.9x");
  }
  sparse_pushes(w, raw, d, o, "no-op");
  for (const std::size_t width : widths) {
    const std::string table = table_name(width);
    const std::span<float> out(d.out.data(), sparse_ids * width);
    const double target = 0.04 * o.scale();
    auto psx_pull = [&](const std::vector<std::uint64_t>& ids) {
      return Timed{[&, table, out](std::size_t n) {
                     for (std::size_t i = 0; i < n; ++i) w.pull_rows(table, ids, out);
                   },
                   target};
    };
    auto raw_pull = [&](const std::vector<std::uint64_t>& ids) {
      return Timed{[&, width, out](std::size_t n) {
                     for (std::size_t i = 0; i < n; ++i) raw.pull_rows(ids, width, out);
                   },
                   target};
    };
    Timed pd = psx_pull(d.distinct), rd = raw_pull(d.distinct), pz = psx_pull(d.zipf), rz = raw_pull(d.zipf);
    rounds_of({&pd, &rd, &pz, &rz}, o.reps);
    const std::string x = " x" + std::to_string(width);
    row("sparse pull 100k" + x + " distinct", time_text(pd), "raw", time_text(rd), ratios(pd, rd), "time");
    row("sparse pull 100k" + x + " Zipf", time_text(pz), "raw", time_text(rz), ratios(pz, rz), "time");
  }
}

// The worker process's side of cluster `index` (its rendezvous subdirectory).
template <class O, class Figures>
void drive(const ScratchDir& dir, int index, O optimizer, Figures&& figures) {
  Cluster<O> chief({1, 1}, {}, {}, optimizer, task(dir.path / std::to_string(index), "chief"));
  declare(chief, index == 0);
  psx::Worker w = chief.worker(0);
  figures(w);
  w.leave();
}

// The server process: the raw ROUTER, its endpoint sent over `fd`, then the
// three clusters' servers in turn; exits when the worker process closes its
// end of `fd` (or after `deadline`).
int serve(int fd, const ScratchDir& dir, int cpu) {
  run_on(cpu);
  RawServer raw;
  const std::string line = "raw " + raw.endpoint() + "\n";
  if (::send(fd, line.data(), line.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(line.size())) return 1;
  auto serve_cluster = [&]<class O>(int index, O optimizer) {
    Cluster<O> ps({1, 1}, {}, {}, optimizer, task(dir.path / std::to_string(index), "ps"));
    declare(ps, index == 0);
    ps.run([](psx::Worker&) {});  // until the chief has shut down
  };
  serve_cluster(0, Discard{});
  serve_cluster(1, psx::optim::SGD{});
  serve_cluster(2, psx::optim::Adagrad{});
  pollfd p{fd, POLLIN, 0};
  char c;
  if (::poll(&p, 1, static_cast<int>(std::chrono::milliseconds(deadline).count())) > 0) (void)::read(fd, &c, 1);
  return 0;
}

std::string loadavg() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  int reps = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      o.quick = true;
    } else if (a.find_first_not_of("0123456789") == std::string::npos && std::atoi(a.c_str()) > 0) {
      reps = std::atoi(a.c_str());
    } else {
      std::fprintf(stderr, "usage: bench_procs [reps] [--quick]\n");
      return 2;
    }
  }
  o.reps = reps > 0 ? reps : o.quick ? 2 : o.reps;
  const auto t0 = Clock::now();
  const std::string load = loadavg();
  const Placement cpu = placement();
  try {
    const ScratchDir dir;
    // Before any ZeroMQ context or thread exists.
    ServerProcess server([&](int fd) { return serve(fd, dir, cpu.server); });
    run_on(cpu.worker);

    std::printf("bench_procs: psx worker and psx server in two processes (fork), next to raw cppzmq (a DEALER in the "
                "worker process, a ROUTER in the server process) moving the same bytes; tcp loopback\n");
    if (cpu.worker >= 0)
      std::printf("worker process on CPU %d, server process on CPU %d (PSX_BENCH_PIN=0: left to the scheduler); "
                  "psx does not spin (a process on one CPU)\n",
                  cpu.worker, cpu.server);
    else
      std::printf("processes left to the scheduler (%u CPUs); psx busy_poll %s\n", std::thread::hardware_concurrency(),
                  std::getenv("PSX_BUSY_POLL_US") ? (std::string(std::getenv("PSX_BUSY_POLL_US")) + " us").c_str()
                                                  : "200 us (the default)");
    std::printf("load average at start: %s; %d rounds (%d for round trips)%s\n", load.c_str(), o.reps, 3 * o.reps,
                o.quick ? ", --quick" : "");

    const std::string hello = server.read_line();
    if (hello.rfind("raw ", 0) != 0) throw std::runtime_error("the server process said '" + hello + "'");
    Data d;
    std::printf("sparse: %zu ids into a table of %zu rows; distinct: a sample without repeats; Zipf(1.1): %zu "
                "distinct ids\n",
                sparse_ids, table_rows, d.zipf_distinct);
    std::printf("%-42s %11s   %-17s   %s\n", "figure", "psx", "reference", "ratio: median (range)");
    {
      RawClient raw(hello.substr(4));
      std::printf("-- server with an optimizer that does nothing: the transport and the server's handling\n");
      drive(dir, 0, Discard{}, [&](psx::Worker& w) { transport_figures(w, raw, d, o); });
      std::printf("-- server with psx::optim::SGD (lr 0.01)\n");
      drive(dir, 1, psx::optim::SGD{}, [&](psx::Worker& w) { sparse_pushes(w, raw, d, o, "SGD"); });
      std::printf("-- server with psx::optim::Adagrad (lr 0.01)\n");
      drive(dir, 2, psx::optim::Adagrad{}, [&](psx::Worker& w) { sparse_pushes(w, raw, d, o, "Adagrad"); });
    }
    const std::string status = server.finish();
    std::printf("ratios: psx time / reference time (GB/s lines: psx GB/s / raw GB/s); took %.0f s; load average at "
                "end: %s\n",
                std::chrono::duration<double>(Clock::now() - t0).count(), loadavg().c_str());
    if (status != "exit status 0") {
      std::fprintf(stderr, "bench_procs: the server process ended with %s\n", status.c_str());
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_procs: %s\n", e.what());
    return 1;
  }
}
