//! @file psx/transport/zmq.hpp
//! `psx::transport::Zmq`: the same ParameterServer across processes and
//! hosts over ZeroMQ (cppzmq over libzmq). Link with `psx::zmq`.
//!
//! Each process is one task of a TensorFlow-style cluster (TF_CONFIG): a
//! `ps` task is one server, the `chief` is worker 0 and TF's `worker` i is
//! psx worker i + 1. Every process runs the same program: it declares the
//! same variables and calls `run`; a server process serves until the chief
//! has shut down and every worker has left (or been lost), a worker process
//! runs its worker. Sockets: each server binds one ROUTER; each worker
//! process connects one DEALER per server: callers send on it from their
//! own threads, an I/O thread takes the answers, so many requests can be in
//! flight. docs/distributed.md tells how to run it,
//! docs/wire.md what travels.
#pragma once

#include <psx/concepts.hpp>
#include <psx/detail/cpus.hpp>
#include <psx/detail/hash.hpp>
#include <psx/detail/table_ops.hpp>
#include <psx/detail/window.hpp>
#include <psx/detail/wire.hpp>
#include <psx/errors.hpp>
#include <psx/message.hpp>
#include <psx/transport/cluster_spec.hpp>
#include <psx/variable.hpp>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {
namespace transport {

//! CurveZMQ encryption and authentication (optional). Keys are Z85 text,
//! 40 characters, as `zmq_curve_keypair` makes them.
struct Curve {
  //! The servers' key pair: servers need both halves, workers the public one.
  std::string server_public_key;
  std::string server_secret_key;
  //! This worker process's own key pair.
  std::string client_public_key;
  std::string client_secret_key;
  //! Servers: the client public keys that may connect; a client not on the
  //! list is refused at the handshake and counted (`ServerStats::rejected`).
  //! Empty: any client that knows the server's public key.
  std::vector<std::string> allowed_clients;

  //! On when `server_public_key` is set; any other field set without it is
  //! refused at start (`config_error`), not run in plain text.
  bool enabled() const noexcept { return !server_public_key.empty(); }

  //! A new key pair {public, secret}.
  static std::pair<std::string, std::string> keypair() {
    char pub[41] = {}, sec[41] = {};
    if (zmq_curve_keypair(pub, sec) != 0)
      throw config_error(std::string("psx: zmq_curve_keypair failed: ") + zmq_strerror(zmq_errno()) +
                         " (libzmq built without CURVE?)");
    return {pub, sec};
  }

  friend bool operator==(const Curve&, const Curve&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Curve& c) {
    // Never print a secret key.
    return os << "Curve{" << (c.enabled() ? "on" : "off") << ", " << c.allowed_clients.size() << " allowed clients}";
  }
};

//! The ZeroMQ transport's settings; `Zmq::from_env()` reads them from
//! TF_CONFIG and PSX_RENDEZVOUS.
struct Zmq {
  //! The cluster and this process's task.
  TfConfig tf;
  //! A directory where a server bound to port 0 publishes its real endpoint
  //! (file `ps-<i>`, taken back when the server closes) and where workers
  //! look for it. Needed only with port 0.
  std::string rendezvous;
  //! How long a worker waits for every server to answer its hello, and a
  //! server for the chief's first message (with or without a peer timeout;
  //! the peer timeout when longer) and for each worker's before a peer
  //! timeout may declare it lost.
  std::chrono::milliseconds start_timeout{30000};
  //! Tensors larger than this travel as several frames.
  std::uint32_t chunk_bytes = ::psx::detail::wire::max_chunk_bytes;
  //! What a server accepts (every size is checked before psx allocates or
  //! reads anything by it; libzmq has received the frames by then, each at
  //! most 2^31 - 1 bytes plus CURVE's framing).
  ::psx::detail::wire::Limits limits;
  //! libzmq I/O threads per process.
  int io_threads = 1;
  //! How long a thread waiting for a small call (64 KiB or less both ways
  //! for every call in flight) polls the sockets without sleeping; an
  //! answer that comes within it is taken without a thread wake-up. Costs
  //! that much CPU per call at most. Spinning during 1 MiB transfers cost
  //! them up to half their throughput on a 2-core machine, hence the size
  //! limit. The waiter yields its CPU between looks, so a libzmq I/O thread
  //! on the same CPU still moves the answer; a process that may run on one
  //! CPU only (its affinity set when the cluster starts) does not spin at
  //! all: there the answer comes only when the waiter lets go of the CPU,
  //! and spinning made 4 KiB round trips 1.5x raw libzmq's, against 1.2x
  //! without (benchmarks/zmq/bench_zmq.cpp under `taskset -c 0`). A thread
  //! spins only while its spins pay: after one that ran out, or during
  //! which another thread took its CPU, it sleeps at once for its next 1,
  //! 2, 4, ... 256 waits before it tries again (on a loaded machine a
  //! spinning worker kept the servers it waited for off the CPUs: the
  //! embedding sweep made 133-150k examples/s spinning, 264k without).
  std::chrono::microseconds busy_poll{200};
  //! The peer timeout a cluster gets when `ClusterConfig::peer_timeout` is
  //! left at `transport_default`: a server silent this long while a call
  //! waits on it fails the call with `psx::peer_lost`, and a worker silent
  //! this long while others wait on it is lost (docs/faults.md). 30 s: far
  //! above a live peer's longest silence (heartbeats every quarter of it;
  //! a server's thread held by a save of a few GiB; a sanitizer build on
  //! two loaded cores), and short enough that a dead peer is named in well
  //! under a minute.
  std::chrono::milliseconds default_peer_timeout{30000};
  //! Messages a worker process may have unanswered at one server: a call
  //! beyond it waits in its send until an answer makes room (backpressure),
  //! so a worker that issues calls faster than a server answers them holds
  //! a bounded number of them (and the server's window of answers stays
  //! within its bound, 65,536, the default). 1 to 2^20.
  std::size_t max_in_flight = std::size_t{1} << 16;
  Curve curve;

  //! TF_CONFIG for the cluster and task, PSX_RENDEZVOUS for `rendezvous`.
  static Zmq from_env() {
    Zmq z;
    z.tf = TfConfig::from_env();
    if (const char* r = std::getenv("PSX_RENDEZVOUS")) z.rendezvous = r;
    return z;
  }

  class link_type;
  std::unique_ptr<link_type> connect(const TransportContext& ctx) const;

  friend bool operator==(const Zmq&, const Zmq&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Zmq& z) {
    return os << "Zmq{task=" << z.tf.task << ", servers=" << z.tf.cluster.num_servers()
              << ", workers=" << z.tf.cluster.num_workers() << ", " << z.curve << "}";
  }
};

namespace detail_zmq {

using clock = std::chrono::steady_clock;
namespace wire = ::psx::detail::wire;

// Whether a tcp endpoint names an IPv6 host ("tcp://[::1]:5555"): libzmq
// binds and connects to one only with ZMQ_IPV6 set on the socket.
inline bool ipv6(std::string_view endpoint) noexcept { return endpoint.starts_with("tcp://["); }

// An exclusive flock on a file of its own, held while it lives: a server
// publishing its endpoint in the rendezvous directory and one taking its
// own back take turns (otherwise the second could remove what a server
// restarted in its place had just published). `held()` is false when the
// file could not be opened or locked.
class FileLock {
 public:
  explicit FileLock(const std::filesystem::path& path) noexcept
      : fd_(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd_ < 0) return;
    int rc;
    do rc = ::flock(fd_, LOCK_EX);
    while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_);  // closing lets the lock go
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool held() const noexcept { return fd_ >= 0; }

 private:
  int fd_;
};

// libzmq binds numeric addresses and interface names only ("No such
// device" for "localhost" or a Kubernetes service name): the tcp endpoint
// with its host name replaced by the host's first IPv4 address, the family
// a worker reaches it by (libzmq resolves a name to IPv4 only unless
// ZMQ_IPV6 is set, and psx sets it for bracketed addresses alone). Empty
// when the endpoint has no host name to resolve; throws config_error when
// the name does not resolve, or resolves to every interface.
inline std::string resolved_endpoint(const std::string& endpoint, const std::string& who) {
  constexpr std::string_view scheme = "tcp://";
  if (!endpoint.starts_with(scheme) || ipv6(endpoint)) return {};
  const std::size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon < scheme.size()) return {};
  const std::string host = endpoint.substr(scheme.size(), colon - scheme.size());
  ::addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  ::addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0 || !found)
    throw config_error("psx: " + who + " cannot bind " + endpoint + ": its host name resolves to no IPv4 address (" +
                       (rc != 0 ? ::gai_strerror(rc) : "none") + "; an IPv6 address goes in brackets, \"[::1]:port\")");
  char text[INET_ADDRSTRLEN] = {};
  const auto* in = reinterpret_cast<const ::sockaddr_in*>(found->ai_addr);
  const bool ok = ::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text) != nullptr;
  const bool any = in->sin_addr.s_addr == htonl(INADDR_ANY);
  ::freeaddrinfo(found);
  if (!ok) throw config_error("psx: " + who + " cannot bind " + endpoint + ": its address cannot be written out");
  if (any)
    throw config_error("psx: " + who + " cannot bind " + endpoint + ": its host name resolves to 0.0.0.0, every "
                       "interface, which psx does not bind (name the interface's own address)");
  return std::string(scheme) + text + endpoint.substr(colon);
}

// Whether a process accepts connections on an ipc endpoint's socket file.
// libzmq removes the file before it binds one (a file left by a process that
// died must not block a restart), so a second server would take a live one's
// path over in silence. An abstract name ("ipc://@...") has no file: the
// kernel refuses a second bind of it itself.
inline bool ipc_in_use(std::string_view endpoint) noexcept {
  constexpr std::string_view scheme = "ipc://";
  if (!endpoint.starts_with(scheme)) return false;
  const std::string_view path = endpoint.substr(scheme.size());
  ::sockaddr_un addr{};
  if (path.empty() || path[0] == '@' || path.size() >= sizeof addr.sun_path) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  // Non-blocking: a listener whose backlog is full (a stopped or swamped
  // server) would block a connect; it is in use too.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  const int r = ::connect(fd, reinterpret_cast<const ::sockaddr*>(&addr), sizeof addr);
  const bool live = r == 0 || errno == EAGAIN || errno == EINPROGRESS;
  ::close(fd);
  return live;
}

// ThreadSanitizer cannot see libzmq (not built with it) hand a message from
// one thread to another, so when both ends are threads of one process (the
// tests run whole clusters that way) it would report the receiver's reads as
// racing with the sender's writes. Every send releases and every receive
// acquires one process-wide token: the order libzmq guarantees, stated to the
// checker. Nothing at all in builds without ThreadSanitizer.
#if defined(__SANITIZE_THREAD__)
#define PSX_ZMQ_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PSX_ZMQ_TSAN 1
#endif
#endif
#ifdef PSX_ZMQ_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
inline char tsan_token;
inline void handing_over() noexcept { __tsan_release(&tsan_token); }
inline void taken_over() noexcept { __tsan_acquire(&tsan_token); }
#else
inline void handing_over() noexcept {}
inline void taken_over() noexcept {}
#endif

inline std::span<const std::byte> bytes_of(const zmq::message_t& m) noexcept {
  return {static_cast<const std::byte*>(m.data()), m.size()};
}

inline zmq::message_t message_of(const std::vector<std::byte>& bytes) {
  return zmq::message_t(bytes.data(), bytes.size());
}

// Lets go of bytes [from, to) of a received frame, copied out and never
// read again (wire::ReleaseFrame): the pages wholly inside them go back to
// the system at once (MADV_DONTNEED: the rest of a large frame is still
// being copied), the whole frame once its last byte is copied. The pages
// hold this frame's bytes only (libzmq keeps its own bookkeeping in front
// of a large frame's data), and none is read again before it is freed.
inline void release(zmq::message_t& m, std::size_t from, std::size_t to) noexcept {
  if (to >= m.size()) {
    m = zmq::message_t();
    return;
  }
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto base = reinterpret_cast<std::uintptr_t>(m.data());
  const std::uintptr_t lo = (base + from + page - 1) / page * page, hi = (base + to) / page * page;
  if (hi > lo) (void)::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

// A frame that borrows `seg` and keeps `owner` alive until libzmq is done
// with it. libzmq calls the free function from its own I/O thread, after
// handing the message over through its lock-free pipes, which a thread
// checker cannot see; the release/acquire pair on `ready` states that order
// in the open (and costs nothing on x86).
template <class Owner>
struct Borrow {
  std::shared_ptr<Owner> owner;
  std::atomic<bool> ready{false};
};

template <class Owner>
zmq::message_t borrowed(const ::psx::detail::wire::Segment& seg, const std::shared_ptr<Owner>& owner) {
  auto* hint = new Borrow<Owner>{owner};
  hint->ready.store(true, std::memory_order_release);
  return zmq::message_t(
      const_cast<std::byte*>(seg.data), seg.size,
      [](void*, void* h) {
        auto* b = static_cast<Borrow<Owner>*>(h);
        (void)b->ready.load(std::memory_order_acquire);
        taken_over();
        delete b;
      },
      hint);
}

// An eventfd that wakes a poll from another thread.
class Waker {
 public:
  Waker() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    if (fd_ < 0) throw config_error("psx: eventfd failed: " + std::string(std::strerror(errno)));
  }
  ~Waker() { ::close(fd_); }
  Waker(const Waker&) = delete;
  Waker& operator=(const Waker&) = delete;
  void wake() noexcept {
    const std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(fd_, &one, sizeof one);
  }
  void drain() noexcept {
    std::uint64_t v;
    [[maybe_unused]] auto n = ::read(fd_, &v, sizeof v);
  }
  int fd() const noexcept { return fd_; }

 private:
  int fd_;
};

// Whether a waiting thread spins before it sleeps, from how its spins went.
// A spin pays where the answer comes within it and the thread had its CPU
// to itself meanwhile; it costs where the answer comes later (the CPU time
// of the whole spin, for nothing) or where other threads wanted the CPU
// (the server or the I/O thread that would answer, on a loaded machine: a
// yield that let one of them run is an involuntary switch of this thread).
// After a spin that did not pay, the thread sleeps at once for its next
// 1, 2, 4, ... up to 256 waits, then tries a spin again; one that paid
// starts it over. On a loaded machine it spins on 1 wait in 257, and on an
// idle one with answers within the spin, on every wait.
class Spin {
 public:
  bool wanted() noexcept {
    if (skip_ == 0) return true;
    --skip_;
    return false;
  }
  void spun(bool answered, bool shared_cpu) noexcept {
    if (answered && !shared_cpu) {
      backoff_ = 0;
      return;
    }
    backoff_ = backoff_ == 0 ? 1 : std::min<unsigned>(2 * backoff_, 256);
    skip_ = backoff_;
  }
  // The calling thread's involuntary context switches so far.
  static long ceded() noexcept {
    ::rusage u{};
    if (::getrusage(RUSAGE_THREAD, &u) != 0) return 0;
    return u.ru_nivcsw;
  }

 private:
  unsigned skip_ = 0;
  unsigned backoff_ = 0;
};

// The threads waiting in `await`, each for one completion and each on an
// eventfd of its own: a call finished on another thread wakes the threads
// waiting for it, and each drains only its own eventfd. (With one eventfd
// shared by every waiter, a waiter could drain the wake-up meant for
// another, which then slept until a timeout; the short timeouts that
// bounded that cost a timer reprogramming at every sleep, ~10 us of a
// virtual machine's CPU per call.)
class Sleepers {
 public:
  struct Entry {
    std::thread::id thread;
    const Completion* done = nullptr;
    Waker* waker = nullptr;  // null: the thread could not get one (no eventfd)
  };

  // Registers the calling thread as waiting for `done`. Never throws: a
  // thread that cannot register gets an entry without a waker and must
  // wake up by itself (a bounded sleep).
  Entry enter(const Completion& done) noexcept {
    Entry e{std::this_thread::get_id(), &done, own()};
    if (!e.waker) return e;
    try {
      std::lock_guard lock(mu_);
      waiting_.push_back(e);
    } catch (...) {
      e.waker = nullptr;
    }
    return e;
  }
  void leave(const Entry& e) noexcept {
    if (!e.waker) return;
    std::lock_guard lock(mu_);
    const auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](const Entry& w) { return w.waker == e.waker; });
    if (it == waiting_.end()) return;
    *it = waiting_.back();
    waiting_.pop_back();
  }
  // Wakes the other threads waiting for `done`.
  void wake(const Completion* done) noexcept {
    const auto me = std::this_thread::get_id();
    std::lock_guard lock(mu_);
    for (const Entry& w : waiting_)
      if (w.done == done && w.thread != me) w.waker->wake();
  }

 private:
  // This thread's eventfd, made at its first wait and kept until it ends.
  // A wait after it is gone (the destructor of a Handle held in a static or
  // thread_local made before it, run at exit) goes without one: its
  // descriptor is closed, and its number may be another file's by then.
  static Waker* own() noexcept {
    thread_local bool gone = false;  // trivially destructible: readable to the end
    struct Held {
      Waker waker;
      ~Held() { gone = true; }
    };
    if (gone) return nullptr;
    try {
      thread_local Held held;
      return &held.waker;
    } catch (...) {  // out of descriptors: retried at the next wait
      return nullptr;
    }
  }

  std::mutex mu_;
  std::vector<Entry> waiting_;
};

inline std::string z85_of(const void* key32) {
  char text[41] = {};
  zmq_z85_encode(text, static_cast<const std::uint8_t*>(key32), 32);
  return text;
}

inline void check_key(const std::string& key, const std::string& what) {
  if (key.size() != 40)
    throw config_error("psx: Curve::" + what + " must be 40 Z85 characters, got " + std::to_string(key.size()));
  std::uint8_t bytes[32];
  if (zmq_z85_decode(bytes, key.c_str()) == nullptr)
    throw config_error("psx: Curve::" + what + " is not Z85 (40 characters of its alphabet)");
}

// zmq::poll, with a signal's EINTR counted as "nothing ready" (a profiler's
// SIGPROF must not end a server).
inline int poll(zmq::pollitem_t* items, std::size_t n, std::chrono::milliseconds timeout) {
  try {
    return zmq::poll(items, n, timeout);
  } catch (const zmq::error_t& e) {
    if (e.num() == EINTR) return 0;
    throw;
  }
}

// The routing id every socket of worker `w`'s process of incarnation
// `process` carries (Zmq::link_type::open_dealer), and that its server
// answers to: 'P' (libzmq wants no 0 first), the worker (u32), the
// incarnation (u64).
inline std::string routing_id(std::uint32_t w, std::uint64_t process) {
  std::string id = "P";
  id.append(reinterpret_cast<const char*>(&w), sizeof w);
  id.append(reinterpret_cast<const char*>(&process), sizeof process);
  return id;
}

inline int ms_until(clock::time_point t, clock::time_point now) {
  if (t <= now) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(t - now).count();
  return static_cast<int>(std::min<std::int64_t>(ms, 1000));
}

}  // namespace detail_zmq

//! The per-process link: a server side when this process is a ps task, a
//! worker side (one DEALER per server, an I/O thread for the answers) when
//! it is a worker.
class Zmq::link_type {
  using clock = detail_zmq::clock;
  static constexpr std::size_t busy_poll_max_bytes = 64 * 1024;

 public:
  // Before the context is made: libzmq asserts on a negative count.
  static int checked_io_threads(int n) {
    if (n < 1 || n > 1024) throw config_error("psx: Zmq::io_threads must be from 1 to 1024, got " + std::to_string(n));
    return n;
  }

  link_type(const Zmq& settings, const TransportContext& ctx)
      : settings_(settings),
        busy_poll_(::psx::detail::usable_cores() > 1 ? settings.busy_poll : std::chrono::microseconds(0)),
        ctx_(ctx),
        fingerprint_(::psx::detail::wire::fingerprint(ctx.num_servers, ctx.num_workers, ctx.variables)),
        zctx_(checked_io_threads(settings.io_threads)) {
    const ClusterSpec& spec = settings_.tf.cluster;
    if (spec.num_servers() != ctx.num_servers || spec.num_workers() != ctx.num_workers)
      throw config_error("psx: the cluster spec has " + std::to_string(spec.num_servers()) + " ps and " +
                         std::to_string(spec.num_workers()) + " workers (chief included), ClusterConfig says " +
                         std::to_string(ctx.num_servers) + " servers and " + std::to_string(ctx.num_workers) +
                         " workers");
    // Beyond a year (milliseconds::max() for "for ever", say) the deadlines
    // overflowed: every peer was lost at once.
    if (settings_.start_timeout < std::chrono::milliseconds(1) || settings_.start_timeout > std::chrono::hours(24 * 366))
      throw config_error("psx: Zmq::start_timeout must be from 1 ms to 366 days, got " +
                         std::to_string(settings_.start_timeout.count()) + " ms");
    if (settings_.max_in_flight < 1 || settings_.max_in_flight > (std::size_t{1} << 20))
      throw config_error("psx: Zmq::max_in_flight must be from 1 to 2^20, got " +
                         std::to_string(settings_.max_in_flight));
    if (settings_.chunk_bytes == 0 || settings_.chunk_bytes > ::psx::detail::wire::max_chunk_bytes)
      throw config_error("psx: Zmq::chunk_bytes must be in [1, 2^31 - 1], got " +
                         std::to_string(settings_.chunk_bytes));
    if (settings_.curve.enabled()) {
      detail_zmq::check_key(settings_.curve.server_public_key, "server_public_key");
      // A key that can never match (a trailing newline) refused every client with no word why.
      for (std::size_t i = 0; i < settings_.curve.allowed_clients.size(); ++i)
        detail_zmq::check_key(settings_.curve.allowed_clients[i], "allowed_clients[" + std::to_string(i) + "]");
      if (zmq_has("curve") == 0) throw config_error("psx: Curve is set but this libzmq has no CURVE support");
    } else if (const Curve& c = settings_.curve; !c.server_secret_key.empty() || !c.client_public_key.empty() ||
                                                 !c.client_secret_key.empty() || !c.allowed_clients.empty()) {
      // Half a configuration would run in plain text, open to every client.
      throw config_error("psx: Curve has keys or an allow-list but no server_public_key: without it nothing is "
                         "encrypted or authenticated; set server_public_key (every process) or clear the Curve "
                         "settings");
    }
    if (settings_.tf.is_server()) {
      server_index_ = settings_.tf.server_index();
      try {
        bind_server();
      } catch (...) {  // no thread may outlive a constructor that failed
        if (zap_.joinable()) {
          zctx_.shutdown();
          zap_.join();
        }
        throw;
      }
    } else {
      worker_index_ = settings_.tf.worker_index();
      try {
        start_worker();
      } catch (...) {  // unanswered hellos must not hold the context open
        for (auto& d : dealers_)
          if (d) d.set(zmq::sockopt::linger, 0);
        throw;
      }
    }
  }

  link_type(const link_type&) = delete;
  link_type& operator=(const link_type&) = delete;
  ~link_type() {
    close();
    if (io_.joinable()) io_.join();
    if (zap_.joinable()) {
      zctx_.shutdown();
      zap_.join();
    }
    unpublish();
  }

  //! Whether this process runs server `s` / worker `w`.
  bool local_server(std::size_t s) const noexcept { return server_index_ && *server_index_ == s; }
  bool local_worker(std::size_t w) const noexcept { return worker_index_ && *worker_index_ == w; }
  //! Processes start in any order: a worker not yet heard from has
  //! `start_timeout` to appear before a peer timeout can declare it lost.
  std::chrono::milliseconds start_grace() const noexcept { return settings_.start_timeout; }
  //! The endpoint this process's server bound (the real port after port 0).
  const std::string& bound_endpoint() const noexcept { return bound_; }

  // -- worker side -------------------------------------------------------------

  //! Sends `r` to server `server`; thread-safe, returns at once. The
  //! request's buffers stay borrowed until its completion finishes.
  void send(std::size_t server, Request&& r) {
    if (!worker_index_) throw config_error("psx: ps task " + std::to_string(*server_index_) + " cannot send requests");
    if (server >= ctx_.num_servers)
      throw config_error("psx: request for server " + std::to_string(server) + " of " +
                         std::to_string(ctx_.num_servers));
    if (r.op == Op::cancel) {
      // The server knows the call by this link's id for it, which goes in
      // the clock; one no longer waiting here was answered: nothing to send.
      if (r.call == 0) return;  // names no call (untagged calls have tag 0)
      Lane& lane = lanes_[server];
      std::lock_guard lane_lock(lane.mu);
      const auto it = std::find_if(lane.pending.begin(), lane.pending.end(),
                                   [&](const auto& p) { return p.second->tag == r.call; });
      if (it == lane.pending.end()) return;
      r.clock = it->first;
    }
    auto call = std::make_shared<WorkerCall>();
    call->sleepers = &sleepers_;
    call->tag = r.call;
    // The call owns the completion only once it is sent or queued: if send
    // throws, the caller finishes this part (Worker::dispatch), and it must
    // not be finished twice.
    std::shared_ptr<Completion> done = std::move(r.done);
    std::vector<::psx::detail::wire::Segment> segs;
    const bool rows = r.op == Op::pull_rows || r.op == Op::push_rows;
    for (Item& item : r.items) {
      WorkerCall::Out o;
      if (!item.out16.empty()) {
        o.kind = ::psx::detail::wire::OutKind::bits16;
        o.dst = reinterpret_cast<std::byte*>(item.out16.data());
      } else if (!item.out.empty()) {
        o.kind = ::psx::detail::wire::OutKind::float32;
        o.dst = reinterpret_cast<std::byte*>(item.out.data());
      }
      const VariableInfo* v = item.variable < ctx_.variables.size() ? &ctx_.variables[item.variable] : nullptr;
      const std::size_t width = v ? v->meta.row_width : 1;
      if (rows && !item.positions.empty()) {
        // Rows spread over several servers: the caller's buffer is in the
        // caller's order, the wire carries this server's rows in id order.
        o.positions = item.positions;
        o.width = width;
        o.count = item.ids.size() * width;
        if (r.op == Op::push_rows) {
          auto& g = call->gathered.emplace_back(item.ids.size() * width);
          for (std::size_t j = 0; j < item.positions.size(); ++j)
            std::memcpy(g.data() + j * width, item.in.data() + item.positions[j] * width, width * sizeof(float));
          item.in = g;
        } else if (o.kind == ::psx::detail::wire::OutKind::bits16) {
          item.out16 = std::span<std::uint16_t>(reinterpret_cast<std::uint16_t*>(o.dst), o.count);
        } else {
          item.out = std::span<float>(reinterpret_cast<float*>(o.dst), o.count);
        }
        item.positions = {};
      } else {
        o.count = o.kind == ::psx::detail::wire::OutKind::bits16 ? item.out16.size() : item.out.size();
      }
      call->bytes += item.in.size_bytes() + item.ids.size_bytes() + o.count * o.elem();
      call->outs.push_back(o);
    }
    ::psx::detail::wire::RequestHead head{0, fingerprint_, settings_.chunk_bytes};
    head.process = incarnation_;
    auto header = ::psx::detail::wire::encode_request(r, head, segs);
    bool wake = false;
    {
      Lane& lane = lanes_[server];
      std::unique_lock lane_lock(lane.mu);
      for (;;) {
        {
          std::lock_guard lock(mu_);
          if (closing_) throw shutdown_error("psx: worker " + std::to_string(*worker_index_) + ": the link is closed");
        }
        // A server that restarted lost what this worker trained there: no
        // call goes on with it (the job returns to its checkpoint instead).
        if (!lane.gone.empty()) throw peer_lost(lane.gone);
        // Backpressure: a call waits for room (an answer, or the failure
        // of the calls there: a dead server is named within the timeout).
        // Clocks, cancels and heartbeats never wait.
        if (!done || lane.pending.size() < settings_.max_in_flight) break;
        lane.room.wait_for(lane_lock, std::chrono::milliseconds(100));
      }
      // Every message but a heartbeat is numbered, in the order the lane
      // sends them (the number is taken under the lane): the server
      // executes a process's messages in that order, each once, holding
      // back one that comes early after a reconnect until those before it
      // are in; and the floor (the lowest call still waited on) never
      // passes a message not yet sent. One that asks for no answer (a
      // clock, leave, fail or cancel) is answered all the same, so that it
      // too is kept until the server has it, and sent again after a drop.
      const std::uint64_t id = r.op == Op::heartbeat ? 0 : lane.next_id++;
      ::psx::detail::wire::put(header, 8, id);
      stamp(header, server, id);
      Frames frames;
      frames.push_back(detail_zmq::message_of(header));
      for (const auto& seg : segs) frames.push_back(detail_zmq::borrowed(seg, call));
      if (id != 0) {
        // Kept to send again after a reconnect (the segments borrow the
        // caller's buffers, which stay borrowed until the call finishes).
        call->header = std::move(header);
        call->segs = std::move(segs);
      }
      // Straight onto the socket from the caller's thread, with no hand-off
      // to the I/O thread, unless older requests still wait (order kept).
      if (!lane.outbox.empty() || !send_frames(dealers_[server], frames)) {
        lane.outbox.push_back(std::move(frames));
        wake = true;
      }
      // Registered before the lane is let go: answers are read only by
      // whoever holds the lane. The silence that counts against a server
      // starts when a call starts waiting on it.
      if (id != 0) {
        call->id = id;
        lane.pending.emplace(id, call);
      }
      call->done = std::move(done);
      // ZMQ_FD is edge-triggered: this send may have taken the notice of an
      // answer that had come, which the I/O thread then would not see.
      if (!wake && (dealers_[server].get(zmq::sockopt::events) & ZMQ_POLLIN)) wake = true;
    }
    if (wake) waker_.wake();
  }

  //! Waits for `done` on the calling thread (Worker calls this before
  //! `done.wait()`): the caller reads the answers itself, as the thread of
  //! a raw cppzmq client does, instead of sleeping until the I/O thread has
  //! read them and woken it. A waiting thread reads every lane (an answer
  //! it takes may be another caller's: that call finishes as the I/O thread
  //! would finish it); while one waits, the I/O thread leaves the sockets
  //! to it and only sends, beats and times out. While every call on the
  //! lanes is small the waiter polls without sleeping for `busy_poll`
  //! first. A call finished on another thread (the I/O thread failing it,
  //! libzmq letting go of its frames last, another waiter reading its
  //! answer) wakes the thread waiting for it through that thread's own
  //! eventfd (detail_zmq::Sleepers).
  //!
  //! The sleeps have no short timeout: a poll whose timeout comes before
  //! the kernel's next tick (4 ms at 250 Hz) makes it reprogram the timer
  //! on going to sleep and again on waking, which on a virtual machine are
  //! two exits to the hypervisor: ~10 us of CPU and of latency per call on
  //! the project's VM, where a 1 ms nap held 1 MiB pushes at 0.91x raw
  //! libzmq, against 0.94-0.95x without (each end on a CPU of its own).
  void await(std::size_t, Completion& done) {
    if (!worker_index_ || !lanes_) return;
    const std::size_t n = dealers_.size();
    std::vector<::pollfd> fds(n + 1);
    waiters_.fetch_add(1);
    const detail_zmq::Sleepers::Entry me = sleepers_.enter(done);
    bool undrained = false;
    struct Leave {
      link_type& l;
      const detail_zmq::Sleepers::Entry& me;
      bool& undrained;
      ~Leave() {
        l.sleepers_.leave(me);
        // The last waiter to go: the I/O thread reads the sockets again,
        // at once if a call still waits for an answer.
        bool wake = undrained;
        if (l.waiters_.fetch_sub(1) == 1)
          for (std::size_t s = 0; s < l.dealers_.size() && !wake; ++s) {
            std::lock_guard lock(l.lanes_[s].mu);
            wake = !l.lanes_[s].pending.empty();
          }
        if (wake) l.waker_.wake();
      }
    } leave{*this, me, undrained};
    bool spun = false;
    for (bool look = false; !done.ready(); look = true) {
      // ZMQ_FD is edge-triggered, and a send looked at its socket last
      // (waking the I/O thread if an answer was there), so the first look
      // is a sleep on the descriptors; each one that woke is read until
      // the socket says EAGAIN, which re-arms its notice.
      bool small = true;
      // Negative: no eventfd of its own (poll skips it), so a bounded sleep.
      fds[0] = {me.waker ? me.waker->fd() : -1, POLLIN, 0};
      for (std::size_t s = 0; s < n; ++s) {
        Lane& lane = lanes_[s];
        std::lock_guard lock(lane.mu);
        if (lane.closed) return;  // the I/O thread finished every call
        if (look) undrained = !read_lane(s) || undrained;
        for (const auto& p : lane.pending) small = small && p.second->bytes <= busy_poll_max_bytes;
        fds[s + 1] = {dealers_[s].get(zmq::sockopt::fd), POLLIN, 0};
      }
      if (undrained || done.ready()) continue;
      int ready = 0;
      if (!spun && small && busy_poll_.count() > 0 && spin_.wanted()) {
        spun = true;
        const auto until = clock::now() + busy_poll_;
        const long ceded = detail_zmq::Spin::ceded();
        // Yielding between looks: the libzmq I/O thread that moves the
        // answer may share this CPU (a process pinned to one), and a spin
        // that kept it off would wait out its whole length.
        for (;;) {
          ready = ::poll(fds.data(), fds.size(), 0);
          if (ready != 0 || clock::now() >= until) break;
          std::this_thread::yield();
        }
        spin_.spun(ready != 0, detail_zmq::Spin::ceded() != ceded);
      }
      // Every wake-up is told (an answer on a socket, a finish on this
      // thread's eventfd); the timeout is a safety net, longer than a tick.
      if (ready == 0) ::poll(fds.data(), fds.size(), me.waker ? 100 : 5);
      if (fds[0].revents & POLLIN) me.waker->drain();
    }
  }

  // -- server side ---------------------------------------------------------------

  //! Runs this process's server loop until the chief said stop and every
  //! worker has gone, until `close()`, or until the chief went silent.
  void serve(std::size_t server, RequestHandler& handler) {
    if (!local_server(server)) return;
    ServerLoop loop{*this, handler};
    loop.run();
    {
      std::lock_guard lock(mu_);
      served_ = true;
    }
    stopped_cv_.notify_all();
  }

  //! Blocks until this process's server loop has ended; returns why when it
  //! ended because the chief was lost (empty otherwise).
  std::string wait_stopped() {
    std::unique_lock lock(mu_);
    stopped_cv_.wait(lock, [&] { return served_ || closing_; });
    return stop_reason_;
  }

  //! Whether this process's server loop has ended by itself (the cluster
  //! done, or its chief lost): the server is no longer touched.
  bool served() {
    std::lock_guard lock(mu_);
    return served_;
  }

  //! Stops every loop; pending calls fail with shutdown_error. The chief
  //! tells every server the cluster is done first.
  void close() noexcept {
    {
      std::lock_guard lock(mu_);
      if (closing_) return;
      closing_ = true;
    }
    waker_.wake();
    stopped_cv_.notify_all();
    if (io_.joinable()) io_.join();
  }

 private:
  // What a worker keeps of one request to one server until it is answered.
  struct WorkerCall {
    struct Out {
      ::psx::detail::wire::OutKind kind = ::psx::detail::wire::OutKind::none;
      std::byte* dst = nullptr;
      std::size_t count = 0;  // elements on the wire
      std::size_t elem() const noexcept { return kind == ::psx::detail::wire::OutKind::bits16 ? 2 : 4; }
      std::span<const std::uint32_t> positions;
      std::size_t width = 0;
    };
    std::shared_ptr<Completion> done;
    std::exception_ptr error;
    std::vector<Out> outs;
    std::vector<std::vector<float>> gathered;
    // The request as sent, to send again after a reconnect.
    std::vector<std::byte> header;
    std::vector<::psx::detail::wire::Segment> segs;
    std::uint64_t id = 0;
    std::uint64_t tag = 0;  // the worker's number for it (Request::call)
    std::size_t bytes = 0;  // payload both ways
    // The link's waiting threads: the one waiting for this call is woken
    // when another thread finishes it.
    detail_zmq::Sleepers* sleepers = nullptr;
    // Finished when the reader and every frame libzmq borrowed let go.
    ~WorkerCall() {
      if (!done) return;
      done->finish(std::move(error));
      if (sleepers && done->ready()) sleepers->wake(done.get());
    }
  };

  // The calls waiting for one server's answer, by call id (ordered: the
  // lowest is the floor a request tells the server).
  using Pending = std::map<std::uint64_t, std::shared_ptr<WorkerCall>>;

  // Fails and forgets every call in `pending`, each with an error of its
  // own from `make_error`.
  template <class MakeError>
  static void fail_calls(Pending& pending, const MakeError& make_error) {
    for (auto& p : pending) p.second->error = make_error();
    pending.clear();
  }

  using Frames = std::vector<zmq::message_t>;

  // What a worker shares with its callers about one server. Callers send on
  // the server's socket themselves; the I/O thread and waiting callers
  // receive on it; the lane's mutex makes them take turns (a socket is not
  // thread-safe, and libzmq allows a socket to move between threads with a
  // full barrier between).
  struct Lane {
    std::mutex mu;
    std::deque<Frames> outbox;  // waits for the socket to take it
    Pending pending;            // sent, waiting for an answer
    std::condition_variable room;  // pending shrank (Zmq::max_in_flight)
    std::uint64_t next_id = 1;  // the next message's number
    std::string gone;           // why no call may go on (the server restarted), once it did
    clock::time_point last_heard = clock::now();
    bool closed = false;  // the I/O thread has ended: the socket is gone
  };

  std::string server_name(std::size_t s) const {
    return "ps task " + std::to_string(s) + " (" + endpoints_.at(s) + ")";
  }
  std::string worker_name() const { return "worker " + std::to_string(worker_index_.value_or(0)); }

  void apply_curve_client(zmq::socket_t& sock) const {
    const Curve& c = settings_.curve;
    if (!c.enabled()) return;
    detail_zmq::check_key(c.client_public_key, "client_public_key");
    detail_zmq::check_key(c.client_secret_key, "client_secret_key");
    try {
      sock.set(zmq::sockopt::curve_serverkey, c.server_public_key);
      sock.set(zmq::sockopt::curve_publickey, c.client_public_key);
      sock.set(zmq::sockopt::curve_secretkey, c.client_secret_key);
    } catch (const zmq::error_t& e) {
      throw config_error("psx: " + worker_name() + ": libzmq refuses the Curve keys: " + e.what());
    }
  }

  // The endpoint of server `s`, from the spec or, for port 0, from the
  // rendezvous directory (waiting for the server to publish it).
  std::string resolve_server(std::size_t s, clock::time_point deadline) const {
    const std::string& address = settings_.tf.cluster.server_address(s);
    if (tcp_port(address) != std::optional<std::uint16_t>(0)) return zmq_endpoint(address);
    if (settings_.rendezvous.empty())
      throw config_error("psx: ps task " + std::to_string(s) + " has address " + address +
                         " (port 0: ephemeral) but no rendezvous directory is set (Zmq::rendezvous, PSX_RENDEZVOUS)");
    const auto file = rendezvous_file(s);
    for (;;) {
      if (std::string endpoint = published(s); !endpoint.empty()) return endpoint;
      if (clock::now() >= deadline)
        throw peer_lost("psx: " + worker_name() + ": ps task " + std::to_string(s) + " (" + address +
                        ") did not publish its endpoint in " + file.string() + " within " +
                        std::to_string(settings_.start_timeout.count()) + " ms");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  // Server `s` is bound to port 0 and has published another endpoint than
  // the one its socket connects to (it restarted on a new port): the
  // socket is made anew for the new endpoint, and true returned. Lane `s`
  // held, or before the I/O thread runs.
  bool moved(std::size_t s) {
    if (settings_.rendezvous.empty() ||
        tcp_port(settings_.tf.cluster.server_address(s)) != std::optional<std::uint16_t>(0))
      return false;
    std::string endpoint = published(s);
    if (endpoint.empty() || endpoint == endpoints_[s]) return false;
    std::swap(endpoints_[s], endpoint);
    try {
      open_dealer(s);
    } catch (...) {  // the old socket stays; the next look tries again
      std::swap(endpoints_[s], endpoint);
      throw;
    }
    answer_from_[s] = worker_name() + ": an answer from " + server_name(s);
    return true;
  }

  // -- server side: bind --------------------------------------------------------

  void bind_server() {
    const std::size_t s = *server_index_;
    const std::string& address = settings_.tf.cluster.server_address(s);
    router_ = zmq::socket_t(zctx_, zmq::socket_type::router);
    router_.set(zmq::sockopt::router_mandatory, 1);
    // A worker that reconnects after a dropped connection comes back with
    // its routing id (open_dealer): the new connection takes it over, and
    // answers go there rather than to the gone one.
    router_.set(zmq::sockopt::router_handover, 1);
    router_.set(zmq::sockopt::linger, 1000);
    router_.set(zmq::sockopt::sndhwm, 0);
    router_.set(zmq::sockopt::rcvhwm, 0);
    const Curve& c = settings_.curve;
    if (c.enabled()) {
      detail_zmq::check_key(c.server_secret_key, "server_secret_key");
      // The handler first: without one, libzmq would let any client in.
      start_zap();
      try {
        router_.set(zmq::sockopt::zap_domain, "psx");
        router_.set(zmq::sockopt::curve_server, 1);
        router_.set(zmq::sockopt::curve_secretkey, c.server_secret_key);
      } catch (const zmq::error_t& e) {
        throw config_error("psx: ps task " + std::to_string(s) + ": libzmq refuses the Curve server key: " + e.what());
      }
    }
    // Frames above the largest chunk (and CURVE's 33 bytes around it, which
    // libzmq counts) are refused by libzmq before they are allocated; it
    // drops the connection, with no answer. Everything within that reaches
    // the wire's checks, Limits::max_message_bytes among them, which answer
    // with a wire_error (a smaller libzmq limit left a worker whose message
    // was over max_message_bytes waiting for ever).
    router_.set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(::psx::detail::wire::max_chunk_bytes + 64));
    // Handshakes that fail the protocol (a client with another server key;
    // a plain-text client of a CURVE server, when its greeting is read
    // before it hangs up) are refused by libzmq before any message: the
    // loop counts them from the router's monitor. (Clients
    // the allow-list refuses are counted by the ZAP handler; connections
    // that just close, such as port probes, are not refusals.)
    if (zmq_socket_monitor(router_.handle(), "inproc://psx-router-monitor", ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) != 0)
      throw config_error(std::string("psx: ps task ") + std::to_string(s) +
                         ": cannot monitor its socket: " + zmq_strerror(zmq_errno()));
    monitor_ = zmq::socket_t(zctx_, zmq::socket_type::pair);
    monitor_.set(zmq::sockopt::linger, 0);
    monitor_.connect("inproc://psx-router-monitor");
    const std::string endpoint = zmq_endpoint(address);
    if (detail_zmq::ipv6(endpoint)) router_.set(zmq::sockopt::ipv6, 1);
    if (detail_zmq::ipc_in_use(endpoint))
      throw config_error("psx: ps task " + std::to_string(s) + " cannot bind " + endpoint +
                         ": Address already in use (a process accepts connections on it)");
    const std::string who = "ps task " + std::to_string(s);
    try {
      // A server restarted in place (port 0) takes its previous incarnation's
      // port back where it is free, so that workers connected to it find
      // the new one there; else a new port, published as usual.
      const std::string before = previous_endpoint(endpoint);
      bool rebound = false;
      if (!before.empty()) try {
          router_.bind(before);
          rebound = true;
        } catch (const zmq::error_t&) {
        }
      if (!rebound) router_.bind(endpoint);
    } catch (const zmq::error_t& e) {
      const std::string numeric = e.num() == ENODEV ? detail_zmq::resolved_endpoint(endpoint, who) : std::string();
      if (numeric.empty()) throw config_error("psx: " + who + " cannot bind " + endpoint + ": " + e.what());
      try {
        router_.bind(numeric);
      } catch (const zmq::error_t& again) {
        throw config_error("psx: " + who + " cannot bind " + endpoint + " (" + numeric + "): " + again.what());
      }
    }
    bound_ = router_.get(zmq::sockopt::last_endpoint);
    if (tcp_port(address) == std::optional<std::uint16_t>(0)) {
      if (settings_.rendezvous.empty())
        throw config_error("psx: ps task " + std::to_string(s) + " binds " + address +
                           " (port 0: ephemeral) but no rendezvous directory is set (Zmq::rendezvous, "
                           "PSX_RENDEZVOUS) to publish the real port in");
      // Written to a temporary name and renamed, so a reader never sees half.
      const auto file = rendezvous_file(s);
      const auto tmp = std::filesystem::path(file) += ".tmp";
      const auto lock_file = std::filesystem::path(file) += ".lock";
      const detail_zmq::FileLock lock(lock_file);
      if (!lock.held())
        throw config_error("psx: " + who + " cannot lock " + lock_file.string() + " to publish its endpoint: " +
                           std::strerror(errno));
      {
        std::ofstream out(tmp, std::ios::trunc);
        out << bound_ << '\n';
        if (!out.flush()) throw config_error("psx: " + who + " cannot write " + tmp.string());
      }
      std::error_code ec;
      std::filesystem::rename(tmp, file, ec);
      if (ec)
        throw config_error("psx: " + who + " cannot publish its endpoint in " + settings_.rendezvous + ": " +
                           ec.message());
      published_ = true;
    }
  }

  // The endpoint a previous incarnation of this server (bound to port 0,
  // `endpoint`) published in the rendezvous directory, where it is on the
  // same host; empty otherwise.
  std::string previous_endpoint(const std::string& endpoint) const {
    if (settings_.rendezvous.empty() || !endpoint.ends_with(":0")) return {};
    const std::string e = published(*server_index_);
    const std::string host = endpoint.substr(0, endpoint.size() - 1);  // "tcp://127.0.0.1:"
    const auto port = e.size() > host.size() && e.starts_with(host) ? e.substr(host.size()) : std::string();
    if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return {};
    return e;
  }

  // The endpoint server `s` has published in the rendezvous directory (the
  // first line of its file), or empty.
  std::string published(std::size_t s) const {
    std::ifstream in(rendezvous_file(s));
    std::string endpoint;
    if (!in || !std::getline(in, endpoint)) return {};
    return endpoint;
  }

  // Where server `s` bound to port 0 publishes its endpoint (`.tmp` and
  // `.lock` beside it), and where workers read it.
  std::filesystem::path rendezvous_file(std::size_t s) const {
    return std::filesystem::path(settings_.rendezvous) / ("ps-" + std::to_string(s));
  }

  // Takes the endpoint this server published back when it goes, unless a
  // server since restarted in its place has published its own: a worker of
  // a later run in the same directory once read the dead port and waited
  // out its start_timeout. (A server that dies without closing leaves it.)
  void unpublish() noexcept {
    if (!published_) return;
    try {
      const auto file = rendezvous_file(*server_index_);
      const detail_zmq::FileLock lock(std::filesystem::path(file) += ".lock");
      if (!lock.held()) return;  // as after a crash: the file stays
      if (published(*server_index_) == bound_) {
        std::error_code ec;
        std::filesystem::remove(file, ec);
      }
    } catch (...) {  // out of memory: the file stays, as after a crash
    }
  }

  // ZeroMQ's authentication protocol (RFC 27): a REP socket on
  // inproc://zeromq.zap.01 that libzmq asks about each CURVE client.
  void start_zap() {
    zap_socket_ = zmq::socket_t(zctx_, zmq::socket_type::rep);
    zap_socket_.bind("inproc://zeromq.zap.01");
    std::set<std::string> allowed(settings_.curve.allowed_clients.begin(), settings_.curve.allowed_clients.end());
    zap_ = std::thread([this, allowed = std::move(allowed)] {
      for (;;) {
        std::vector<zmq::message_t> req;
        try {
          if (!zmq::recv_multipart(zap_socket_, std::back_inserter(req))) continue;
          detail_zmq::taken_over();
        } catch (const zmq::error_t&) {
          break;  // context shut down
        }
        bool ok =
            req.size() >= 7 && req[0].to_string() == "1.0" && req[5].to_string() == "CURVE" && req[6].size() == 32;
        std::string key = ok ? detail_zmq::z85_of(req[6].data()) : std::string();
        ok = ok && (allowed.empty() || allowed.contains(key));
        if (!ok) zap_denied_.fetch_add(1, std::memory_order_relaxed);
        std::vector<zmq::message_t> rep;
        rep.emplace_back(std::string_view("1.0"));
        rep.emplace_back(req.size() > 1 ? req[1].to_string() : std::string());
        rep.emplace_back(std::string_view(ok ? "200" : "400"));
        rep.emplace_back(std::string_view(ok ? "OK" : "client key not allowed"));
        rep.emplace_back(key);
        rep.emplace_back();
        try {
          detail_zmq::handing_over();
          zmq::send_multipart(zap_socket_, rep);
        } catch (const zmq::error_t&) {
          break;
        }
      }
      zap_socket_.close();
    });
  }

  // The server's receive loop, on the thread that called serve().
  class ServerLoop {
   public:
    ServerLoop(link_type& link, RequestHandler& h)
        : l_(link),
          h_(h),
          seen_(link.ctx_.num_workers, false),
          last_heard_(link.ctx_.num_workers),
          windows_(link.ctx_.num_workers),
          welcomed_(link.ctx_.num_workers),
          name_("ps task " + std::to_string(*link.server_index_)) {
      for (std::uint32_t w = 0; w < link.ctx_.num_workers; ++w) senders_.push_back(sender_text(w));
    }

    void run() {
      for (;;) {
        {
          std::lock_guard lock(l_.mu_);
          if (l_.closing_) break;
        }
        if (stop_ && done_serving()) break;
        const auto now = clock::now();
        if (chief_lost(now)) break;
        if (const auto denied = l_.zap_denied_.exchange(0, std::memory_order_relaxed))
          for (std::uint64_t k = 0; k < denied; ++k) h_.link_event(RequestHandler::LinkEvent::rejected);
        if (now >= monitor_due_) {  // not urgent: a look every 100 ms, not a syscall per message
          count_failed_handshakes();
          monitor_due_ = now + std::chrono::milliseconds(100);
        }
        auto until = std::min(h_.next_tick(), now + std::chrono::milliseconds(100));
        // The socket's state first (ZMQ_FD tells only of what changed since
        // it was last looked at), then a sleep on its descriptor unless it
        // has something for us: one look, where zmq::poll takes several.
        const int events = l_.router_.get(zmq::sockopt::events);
        ::pollfd fds[] = {{l_.router_.get(zmq::sockopt::fd), POLLIN, 0}, {l_.waker_.fd(), POLLIN, 0}};
        if (!(events & ZMQ_POLLIN) && (outbox_.empty() || !(events & ZMQ_POLLOUT)))
          ::poll(fds, 2, detail_zmq::ms_until(until, now));
        if (fds[1].revents & POLLIN) l_.waker_.drain();
        // Take what is there, a bounded batch, so ticks and the outbox are not starved.
        for (int k = 0; k < 256; ++k) {
          std::vector<zmq::message_t> msg;
          if (!zmq::recv_multipart(l_.router_, std::back_inserter(msg), zmq::recv_flags::dontwait)) break;
          detail_zmq::taken_over();
          try {
            on_message(std::move(msg));
          } catch (...) {  // e.g. bad_alloc: this message is lost, the server is not
            reject();
          }
        }
        flush();
        const auto after = clock::now();
        if (after >= h_.next_tick()) h_.tick(after);
      }
      // Whatever is still kept fails now; the answers go out if they can.
      const std::string why = "psx: " + name_ + " stopped before answering";
      h_.drain([&] { return std::make_exception_ptr(shutdown_error(why)); });
      flush();
      count_failed_handshakes();  // what came since the last look
      l_.monitor_.close();
      l_.router_.close();
    }

   private:
    struct ServerCall {
      zmq::message_t routing;
      std::vector<zmq::message_t> frames;
      ::psx::detail::wire::Incoming in;
      std::vector<std::unique_ptr<std::uint64_t[]>> replies;
      std::uint32_t worker = 0;  // the request's (it moves to the handler)
      bool windowed = false;     // kept in its worker's window (its answer is remembered)
      std::string reply_to;      // where answers go, when not back on `routing` (detail_zmq::routing_id)
      std::exception_ptr error;  // refused as it came: the answer, in its place in order
    };

    // What a server remembers of one worker process's calls, so that a call
    // sent again after a reconnect is executed once and in order
    // (psx/detail/window.hpp): a kept answer is its header frame and, for a
    // read, its tensors (the call's answer buffers, borrowed again).
    struct Kept {
      std::vector<std::byte> header;
      std::shared_ptr<ServerCall> tensors;
    };
    using Window = ::psx::detail::Window<std::shared_ptr<ServerCall>, Kept>;
    static constexpr ::psx::detail::WindowLimits window_limits{};

    clock::time_point monitor_due_{};

    // Each event the monitor reports (it asks only for failed handshakes)
    // is a refused client.
    void count_failed_handshakes() {
      for (int k = 0; k < 64; ++k) {
        std::vector<zmq::message_t> event;
        try {
          if (!zmq::recv_multipart(l_.monitor_, std::back_inserter(event), zmq::recv_flags::dontwait)) return;
        } catch (const zmq::error_t&) {
          return;
        }
        detail_zmq::taken_over();
        if (!event.empty() && event[0].size() >= 2) h_.link_event(RequestHandler::LinkEvent::rejected);
      }
    }

    bool chief_lost(clock::time_point now) {
      const auto timeout = l_.ctx_.peer_timeout;
      // A chief that said stop is done, not lost: the others may train on
      // for longer than the timeout. One that left is still heard from: its
      // process's I/O thread beats until the process closes the cluster,
      // which sends the stop; so a chief silent after leaving died before
      // its stop (a crash in what it did after training), and is lost as
      // one that never left. One the server declared lost (it went silent
      // while others waited) is lost here too, as its silence tells.
      // A chief that never appears ends the server after start_timeout,
      // with or without a peer timeout.
      const bool chief_seen = seen_[0];
      if (stop_) return false;
      // A restarted job's chief said hello while training had failed here.
      std::string why = superseded_;
      if (why.empty() && !chief_seen &&
          now - started_ > std::max<clock::duration>(l_.settings_.start_timeout, timeout))
        why =
            "the chief (worker 0) never appeared within " + std::to_string(l_.settings_.start_timeout.count()) + " ms";
      else if (why.empty() && timeout.count() > 0 && chief_seen && now - last_heard_[0] > timeout)
        why = "the chief (worker 0) sent nothing for " +
              std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - last_heard_[0]).count()) +
              " ms (peer_timeout " + std::to_string(timeout.count()) + " ms)";
      if (why.empty()) return false;
      std::lock_guard lock(l_.mu_);
      l_.stop_reason_ = "psx: " + name_ + ": " + why;
      return true;
    }

    // After the chief's stop: every worker that spoke has left, been lost,
    // or (with a peer timeout) gone silent for it: after the stop nobody
    // waits on progress, so the server loses no silent worker itself, and
    // one that died would keep this process serving for ever. One that
    // never spoke had start_timeout to appear. (The stop made the chief's
    // own worker leave, if it had not: on_message.)
    bool done_serving() const {
      const auto now = clock::now();
      const bool late = now - started_ > l_.settings_.start_timeout;
      const auto timeout = l_.ctx_.peer_timeout;
      for (std::size_t w = 0; w < seen_.size(); ++w) {
        if (!seen_[w]) {
          if (!late) return false;
          continue;
        }
        const bool silent = timeout.count() > 0 && now - last_heard_[w] > timeout;
        if (h_.worker_state(w) == RequestHandler::WorkerState::active && !silent) return false;
      }
      return true;
    }

    void heard_from(std::uint32_t worker) {
      if (worker >= seen_.size()) return;
      seen_[worker] = true;
      last_heard_[worker] = clock::now();
    }

    // "ps task S: a message from worker W", the context of a request's
    // errors: built once per worker, not at every request.
    std::string sender_text(std::uint32_t worker) const {
      return name_ + ": a message from worker " + std::to_string(worker);
    }
    const std::string& sender(std::uint32_t worker) {
      if (worker < senders_.size()) return senders_[worker];
      other_sender_ = sender_text(worker);  // a worker id out of range: its request fails
      return other_sender_;
    }

    void reject() { h_.link_event(RequestHandler::LinkEvent::rejected); }

    void send_now(std::vector<zmq::message_t>&& frames) {
      outbox_.push_back(std::move(frames));
      flush();
    }

    void answer(const zmq::message_t& routing, std::vector<std::byte> header) {
      std::vector<zmq::message_t> frames;
      frames.emplace_back(routing.data(), routing.size());
      frames.push_back(detail_zmq::message_of(header));
      send_now(std::move(frames));
    }

    // Sends what waits; keeps the rest for when the socket takes more
    // (ROUTER_MANDATORY: a full pipe says EAGAIN instead of dropping).
    void flush() {
      while (!outbox_.empty()) {
        auto& frames = outbox_.front();
        try {
          detail_zmq::handing_over();
          if (!l_.router_.send(frames[0], zmq::send_flags::dontwait | zmq::send_flags::sndmore)) return;
          for (std::size_t k = 1; k < frames.size(); ++k)
            l_.router_.send(frames[k], k + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
        } catch (const zmq::error_t&) {
          // EHOSTUNREACH: the worker's connection is gone (ROUTER_MANDATORY
          // says so instead of dropping the answer in silence).
          h_.link_event(RequestHandler::LinkEvent::undelivered);
        }
        outbox_.pop_front();
      }
    }

    void on_message(std::vector<zmq::message_t>&& msg) {
      if (msg.size() < 2) return reject();
      const auto head = detail_zmq::bytes_of(msg[1]);
      ::psx::detail::wire::Prefix p;
      try {
        p = ::psx::detail::wire::read_prefix(head, name_);
      } catch (const wire_error&) {
        return reject();
      }
      if (p.version != ::psx::detail::wire::version) {
        reject();
        return answer(
            msg[0], ::psx::detail::wire::encode_refuse(
                        ::psx::detail::wire::Status::wire_error,
                        "psx: " + name_ + " speaks " +
                            ::psx::detail::wire::version_text(::psx::detail::wire::version) + ", the peer " +
                            ::psx::detail::wire::version_text(p.version) + ": build every process with the same psx"));
      }
      switch (p.kind) {
        case ::psx::detail::wire::Kind::hello:
          return on_hello(msg, head);
        case ::psx::detail::wire::Kind::request:
          return on_request(std::move(msg));
        case ::psx::detail::wire::Kind::stop:
          // Only from a process of this cluster (the word is its fingerprint),
          // and only the chief's sends it, when it closes the cluster
          // (io_loop): its worker, worker 0, can send nothing more. One
          // driven by hand (`ps.worker(0)`) that never called leave()
          // leaves now, so that no step or barrier of the other workers
          // waits on it and this server does not serve for ever for it.
        {
          ::psx::detail::wire::Stop stop;
          try {
            stop = ::psx::detail::wire::decode_stop(head, name_);
          } catch (const wire_error&) {
            return reject();
          }
          if (stop.fingerprint != l_.fingerprint_) return reject();
          // And only from the chief process this server welcomed: a chief of
          // a generation before this server restarted, going down, must not
          // stop the server that the restarted chief will use.
          if (welcomed_.empty() || welcomed_[0] != stop.process) return reject();
          stop_ = true;
          if (h_.worker_state(0) == RequestHandler::WorkerState::active) {
            Request leave;
            leave.op = Op::leave;
            leave.worker = 0;
            h_.handle(std::move(leave));
          }
          return;
        }
        default:
          return reject();
      }
    }

    void on_hello(std::vector<zmq::message_t>& msg, std::span<const std::byte> head) {
      ::psx::detail::wire::Hello hello;
      try {
        hello = ::psx::detail::wire::decode_hello(head, name_);
      } catch (const wire_error& e) {
        reject();
        return answer(msg[0], ::psx::detail::wire::encode_refuse(::psx::detail::wire::Status::wire_error, e.what()));
      }
      std::string why;
      if (hello.worker >= l_.ctx_.num_workers)
        why = "worker " + std::to_string(hello.worker) + " of a cluster of " + std::to_string(l_.ctx_.num_workers);
      else if (hello.fingerprint != l_.fingerprint_)
        why = "worker " + std::to_string(hello.worker) +
              " declared other variables or another cluster shape (fingerprint " + std::to_string(hello.fingerprint) +
              ", this server " + std::to_string(l_.fingerprint_) + "): every process must declare the same";
      if (!why.empty()) {
        reject();
        return answer(msg[0], ::psx::detail::wire::encode_refuse(
                                  ::psx::detail::wire::Status::config_error,
                                  "psx: " + name_ + " refuses " + why));
      }
      // A new process of a worker this server serves (another incarnation
      // in its hello): the previous one is gone, so it is lost now rather
      // than after the peer timeout, and the sync policy decides
      // (Synchronous fails the cluster: its processes end, and a supervisor
      // that restarts them resumes from the last checkpoint).
      if (hello.process != 0 && msg[0].to_string_view() != detail_zmq::routing_id(hello.worker, hello.process)) {
        // Only the process itself says hello for it (its routing id names
        // it): anything else could take a worker over.
        reject();
        return answer(msg[0], ::psx::detail::wire::encode_refuse(
                                  ::psx::detail::wire::Status::config_error,
                                  "psx: " + name_ + " refuses a hello for worker " + std::to_string(hello.worker) +
                                      ": its connection's routing id does not name that process"));
      }
      std::optional<std::uint64_t>& before = welcomed_[hello.worker];
      if (hello.process == 0 && before && *before != 0) {
        // A sender that does not number its messages (a tool, a test) is
        // answered, and the worker stays its numbered process's.
        heard_from(hello.worker);
        return answer(msg[0], ::psx::detail::wire::encode_signal(::psx::detail::wire::Kind::welcome, l_.incarnation_));
      }
      if (before && *before != 0 && hello.process != 0 && *before != hello.process &&
          h_.worker_state(hello.worker) == RequestHandler::WorkerState::active) {
        Request gone;
        gone.op = Op::fail;
        gone.worker = hello.worker;
        gone.reason = "its process restarted: a new one said hello, so the one before is gone";
        h_.handle(std::move(gone));
      }
      if (const std::string failure = h_.training_failure(); !failure.empty()) {
        // Nothing but reads is served here any more: the new process waits
        // for the server that replaces this one (start_worker). A new chief
        // process means the job is starting again: this server ends now
        // (its supervisor restarts it), not after the old chief's silence.
        if (hello.worker == 0 && hello.process != 0 && before && *before != hello.process && superseded_.empty())
          superseded_ = "training failed here, and a new chief process (a restarted job) said hello";
        reject();
        return answer(msg[0], ::psx::detail::wire::encode_refuse(
                                  ::psx::detail::wire::Status::peer_lost,
                                  "psx: " + name_ + " refuses worker " + std::to_string(hello.worker) +
                                      ": training failed on it (" + failure +
                                      "), and it serves reads only until it ends"));
      }
      // This process is the worker's from now on; its numbered messages
      // start at 1.
      if (!before || *before != hello.process) {
        windows_[hello.worker] = Window(hello.process, window_limits);
      }
      before = hello.process;
      heard_from(hello.worker);
      answer(msg[0], ::psx::detail::wire::encode_signal(::psx::detail::wire::Kind::welcome, l_.incarnation_));
    }

    // Checks an item's reply size against the declared variable before the
    // buffer is allocated; the server checks the rest.
    std::string bad_output(const Request& r, std::size_t i, const ::psx::detail::wire::OutSpec& o) const {
      const Item& item = r.items[i];
      if (r.op == Op::barrier || r.op == Op::join || r.op == Op::save)  // agree_max, run's join, a background save: a u64
        return o.count == 2 && o.kind == ::psx::detail::wire::OutKind::float32
                   ? ""
                   : std::string("a ") + (r.op == Op::join ? "join" : r.op == Op::save ? "background save" : "barrier") +
                         "'s answer is 2 floats";
      if (r.op == Op::stats)  // Worker::server_stats: the counters as float pairs
        return o.count == ::psx::detail::stats_floats && o.kind == ::psx::detail::wire::OutKind::float32
                   ? ""
                   : "a stats answer is " + std::to_string(::psx::detail::stats_floats) + " floats";
      if (r.op == Op::table_stats || r.op == Op::table_export) {  // Worker::table_stats, export_table
        if (r.items.size() != 1) return "a table request carries one item";
        if (item.variable >= l_.ctx_.variables.size()) return "unknown variable " + std::to_string(item.variable);
        const VariableInfo& v = l_.ctx_.variables[item.variable];
        if (v.meta.kind != VariableKind::dynamic) return "'" + v.meta.name + "' is not a dynamic table";
        if (item.shard != *l_.server_index_)
          return "shard " + std::to_string(item.shard) + " of '" + v.meta.name + "' is not on this server";
        if (o.kind != ::psx::detail::wire::OutKind::float32) return "a table answer is floats";
        if (r.op == Op::table_stats)
          return o.count == ::psx::detail::table_stats_floats
                     ? ""
                     : "a table stats answer is " + std::to_string(::psx::detail::table_stats_floats) + " floats";
        return ::psx::detail::is_page_size(o.count, v.meta.row_width)
                   ? ""
                   : "an export page of '" + v.meta.name + "' is " +
                         std::to_string(::psx::detail::page_header_floats) + " floats and whole entries of " +
                         std::to_string(2 + v.meta.row_width) + ", not " + std::to_string(o.count);
      }
      const bool pull = r.op == Op::pull || r.op == Op::read || r.op == Op::pull_rows;
      if (!pull) return o.count == 0 ? "" : "a push asks for values back";
      if (o.count == 0) return "a pull without an output";
      if (item.variable >= l_.ctx_.variables.size()) return "unknown variable " + std::to_string(item.variable);
      const VariableInfo& v = l_.ctx_.variables[item.variable];
      if (item.shard >= v.shards.size() || v.shards[item.shard].server != *l_.server_index_)
        return "shard " + std::to_string(item.shard) + " of '" + v.meta.name + "' is not on this server";
      const std::size_t want =
          r.op == Op::pull_rows ? item.ids.size() * v.meta.row_width : v.shards[item.shard].rows() * v.meta.row_width;
      if (o.count != want)
        return "'" + v.meta.name + "' answers " + std::to_string(want) + " elements, the request asks " +
               std::to_string(o.count);
      return "";
    }

    void on_request(std::vector<zmq::message_t>&& msg) {
      auto call = std::make_shared<ServerCall>();
      call->routing = std::move(msg[0]);
      call->frames.assign(std::make_move_iterator(msg.begin() + 1), std::make_move_iterator(msg.end()));
      std::vector<std::span<const std::byte>> spans;
      spans.reserve(call->frames.size());
      for (const auto& f : call->frames) spans.push_back(detail_zmq::bytes_of(f));
      const auto head = spans[0];
      std::uint64_t call_id = head.size() >= 16 ? ::psx::detail::wire::get<std::uint64_t>(head, 8) : 0;
      const std::uint32_t worker = head.size() >= 36 ? ::psx::detail::wire::get<std::uint32_t>(head, 32) : 0;
      try {
        // A tensor joined from chunks lets go of each frame as it is copied.
        call->in = ::psx::detail::wire::decode_request(
            spans, l_.settings_.limits, sender(worker),
            [&](std::size_t k, std::size_t from, std::size_t to) { detail_zmq::release(call->frames[k], from, to); });
        Request& r = call->in.request;
        if (call->in.head.fingerprint != l_.fingerprint_)
          throw wire_error("psx: " + sender(worker) + " was built from other declarations (fingerprint " +
                           std::to_string(call->in.head.fingerprint) + ", this server " +
                           std::to_string(l_.fingerprint_) + ")");
        if (r.worker >= l_.ctx_.num_workers)
          throw wire_error("psx: " + sender(worker) + ": no such worker in a cluster of " +
                           std::to_string(l_.ctx_.num_workers));
        if (call_id == 0 && !r.items.empty())
          throw wire_error("psx: " + sender(worker) + ": a request with items must ask for an answer");
        for (std::size_t i = 0; i < r.items.size(); ++i) {
          const auto& o = call->in.outs[i];
          if (auto bad = bad_output(r, i, o); !bad.empty())
            throw wire_error("psx: " + sender(worker) + ", item " + std::to_string(i) + ": " + bad);
          if (o.count == 0) continue;
          auto& buf = call->replies.emplace_back(new std::uint64_t[(o.bytes() + 7) / 8]);
          if (o.kind == ::psx::detail::wire::OutKind::bits16)
            r.items[i].out16 = {reinterpret_cast<std::uint16_t*>(buf.get()), static_cast<std::size_t>(o.count)};
          else
            r.items[i].out = {reinterpret_cast<float*>(buf.get()), static_cast<std::size_t>(o.count)};
        }
      } catch (const wire_error&) {
        reject();
        if (call_id == 0) return;
        // Refused, but in its place among its process's messages: those
        // after it are not held back for ever, and its answer is kept.
        const std::uint64_t process = head.size() >= ::psx::detail::wire::request_fixed_bytes
                                          ? ::psx::detail::wire::get<std::uint64_t>(head, ::psx::detail::wire::request_process_at)
                                          : 0;
        call->error = std::current_exception();
        if (process != 0 && worker < windows_.size() && windows_[worker].process() == process) {
          call->worker = worker;
          call->in.head.process = process;
          call->reply_to = detail_zmq::routing_id(worker, process);
          return sequence(call, call_id);
        }
        return reply(call, call_id, call->error);
      }
      Request& r = call->in.request;
      // A cancel names the call by this worker's id for it (in the clock).
      r.call = r.op == Op::cancel ? r.clock : call_id;
      call->worker = r.worker;
      const ::psx::detail::wire::RequestHead& sent = call->in.head;
      if (sent.resend) h_.link_event(RequestHandler::LinkEvent::retried);
      // A request for the server this one replaced does not count as word
      // from its worker either: it may be the last of a process going down.
      const bool stale = sent.incarnation != 0 && sent.incarnation != l_.incarnation_;
      if (stale) {
        // Sent to the server this one replaced (it restarted): not executed.
        // A pong first (or alone, for a heartbeat), so that the worker's next
        // requests name this one; a clock, leave or fail is dropped.
        answer(call->routing, ::psx::detail::wire::encode_signal(::psx::detail::wire::Kind::pong, l_.incarnation_));
        if (call_id == 0) return;
        return reply(call, call_id,
                     std::make_exception_ptr(peer_lost(
                         "psx: " + sender(r.worker) + ": " + name_ +
                         " restarted after this request was sent to it; its previous incarnation's requests are "
                         "lost, and this one was not executed")));
      }
      // A numbered process (a psx worker's) is served only if it is the one
      // this server welcomed for its worker: a process of a generation
      // before (or one still alive beside its restarted successor) is
      // refused, and its clock, leave or fail dropped, so that it cannot
      // change what the worker's current process trains.
      const std::uint64_t process = sent.process;
      if (process != 0) {
        if (windows_[r.worker].process() != process) {
          reject();
          if (call_id == 0) return;
          return reply(call, call_id,
                       std::make_exception_ptr(peer_lost(
                           "psx: " + sender(r.worker) + ": " + name_ +
                           " serves another process of this worker (one that said hello since), or none yet")));
        }
        // Answers go to the process's routing id, so that they reach its
        // newest connection (ZMQ_ROUTER_HANDOVER), also for a request that
        // came on one already replaced (libzmq renames such a connection).
        call->reply_to = detail_zmq::routing_id(r.worker, process);
      } else if ((r.op == Op::fail || r.op == Op::leave) && welcomed_[r.worker].value_or(0) != 0) {
        return reject();  // only a numbered process may end a worker welcomed as one
      }
      heard_from(r.worker);
      if (r.op == Op::heartbeat)
        answer(call->routing, ::psx::detail::wire::encode_signal(::psx::detail::wire::Kind::pong, l_.incarnation_));
      if (process != 0) windows_[r.worker].acknowledge(sent.floor);
      if (process == 0 || call_id == 0) {
        if (call_id != 0) execute(call, call_id);
        else h_.handle(std::move(r));
        return;
      }
      sequence(call, call_id);
    }

    // Runs message `call_id` of its worker's process in order: once each,
    // those that come early held back until the ones before are in.
    void sequence(std::shared_ptr<ServerCall> call, std::uint64_t call_id) {
      Window& win = windows_[call->worker];
      const std::string& from = sender(call->worker);
      switch (win.arrive(call_id, call, !call->error && ::psx::detail::is_read(call->in.request.op))) {
        case Window::Arrival::answered:  // its answer was lost: the same answer again
          h_.link_event(RequestHandler::LinkEvent::duplicate);
          return send_now(remembered(call->worker, win, win.find(call_id)->answer));
        case Window::Arrival::running:  // answered when it completes, or acknowledged (nobody waits)
          h_.link_event(RequestHandler::LinkEvent::duplicate);
          return;
        case Window::Arrival::forgotten:
          h_.link_event(RequestHandler::LinkEvent::duplicate);
          return reply(call, call_id,
                       std::make_exception_ptr(wire_error(
                           "psx: " + from + ": message " + std::to_string(call_id) + " was sent again after " +
                           name_ + " forgot its answer (over " + std::to_string(window_limits.calls) +
                           " in flight); it is not executed twice")));
        case Window::Arrival::overflow:
          reject();
          return reply(call, call_id,
                       std::make_exception_ptr(wire_error(
                           "psx: " + from + ": message " + std::to_string(call_id) + " came while " +
                           std::to_string(win.held()) + " others waited for message " +
                           std::to_string(win.next()) + ", which never came")));
        case Window::Arrival::held:
          // Early: one before it was lost with a connection and comes again
          // after the reconnect. Held back until then, so that the worker's
          // messages are executed in the order it sent them.
          return;
        case Window::Arrival::run:
          break;
      }
      // In order: run, then whatever was held back behind it.
      for (;;) {
        call->windowed = true;
        if (call->error)
          reply(call, call_id, call->error);
        else
          execute(call, call_id);
        auto next = win.release();
        if (!next) break;
        call_id = next->first;
        call = std::move(next->second);
      }
    }

    // Hands a request that asks for an answer to the handler.
    void execute(const std::shared_ptr<ServerCall>& call, std::uint64_t call_id) {
      Request& r = call->in.request;
      r.done = std::make_shared<Completion>(1, [this, call, call_id](std::exception_ptr e) noexcept {
        try {
          reply(call, call_id, std::move(e));
        } catch (...) {  // no memory for the answer: counted, the worker's timeout ends its wait
          h_.link_event(RequestHandler::LinkEvent::undelivered);
        }
      });
      h_.handle(std::move(r));
    }

    // The frames of a remembered answer, to the worker's current connection.
    std::vector<zmq::message_t> remembered(std::uint32_t w, const Window& win, const Kept& e) {
      std::vector<zmq::message_t> frames;
      const std::string to = detail_zmq::routing_id(w, win.process());
      frames.emplace_back(to.data(), to.size());
      frames.push_back(detail_zmq::message_of(e.header));
      if (e.tensors)
        for (const auto& seg : answer_segments(*e.tensors)) frames.push_back(detail_zmq::borrowed(seg, e.tensors));
      return frames;
    }

    std::vector<::psx::detail::wire::Segment> answer_segments(const ServerCall& call) const {
      std::vector<::psx::detail::wire::Segment> segs;
      std::size_t b = 0;
      for (const auto& o : call.in.outs)
        if (o.count != 0)
          ::psx::detail::wire::add_tensor(segs, call.replies[b++].get(), o.bytes(), l_.settings_.chunk_bytes);
      return segs;
    }

    void reply(const std::shared_ptr<ServerCall>& call, std::uint64_t id, std::exception_ptr error) {
      std::vector<std::byte> header;
      std::vector<::psx::detail::wire::Segment> segs;
      if (error) {
        auto [status, text] = ::psx::detail::wire::status_of(error);
        header = ::psx::detail::wire::encode_reply(id, status, text, 0, l_.settings_.chunk_bytes);
      } else {
        segs = answer_segments(*call);
        std::uint32_t tensors = 0;
        for (const auto& o : call->in.outs) tensors += o.count != 0;
        header = ::psx::detail::wire::encode_reply(id, ::psx::detail::wire::Status::ok, {}, tensors,
                                                   l_.settings_.chunk_bytes);
      }
      if (call->windowed) remember(call, id, header, !segs.empty());
      std::vector<zmq::message_t> frames;
      if (call->reply_to.empty())
        frames.emplace_back(call->routing.data(), call->routing.size());
      else
        frames.emplace_back(call->reply_to.data(), call->reply_to.size());
      frames.push_back(detail_zmq::message_of(header));
      for (const auto& seg : segs) frames.push_back(detail_zmq::borrowed(seg, call));
      send_now(std::move(frames));
    }

    // Keeps call `id`'s answer in its worker's window, if the window still
    // waits for it (the worker may have acknowledged it, or restarted).
    void remember(const std::shared_ptr<ServerCall>& call, std::uint64_t id, const std::vector<std::byte>& header,
                  bool tensors) {
      if (call->worker >= windows_.size() || windows_[call->worker].process() != call->in.head.process) return;
      std::size_t bytes = 0;
      if (tensors)
        for (const auto& o : call->in.outs) bytes += o.bytes();
      windows_[call->worker].remember(id, Kept{header, tensors ? call : nullptr}, bytes);
    }

    link_type& l_;
    RequestHandler& h_;
    std::deque<std::vector<zmq::message_t>> outbox_;
    std::vector<bool> seen_;
    const clock::time_point started_ = clock::now();
    bool stop_ = false;
    std::vector<clock::time_point> last_heard_;  // per worker, by heard_from
    std::vector<Window> windows_;                // per worker: its current process's calls
    std::string superseded_;                     // why this server ends for a restarted job, once one said hello
    // Per worker: the incarnation of the process last welcomed (0: one that
    // does not number its messages), none before a hello.
    std::vector<std::optional<std::uint64_t>> welcomed_;
    const std::string name_;  // "ps task S"
    std::vector<std::string> senders_;
    std::string other_sender_;
  };

  // -- worker side: connect, hello, I/O thread -----------------------------------

  void start_worker() {
    const auto deadline = clock::now() + settings_.start_timeout;
    routing_id_ = detail_zmq::routing_id(static_cast<std::uint32_t>(*worker_index_), incarnation_);
    const std::size_t n = ctx_.num_servers;
    endpoints_.resize(n);
    dealers_.resize(n);
    monitors_.resize(n);
    dropped_.assign(n, 0);
    connected_.assign(n, 0);
    const auto hello = [&](std::size_t s) {
      detail_zmq::handing_over();
      dealers_[s].send(detail_zmq::message_of(::psx::detail::wire::encode_hello(
                           {fingerprint_, static_cast<std::uint32_t>(*worker_index_),
                            static_cast<std::uint32_t>(ctx_.num_workers), static_cast<std::uint32_t>(n), incarnation_})),
                       zmq::send_flags::none);
    };
    for (std::size_t s = 0; s < n; ++s) {
      endpoints_[s] = resolve_server(s, deadline);
      answer_from_.push_back(worker_name() + ": an answer from " + server_name(s));
      open_dealer(s);
      hello(s);
    }
    // Every server must welcome us before training starts.
    std::vector<bool> welcomed(n, false);
    incarnations_.assign(n, 0);
    // A server whose training failed refuses a new process with peer_lost:
    // it is about to end, and one restarted in its place will welcome this
    // one, so the hello goes again (every 200 ms) until start_timeout.
    std::vector<std::string> refused(n);
    std::vector<clock::time_point> again(n, clock::time_point::max());
    std::vector<clock::time_point> look(n, clock::now() + std::chrono::milliseconds(200));
    std::size_t missing = n;
    while (missing > 0) {
      const auto now = clock::now();
      if (now >= deadline) {
        std::string who;
        for (std::size_t s = 0; s < n; ++s)
          if (!welcomed[s]) who += (who.empty() ? "" : ", ") + server_name(s) + (refused[s].empty() ? "" : " (" + refused[s] + ")");
        throw peer_lost("psx: " + worker_name() + ": no answer within " +
                        std::to_string(settings_.start_timeout.count()) + " ms (start_timeout) from " + who);
      }
      for (std::size_t s = 0; s < n; ++s) {
        if (welcomed[s]) continue;
        // A server that restarted on another port (port 0) is followed.
        if (now >= look[s]) {
          look[s] = now + std::chrono::milliseconds(200);
          if (moved(s)) again[s] = now;
        }
        if (now >= again[s]) {
          again[s] = clock::time_point::max();
          hello(s);
        }
      }
      std::vector<zmq::pollitem_t> items;
      for (auto& d : dealers_) items.push_back({d.handle(), 0, ZMQ_POLLIN, 0});
      const auto wake = std::min({deadline, *std::min_element(again.begin(), again.end()),
                                  *std::min_element(look.begin(), look.end())});
      detail_zmq::poll(items.data(), items.size(), std::chrono::milliseconds(detail_zmq::ms_until(wake, now)));
      for (std::size_t s = 0; s < n; ++s) {
        // A hello lost with a dropped connection goes again on the new one.
        if (reconnected(s) && !welcomed[s]) hello(s);
        if (!(items[s].revents & ZMQ_POLLIN)) continue;
        std::vector<zmq::message_t> msg;
        if (!zmq::recv_multipart(dealers_[s], std::back_inserter(msg), zmq::recv_flags::dontwait)) continue;
        detail_zmq::taken_over();
        if (msg.empty()) continue;
        const auto head = detail_zmq::bytes_of(msg[0]);
        const auto p = ::psx::detail::wire::read_prefix(head, worker_name() + ": the answer of " + server_name(s));
        if (p.kind == ::psx::detail::wire::Kind::refuse) {
          const auto status = static_cast<::psx::detail::wire::Status>(p.byte7);
          std::string why = ::psx::detail::wire::decode_refuse(head, server_name(s));
          if (status == ::psx::detail::wire::Status::peer_lost && !welcomed[s]) {
            refused[s] = std::move(why);
            again[s] = clock::now() + std::chrono::milliseconds(200);
            continue;
          }
          std::rethrow_exception(::psx::detail::wire::exception_of(status, why));
        }
        if (p.version != ::psx::detail::wire::version)
          throw wire_error("psx: " + worker_name() + ": " + server_name(s) + " speaks " +
                           ::psx::detail::wire::version_text(p.version) + ", this worker " +
                           ::psx::detail::wire::version_text(::psx::detail::wire::version));
        if (p.kind == ::psx::detail::wire::Kind::welcome && !welcomed[s]) {
          incarnations_[s] = ::psx::detail::wire::decode_signal(head, server_name(s));
          welcomed[s] = true;
          --missing;
        }
      }
    }
    lanes_ = std::make_unique<Lane[]>(n);
    io_ = std::thread([this] { io_loop(); });
  }

  // Makes server `s`'s socket (and the monitor that tells of its dropped
  // connections), closing any it had, and connects it. Every socket of
  // this process carries the same routing id, the worker and this
  // process's incarnation: a reconnect after a dropped connection takes
  // the id over at the server (ZMQ_ROUTER_HANDOVER), so answers sent after
  // it reach the new connection instead of the gone one's id.
  void open_dealer(std::size_t s) {
    // The new pair first: a failure (no descriptor left) keeps the old one.
    zmq::socket_t d(zctx_, zmq::socket_type::dealer);
    d.set(zmq::sockopt::routing_id, zmq::buffer(routing_id_));
    const std::string watch = "inproc://psx-dealer-" + std::to_string(s) + "-" + std::to_string(++monitored_);
    if (zmq_socket_monitor(d.handle(), watch.c_str(), ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED) != 0)
      throw config_error("psx: " + worker_name() + " cannot monitor its socket to " + server_name(s) + ": " +
                         zmq_strerror(zmq_errno()));
    zmq::socket_t m(zctx_, zmq::socket_type::pair);
    m.set(zmq::sockopt::linger, 0);
    m.connect(watch);
    d = make_dealer(s, std::move(d));
    close_dealer(s, false);
    dropped_[s] = 0;
    connected_[s] = 0;
    monitors_[s] = std::move(m);
    dealers_[s] = std::move(d);
  }

  // Closes server `s`'s socket and its monitor, if it has them (with the
  // socket's linger, or none). The monitor is stopped first and what it
  // had sent read, so that no event is in flight when the two close (one
  // that was, LeakSanitizer saw libzmq leak now and then).
  void close_dealer(std::size_t s, bool linger) {
    if (dealers_[s]) zmq_socket_monitor(dealers_[s].handle(), nullptr, 0);
    if (monitors_[s]) {
      for (int k = 0; k < 1024; ++k) {
        zmq::message_t event;
        try {
          if (!monitors_[s].recv(event, zmq::recv_flags::dontwait)) break;
        } catch (const zmq::error_t&) {
          break;
        }
        detail_zmq::taken_over();
      }
      monitors_[s].close();
    }
    if (dealers_[s]) {
      if (!linger) dealers_[s].set(zmq::sockopt::linger, 0);
      dealers_[s].close();
    }
  }

  zmq::socket_t make_dealer(std::size_t s, zmq::socket_t d) {
    d.set(zmq::sockopt::linger, 2000);
    // No high-water mark: a worker's requests in flight are bounded by its
    // own calls, and a mark would make libzmq block or drop.
    d.set(zmq::sockopt::sndhwm, 0);
    d.set(zmq::sockopt::rcvhwm, 0);
    apply_curve_client(d);
    if (detail_zmq::ipv6(endpoints_[s])) d.set(zmq::sockopt::ipv6, 1);
    d.connect(endpoints_[s]);
    return d;
  }

  void io_loop() {
    const std::size_t n = dealers_.size();
    const auto timeout = ctx_.peer_timeout;
    const auto beat = timeout.count() > 0 ? std::max<clock::duration>(timeout / 4, std::chrono::milliseconds(1))
                                          : clock::duration::max();
    auto next_beat = timeout.count() > 0 ? clock::now() + beat : clock::time_point::max();
    // Silence is looked at every tenth of the timeout, so a server that
    // died is named within 1.1 times it (its last answer came before it died).
    const auto check = timeout.count() > 0 ? std::max<clock::duration>(timeout / 10, std::chrono::milliseconds(1))
                                           : clock::duration::max();
    auto next_check = timeout.count() > 0 ? clock::now() + check : clock::time_point::max();
    auto last_look = clock::now();
    // A pass of this loop longer than this is a stall: a quarter of the
    // timeout, and at least 50 ms (with a timeout of a few ms, an ordinary
    // pass would count, and a dead server would never be named).
    const auto stall = std::max<clock::duration>(beat, std::chrono::milliseconds(50));
    auto next_look = clock::now();
    // Lane `s` held.
    auto fail_server = [&](std::size_t s, const std::string& why) {
      fail_calls(lanes_[s].pending, [&] { return std::make_exception_ptr(peer_lost(why)); });
      // libzmq may still hold frames that borrow the callers' buffers, in a
      // pipe to a peer that is gone: a new socket (linger 0 on the old one)
      // lets them go, so the failed calls complete, and reconnects to a
      // server that restarts on the same endpoint.
      lanes_[s].outbox.clear();
      open_dealer(s);
    };
    std::vector<::pollfd> fds(2 * n + 1);
    for (;;) {
      {
        std::lock_guard lock(mu_);
        if (closing_) break;
      }
      try {
        const auto now = clock::now();
        const bool beating = now >= next_beat;
        if (beating) next_beat = now + beat;
        const bool checking = now >= next_check;
        if (checking) next_check = now + check;
        // This thread stalled (the process stopped, or starved of a CPU):
        // what the servers sent meanwhile could not be read, so that time
        // is not their silence.
        const auto stalled = now - last_look;
        last_look = now;
        const bool looking = now >= next_look;
        if (looking) next_look = now + std::chrono::milliseconds(200);
        // Per lane: send again what a dropped connection may have lost,
        // send what the socket takes (a full pipe keeps the rest:
        // backpressure), fail the calls past their deadline, beat, and fail
        // a server silent for longer than the peer timeout while calls
        // wait on it.
        for (std::size_t s = 0; s < n; ++s) {
          Lane& lane = lanes_[s];
          std::lock_guard lock(lane.mu);
          if (stalled > stall) lane.last_heard = std::min(now, lane.last_heard + stalled);
          // Without a connection, a look (every 200 ms) for a server that
          // restarted on another port (port 0); what waited goes there.
          const bool away = !connected_[s] && looking;
          if (reconnected(s) || (away && moved(s))) resend_pending(s);
          send_some(s);
          if (beating) {
            Request hb;
            hb.op = Op::heartbeat;
            hb.worker = static_cast<std::uint32_t>(*worker_index_);
            std::vector<::psx::detail::wire::Segment> none;
            ::psx::detail::wire::RequestHead head{0, fingerprint_, settings_.chunk_bytes};
            head.process = incarnation_;
            auto header = ::psx::detail::wire::encode_request(hb, head, none);
            stamp(header, s, 0);
            Frames f;
            f.push_back(detail_zmq::message_of(header));
            lane.outbox.push_back(std::move(f));
            send_some(s);
          }
          if (checking && now - lane.last_heard > timeout && !lane.pending.empty())
            fail_server(s, "psx: " + worker_name() + ": " + server_name(s) + " sent nothing for " +
                               std::to_string(
                                   std::chrono::duration_cast<std::chrono::milliseconds>(now - lane.last_heard).count()) +
                               " ms while requests waited (peer_timeout " + std::to_string(timeout.count()) + " ms)");
        }
        // Take the answers there are, and see whether a socket has more to
        // do; a socket's ZMQ_FD tells only of changes since it was last
        // looked at, so each is looked at (ZMQ_EVENTS) before sleeping.
        bool again = false;
        fds[0] = {waker_.fd(), POLLIN, 0};
        for (std::size_t s = 0; s < n; ++s) {
          Lane& lane = lanes_[s];
          std::lock_guard lock(lane.mu);
          read_lane(s);
          const int events = dealers_[s].get(zmq::sockopt::events);
          if ((events & ZMQ_POLLIN) || (!lane.outbox.empty() && (events & ZMQ_POLLOUT))) again = true;
          fds[s + 1] = {dealers_[s].get(zmq::sockopt::fd), POLLIN, 0};
        }
        if (again) continue;
        // While a caller waits in await it reads the sockets: this thread
        // looks again within 10 ms (the last waiter to go wakes it). The
        // monitors (after the sockets) wake it at a dropped connection.
        const bool waited_on = waiters_.load() > 0;
        for (std::size_t s = 0; s < n; ++s) {
          std::lock_guard lock(lanes_[s].mu);
          fds[n + 1 + s] = {monitors_[s].get(zmq::sockopt::fd), POLLIN, 0};
        }
        if (waited_on) std::copy(fds.begin() + n + 1, fds.end(), fds.begin() + 1);
        ::poll(fds.data(), waited_on ? n + 1 : fds.size(),
               detail_zmq::ms_until(std::min({next_beat, next_check,
                                              now + (waited_on ? std::chrono::milliseconds(10)
                                                               : std::chrono::milliseconds(1000))}),
                                    clock::now()));
        if (fds[0].revents & POLLIN) waker_.drain();
      } catch (...) {
        // Out of memory, or libzmq failing: every waiting call fails with
        // the reason rather than the thread ending and the calls hanging.
        std::string what = "an unknown exception";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        for (std::size_t s = 0; s < n; ++s) {
          std::lock_guard lock(lanes_[s].mu);
          fail_calls(lanes_[s].pending, [&] {
            return std::make_exception_ptr(error("psx: " + worker_name() + ": the I/O thread failed: " + what));
          });
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    // Closing (callers see closing_ under their lane and send no more): the
    // chief tells the servers the cluster is done; whatever waits fails; the
    // sockets get their linger to deliver the last frames.
    const std::string why = "psx: " + worker_name() + ": shut down before the answer came";
    for (std::size_t s = 0; s < n; ++s) {
      std::lock_guard lock(lanes_[s].mu);
      if (worker_index_ == 0u) {
        Frames f;
        f.push_back(
            detail_zmq::message_of(::psx::detail::wire::encode_stop(fingerprint_, incarnation_)));
        lanes_[s].outbox.push_back(std::move(f));
      }
      send_some(s);
      fail_calls(lanes_[s].pending, [&] { return std::make_exception_ptr(shutdown_error(why)); });
    }
    for (std::size_t s = 0; s < n; ++s) {
      std::lock_guard lock(lanes_[s].mu);
      lanes_[s].outbox.clear();
      // A server with no connection now (dead, or never reached) would
      // hold the process for the whole linger with frames it cannot take.
      reconnected(s);
      close_dealer(s, connected_[s] != 0);
      lanes_[s].closed = true;
    }
  }

  // Lane `s` held: takes the answers there are, 256 at most; true when it
  // took them all (the socket said EAGAIN, so a new answer will be told).
  bool read_lane(std::size_t s) {
    Lane& lane = lanes_[s];
    for (int k = 0; k < 256; ++k) {
      std::vector<zmq::message_t> msg;
      if (!zmq::recv_multipart(dealers_[s], std::back_inserter(msg), zmq::recv_flags::dontwait)) return true;
      detail_zmq::taken_over();
      lane.last_heard = clock::now();
      lane.room.notify_all();  // no-op without a caller waiting for room
      if (auto why = on_reply(s, msg, lane.pending); !why.empty()) {
        // The server restarted: what this worker trained there is gone.
        // Every call waiting on it fails now, and every later one at once.
        lane.gone = why;
        fail_calls(lane.pending, [&] { return std::make_exception_ptr(peer_lost(why)); });
      }
    }
    return false;
  }

  // Sends one message's frames unless the socket would block; the first
  // frame decides, the rest follow it.
  static bool send_frames(zmq::socket_t& sock, Frames& frames) {
    detail_zmq::handing_over();
    if (!sock.send(frames[0], frames.size() > 1 ? zmq::send_flags::dontwait | zmq::send_flags::sndmore
                                                : zmq::send_flags::dontwait))
      return false;
    for (std::size_t k = 1; k < frames.size(); ++k)
      sock.send(frames[k], k + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    return true;
  }

  // Lane `s` held: sends what waits, as long as the socket takes it.
  void send_some(std::size_t s) {
    auto& box = lanes_[s].outbox;
    while (!box.empty() && send_frames(dealers_[s], box.front())) box.pop_front();
  }

  // Lane `s` held: writes into a request header the server incarnation it
  // is for and the floor, the lowest message this worker still waits on
  // from `s` (the server may forget the answers below it). Messages are
  // numbered under the lane, so none below the floor is still to come.
  void stamp(std::vector<std::byte>& header, std::size_t s, std::uint64_t id) const {
    std::uint64_t floor = id != 0 ? id : lanes_[s].next_id;
    if (!lanes_[s].pending.empty()) floor = std::min(floor, lanes_[s].pending.begin()->first);
    ::psx::detail::wire::put(header, ::psx::detail::wire::request_floor_at, floor);
    ::psx::detail::wire::put(header, ::psx::detail::wire::request_incarnation_at, incarnations_[s]);
  }

  // Lane `s` held (or before the I/O thread runs): reads the connection
  // events of server `s`'s socket; true when it connected again after a
  // drop, so what was in flight may be lost both ways.
  bool reconnected(std::size_t s) {
    bool again = false;
    for (int k = 0; k < 64; ++k) {
      std::vector<zmq::message_t> event;
      try {
        if (!zmq::recv_multipart(monitors_[s], std::back_inserter(event), zmq::recv_flags::dontwait)) break;
      } catch (const zmq::error_t&) {
        break;
      }
      detail_zmq::taken_over();
      if (event.empty() || event[0].size() < 6) continue;
      std::uint16_t what;
      std::memcpy(&what, event[0].data(), sizeof what);
      if (what == ZMQ_EVENT_DISCONNECTED) {
        dropped_[s] = 1;
        connected_[s] = 0;
      } else if (what == ZMQ_EVENT_CONNECTED) {
        connected_[s] = 1;
        if (dropped_[s]) again = true;
        dropped_[s] = 0;
      }
    }
    return again;
  }

  // Lane `s` held: after a reconnect, sends every call still waiting on
  // `s` again, in call order and ahead of what waits to be sent. The
  // server executes a call it never received and answers again one it
  // has (its window of answers, ServerLoop::Window), so nothing is
  // applied twice; an answer that comes twice is taken once.
  void resend_pending(std::size_t s) {
    Lane& lane = lanes_[s];
    std::deque<Frames> again;
    for (auto& [id, call] : lane.pending) {
      if (call->header.empty()) continue;
      // The incarnation stays the one it was first sent to: a server that
      // restarted since refuses it unexecuted.
      std::vector<std::byte> header = call->header;
      ::psx::detail::wire::put(header, ::psx::detail::wire::request_floor_at, lane.pending.begin()->first);
      ::psx::detail::wire::put(header, ::psx::detail::wire::request_flags_at,
                               ::psx::detail::wire::request_flag_resend);
      Frames f;
      f.push_back(detail_zmq::message_of(header));
      for (const auto& seg : call->segs) f.push_back(detail_zmq::borrowed(seg, call));
      again.push_back(std::move(f));
    }
    if (again.empty()) return;
    std::cerr << "psx: info: " + worker_name() + ": reconnected to " + server_name(s) + "; " +
                     std::to_string(again.size()) + " messages not yet answered sent again\n";
    lane.outbox.insert(lane.outbox.begin(), std::make_move_iterator(again.begin()),
                       std::make_move_iterator(again.end()));
    send_some(s);
  }

  // Handles one message from server `s`; returns why every call waiting on
  // it must fail when there is such a reason (the server restarted).
  std::string on_reply(std::size_t s, std::vector<zmq::message_t>& msg,
                       Pending& pending) {
    if (msg.empty()) return {};
    const auto head = detail_zmq::bytes_of(msg[0]);
    const std::string& where = answer_from_[s];
    ::psx::detail::wire::ReplyHead rh;
    try {
      const auto p = ::psx::detail::wire::read_prefix(head, where);
      if (p.kind == ::psx::detail::wire::Kind::pong || p.kind == ::psx::detail::wire::Kind::welcome) {
        const std::uint64_t incarnation = ::psx::detail::wire::decode_signal(head, where);
        if (incarnation == incarnations_[s]) return {};
        incarnations_[s] = incarnation;
        return "psx: " + worker_name() + ": " + server_name(s) +
               " restarted, and with it what this worker trained there: no call goes on with it (restore the "
               "job from its checkpoint: docs/faults.md)";
      }
      if (p.kind == ::psx::detail::wire::Kind::refuse) {
        // A server that restarted with other declarations, or another version.
        const std::string why = ::psx::detail::wire::decode_refuse(head, where);
        fail_calls(pending, [&] {
          return ::psx::detail::wire::exception_of(static_cast<::psx::detail::wire::Status>(p.byte7), why);
        });
        return {};
      }
      rh = ::psx::detail::wire::decode_reply_head(head, where);
    } catch (const wire_error&) {
      // The call it answers fails with the reason, when its id can be read.
      if (head.size() >= 16) {
        auto it = pending.find(::psx::detail::wire::get<std::uint64_t>(head, 8));
        if (it != pending.end()) {
          it->second->error = std::current_exception();
          pending.erase(it);
        }
      }
      return {};
    }
    auto it = pending.find(rh.call);
    if (it == pending.end()) return {};  // late answer to a call that timed out
    auto call = std::move(it->second);
    pending.erase(it);
    if (rh.status != ::psx::detail::wire::Status::ok) {
      call->error = ::psx::detail::wire::exception_of(rh.status, rh.text);
      return {};
    }
    try {
      std::vector<::psx::detail::wire::OutSpec> outs;
      for (const auto& o : call->outs)
        if (o.kind != ::psx::detail::wire::OutKind::none) outs.push_back({o.kind, o.count});
      if (rh.tensors != outs.size())
        throw wire_error("psx: " + where + " carries " + std::to_string(rh.tensors) + " tensors, expected " +
                         std::to_string(outs.size()));
      std::vector<std::span<const std::byte>> spans;
      for (const auto& m : msg) spans.push_back(detail_zmq::bytes_of(m));
      ::psx::detail::wire::check_reply_tensors(spans, outs, rh.chunk, where);
      std::size_t f = 1;
      for (const auto& o : call->outs) {
        if (o.kind == ::psx::detail::wire::OutKind::none) continue;
        const std::size_t bytes = o.count * o.elem();
        const std::size_t frames = static_cast<std::size_t>(::psx::detail::wire::chunks(bytes, rh.chunk));
        if (o.positions.empty()) {
          // Each frame let go as it is copied: a large answer never holds
          // its frames and the caller's filled buffer whole at once.
          for (std::size_t at = 0; at < bytes; ++f) {
            ::psx::detail::wire::copy_frame(o.dst + at, spans[f], f, [&](std::size_t k, std::size_t from, std::size_t to) {
              detail_zmq::release(msg[k], from, to);
            });
            at += spans[f].size();
          }
          continue;
        }
        // Rows of several servers: scatter this server's rows to where the
        // caller's ids put them.
        std::vector<std::byte> joined;
        const std::byte* src = spans[f].data();
        if (frames > 1) {
          joined.resize(bytes);
          for (std::size_t at = 0, k = 0; k < frames; ++k) {
            std::memcpy(joined.data() + at, spans[f + k].data(), spans[f + k].size());
            at += spans[f + k].size();
          }
          src = joined.data();
        }
        f += frames;
        const std::size_t row = o.width * o.elem();
        for (std::size_t j = 0; j < o.positions.size(); ++j)
          std::memcpy(o.dst + std::size_t{o.positions[j]} * row, src + j * row, row);
      }
    } catch (const wire_error&) {
      call->error = std::current_exception();
    }
    return {};
  }

  Zmq settings_;
  const std::chrono::microseconds busy_poll_;  // settings_.busy_poll, or none on one CPU
  inline static thread_local detail_zmq::Spin spin_;  // this thread's spins: whether they pay
  TransportContext ctx_;
  std::uint64_t fingerprint_;
  // Callers in await, and their wake-ups (before zctx_: libzmq may let go
  // of a call's frames, which finishes it, until the context is gone).
  std::atomic<int> waiters_{0};
  detail_zmq::Sleepers sleepers_;
  zmq::context_t zctx_;
  std::optional<std::size_t> server_index_;
  std::optional<std::size_t> worker_index_;
  // server side
  zmq::socket_t router_;
  zmq::socket_t monitor_;  // the router's failed handshakes (ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)
  zmq::socket_t zap_socket_;
  std::thread zap_;
  std::atomic<std::uint64_t> zap_denied_{0};
  // This process's incarnation. A server sends it in welcomes and pongs: a
  // worker that sees another value knows the server restarted and that the
  // requests it had are gone. A worker's routing id carries it, so a
  // server tells a restarted worker process from a reconnected one.
  const std::uint64_t incarnation_ = ::psx::detail::mix64(
      std::random_device{}() ^ static_cast<std::uint64_t>(clock::now().time_since_epoch().count()));
  std::string bound_;
  bool published_ = false;  // this server wrote its rendezvous_file (port 0)
  // worker side
  std::vector<std::string> endpoints_;
  std::vector<std::string> answer_from_;  // "worker W: an answer from ps task S (endpoint)", for errors
  std::vector<zmq::socket_t> dealers_;  // dealers_[s] only under lanes_[s].mu once the I/O thread runs
  std::vector<zmq::socket_t> monitors_;  // dealers_[s]'s connection events, likewise
  std::vector<char> dropped_;           // dealers_[s] lost its connection (not yet back), likewise
  std::vector<char> connected_;         // dealers_[s] has a connection now, likewise
  std::uint64_t monitored_ = 0;         // monitors made (each has an inproc name of its own)
  std::string routing_id_;              // 'P', worker, incarnation_: every dealer's
  std::unique_ptr<Lane[]> lanes_;
  std::vector<std::uint64_t> incarnations_;  // each server's, from its welcome
  std::thread io_;
  // shared
  detail_zmq::Waker waker_;
  std::mutex mu_;
  std::condition_variable stopped_cv_;
  bool closing_ = false;
  bool served_ = false;
  std::string stop_reason_;
};

inline std::unique_ptr<Zmq::link_type> Zmq::connect(const TransportContext& ctx) const {
  return std::make_unique<link_type>(*this, ctx);
}

static_assert(Transport<Zmq>);

}  // namespace transport
}  // namespace v0
}  // namespace psx
