//! @file psx/transport/inprocess.hpp
//! Servers and workers as threads of one process. A request is handed to the
//! server's inbox as it is: its spans point at the worker's own buffers, so
//! no byte is serialized or copied on the way.
//!
//! Each server has a thread that handles its inbox. With
//! `InProcess::waiters_serve` (off by default), a thread that waits for a
//! call (`Handle::wait`) may handle the requests queued at a server whose
//! thread is not handling them at that moment, and the last request of a
//! blocking call (`Request::caller_waits`) is left to its caller without
//! waking the server thread: a blocking pull from one
//! server then costs no thread wake-up at all, where otherwise the server
//! thread is woken to handle it and wakes the caller when it is done. Either
//! way one server's requests are handled one at a time, in the order they
//! arrived (a flag under the inbox's lock says who handles them now), so
//! the server's state needs no lock of its own; a request nobody waits for
//! at once wakes the server thread, so none is left unhandled; and a thread
//! other than the server's handles only what was queued when it took the
//! inbox over, so no caller is kept serving what others send meanwhile.
//!
//! Before sleeping, a server thread that found its inbox empty looks again
//! for `InProcess::spin` (100 microseconds by default), and a caller waiting
//! for its answer for `InProcess::wait_spin` (by default the longer of 1 ms
//! and `spin` when every server and worker thread has a core, else `spin`;
//! none when `spin` is zero), yielding the core between looks: on a virtual
//! machine a futex wake-up costs tens of microseconds, as much as a whole
//! pull of a thousand rows.
#pragma once

#include <psx/concepts.hpp>
#include <psx/detail/cpus.hpp>
#include <psx/errors.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace psx {
inline namespace v0 {

namespace transport {

//! The in-process transport (the default).
struct InProcess {
  //! Whether a thread waiting for a call handles the requests queued at
  //! servers whose threads are idle, up to its own, instead of sleeping
  //! until they have: the caller and the server thread each skip a
  //! wake-up, which costs tens of microseconds per call on a loaded or
  //! virtual machine. The optimizer and the sync policy then also run on
  //! worker threads (inside `pull`, `push`, `step`, ...): a worker must not
  //! call the cluster while it holds a lock that its optimizer takes.
  //! False (the default): only the server threads handle requests. It is
  //! opt-in because it wins from one worker thread and can lose with
  //! several (workers then wait for each other to let a server go), and
  //! because it runs optimizer code on worker threads.
  bool waiters_serve = false;

  //! How long a server thread that found its inbox empty keeps looking for
  //! work (yielding the core between looks) before it sleeps: a request
  //! that comes within it is taken without a thread wake-up, which costs
  //! tens of microseconds on a loaded or virtual machine. The price is up
  //! to this much CPU time after each batch of requests (an idle server
  //! does not spin after its periodic tick). A waiting caller looks for
  //! `wait_spin`, which follows this one where threads outnumber cores.
  //! Zero: sleep at once (callers too, unless `wait_spin` is set). At most
  //! one second (`connect` refuses more, and a negative value). 100 µs: on
  //! the project's 2-core VM, before `wait_spin` (callers looked for this
  //! long too), a 1024-id `pull_rows` from one worker (bench_tables, dim 16)
  //! ran at 7.8 Mids/s with 0, 11.2 with 20 µs, 17.3 with 50, 16.4-26.4
  //! with 100, 21.5-24.2 with 200 and 16.8 with 500 (single runs, noisy);
  //! bench_sync gained 2-5x with 100.
  std::chrono::microseconds spin{100};

  //! How long a caller waiting for an answer keeps looking for it (yielding
  //! the core between looks) before it sleeps. Unset (the default): the
  //! longer of 1 ms and `spin` when the cluster's threads, one per server
  //! and one per worker, are no more than the logical CPUs this process may
  //! run on (its `sched_getaffinity` set; a CPU quota, other threads and
  //! other processes are not seen); otherwise `spin`, and zero when `spin`
  //! is. A server that takes longer than `spin` to answer (a 1024-id
  //! `pull_rows` of 64 floats a row: about 100 µs) then answers a caller
  //! that is still awake. The price is up to this much CPU time per call,
  //! on a CPU that no cluster thread needs (though it may share a physical
  //! core with one); where threads outnumber CPUs a looking caller would
  //! take time from the servers. Measured in docs/architecture.md. Between
  //! 0 and 1 s, like `spin`.
  std::optional<std::chrono::microseconds> wait_spin{};

  //! One inbox per server; `serve` handles it, and so do waiting callers.
  class link_type {
   public:
    //! Servers and callers alike look for `spin`.
    explicit link_type(std::size_t num_servers, bool waiters_serve = false,
                       std::chrono::microseconds spin = std::chrono::microseconds{0})
        : link_type(num_servers, waiters_serve, spin, spin) {}
    //! Server threads look for `spin`, waiting callers for `wait_spin`.
    explicit link_type(std::size_t num_servers, bool waiters_serve, std::chrono::microseconds spin,
                       std::chrono::microseconds wait_spin)
        : inboxes_(num_servers), waiters_serve_(waiters_serve), spin_(spin), wait_spin_(wait_spin) {}

    //! How long server threads look for requests before they sleep.
    std::chrono::microseconds spin() const noexcept { return spin_; }
    //! How long a waiting caller looks for its answer before it sleeps.
    std::chrono::microseconds wait_spin() const noexcept { return wait_spin_; }

    void send(std::size_t server, Request&& r) {
      if (server >= inboxes_.size())
        throw config_error("psx: request for server " + std::to_string(server) + " of " +
                           std::to_string(inboxes_.size()));
      Inbox& in = inboxes_[server];
      // Its sender is about to wait and handle it (await), or whoever
      // handles the inbox now takes it before letting go. A message nobody
      // waits for (a clock tick) to an idle server is handled here and now.
      const bool left_to_caller = waiters_serve_ && r.caller_waits;
      const bool unanswered = waiters_serve_ && !r.done;
      std::unique_lock lock(in.mu);
      if (in.closed) throw shutdown_error("psx: server " + std::to_string(server) + " is shut down");
      in.items.push_back(std::move(r));
      // A spinning server thread takes what it sees counted; not a request
      // its caller is about to handle (waiters_serve).
      if (!left_to_caller) in.sent.fetch_add(1, std::memory_order_release);
      if (in.serving || left_to_caller) return;
      if (unanswered && in.handler) {
        in.serving = true;
        release(in, lock, nullptr);
        return;
      }
      lock.unlock();
      in.cv.notify_one();
    }

    void serve(std::size_t server, RequestHandler& handler) {
      Inbox& in = inboxes_.at(server);
      std::unique_lock lock(in.mu);
      in.handler = &handler;
      in.next_tick = handler.next_tick();
      bool may_spin = false;  // the last turn handled requests: more may follow at once
      for (;;) {
        // Sleep until a request waits that nobody handles, the tick is due
        // or the link closes; a waiter that handles the inbox meanwhile
        // wakes this thread when it leaves any of these behind.
        for (;;) {
          const auto now = clock::now();
          const bool due = now >= in.next_tick;
          if (!in.serving && (in.closed || !in.items.empty() || due)) break;
          if (!in.serving && spin_.count() > 0 && may_spin) {
            // Look for a request for a while before sleeping.
            may_spin = false;
            const std::uint64_t seen = in.sent.load(std::memory_order_relaxed);
            const auto until = std::min(now + spin_, in.next_tick);
            lock.unlock();
            while (in.sent.load(std::memory_order_acquire) == seen && clock::now() < until)
              std::this_thread::yield();
            lock.lock();
            continue;
          }
          if (in.next_tick == clock::time_point::max() || (in.serving && due)) in.cv.wait(lock);
          else in.cv.wait_until(lock, in.next_tick);
        }
        if (in.closed) break;
        in.serving = true;
        may_spin = !in.items.empty();  // not after a tick alone: an idle server does not spin
        if (in.items.empty()) {  // woken for the tick
          lock.unlock();
          handler.tick(clock::now());
          lock.lock();
        }
        handle_queued(in, lock, handler, true, nullptr);
        // Let go as soon as the inbox is found empty: a caller woken by the
        // last answer finds it free and handles its next call itself.
        in.next_tick = handler.next_tick();
        in.serving = false;
      }
      // Closed, and nobody handles the inbox: this thread keeps it for good.
      in.serving = true;
      std::deque<Request> left = std::exchange(in.items, {});
      lock.unlock();
      const std::string why = "psx: server " + std::to_string(server) + " shut down before answering";
      const RequestHandler::ErrorFactory make_error = [&] { return std::make_exception_ptr(shutdown_error(why)); };
      for (Request& r : left) r.finish(make_error());
      handler.drain(make_error);
    }

    //! A caller waits for `done`: handles the requests queued at every
    //! server nobody handles now, each inbox up to the moment `done` is
    //! ready. Returns without waiting; `Handle::wait` waits for the rest.
    void await(std::size_t, Completion& done) {
      if (waiters_serve_)
        for (Inbox& in : inboxes_) {
          if (done.ready()) return;
          help(in, done);
        }
      if (wait_spin_.count() == 0 || done.ready()) return;
      const auto until = clock::now() + wait_spin_;
      while (!done.ready() && clock::now() < until) std::this_thread::yield();
    }

    void close() noexcept {
      for (Inbox& in : inboxes_) {
        {
          std::lock_guard lock(in.mu);
          in.closed = true;
          in.sent.fetch_add(1, std::memory_order_release);
        }
        in.cv.notify_all();
      }
    }

   private:
    using clock = RequestHandler::clock_type;

    struct Inbox {
      std::mutex mu;
      std::condition_variable cv;  // the server thread sleeps on it
      std::deque<Request> items;
      std::atomic<std::uint64_t> sent{0};    // requests queued for it and closes so far (a spinning server watches it)
      bool closed = false;
      bool serving = false;                  // a thread is handling requests (or the tick) now
      RequestHandler* handler = nullptr;     // set once its thread serves
      clock::time_point next_tick = clock::time_point::max();  // the handler's, as of the last hand-over
    };

    // Handles the inbox's requests in order, the lock let go around each,
    // and the tick whenever it is due (whoever holds `serving` owns the
    // handler): every request for the server thread; for another thread,
    // only those queued when it took the inbox over (its own among them),
    // and a waiter's only until its `done` is ready, so that no caller is
    // kept handling what others send meanwhile. The caller has set
    // `serving` and holds the lock.
    static void handle_queued(Inbox& in, std::unique_lock<std::mutex>& lock, RequestHandler& handler,
                              bool server_thread, Completion* done) {
      for (std::size_t budget = in.items.size(); !in.items.empty() && (server_thread || budget > 0); --budget) {
        Request r = std::move(in.items.front());
        in.items.pop_front();
        lock.unlock();
        handler.handle(std::move(r));
        const auto now = clock::now();
        if (now >= handler.next_tick()) handler.tick(now);
        const bool finished = done && done->ready();
        lock.lock();
        if (finished) return;
      }
    }

    void help(Inbox& in, Completion& done) {
      std::unique_lock lock(in.mu);
      if (in.serving || in.closed || in.items.empty() || !in.handler) return;
      in.serving = true;
      release(in, lock, &done);
    }

    // A thread other than the server's, `serving` set and the lock held:
    // handles the inbox (handle_queued), then lets it go, waking the server
    // thread when it leaves requests or a closed link, or when the tick the
    // thread last knew of or the one now known is due (it may sleep
    // untimed until the inbox is let go, or until a later tick).
    static void release(Inbox& in, std::unique_lock<std::mutex>& lock, Completion* done) {
      const auto slept_until = in.next_tick;
      handle_queued(in, lock, *in.handler, false, done);
      in.next_tick = in.handler->next_tick();
      in.serving = false;
      const auto now = clock::now();
      // A tick due now is covered: either it moved sooner, or it is at or
      // after slept_until, which has passed too.
      const bool wake = in.closed || !in.items.empty() || in.next_tick < slept_until || now >= slept_until;
      // A server thread spinning for work looks at `sent`, not the condition
      // variable: requests left behind (one whose caller found the inbox
      // taken, say) are counted there too, or it saw them only when its
      // spin ended.
      if (!in.items.empty()) in.sent.fetch_add(1, std::memory_order_release);
      lock.unlock();
      if (wake) in.cv.notify_one();
    }

    std::vector<Inbox> inboxes_;
    bool waiters_serve_;
    std::chrono::microseconds spin_;
    std::chrono::microseconds wait_spin_;
  };

  std::unique_ptr<link_type> connect(const TransportContext& ctx) const {
    auto check = [](const char* what, std::chrono::microseconds us) {
      if (us < std::chrono::microseconds{0} || us > std::chrono::seconds{1})
        throw config_error(std::string("psx: InProcess::") + what + " must be between 0 and 1 s, got " +
                           std::to_string(us.count()) + " us");
    };
    check("spin", spin);
    if (wait_spin) check("wait_spin", *wait_spin);
    return std::make_unique<link_type>(ctx.num_servers, waiters_serve, spin,
                                       wait_spin_for(ctx.num_servers + ctx.num_workers, detail::usable_cores()));
  }

  //! The caller's look before it sleeps (`wait_spin`) in a cluster of
  //! `threads` server and worker threads on `cores` cores.
  std::chrono::microseconds wait_spin_for(std::size_t threads, std::size_t cores) const noexcept {
    if (wait_spin) return *wait_spin;
    if (spin.count() == 0 || threads > cores) return spin;
    return std::max(spin, std::chrono::microseconds{1000});
  }
  friend bool operator==(const InProcess&, const InProcess&) = default;
  //! "InProcess", with the settings that differ from the defaults.
  friend std::ostream& operator<<(std::ostream& os, const InProcess& t) {
    const InProcess defaults;
    os << "InProcess";
    if (t == defaults) return os;
    const char* sep = "{";
    if (t.waiters_serve != defaults.waiters_serve) os << std::exchange(sep, ", ") << "waiters_serve=true";
    if (t.spin != defaults.spin) os << std::exchange(sep, ", ") << "spin=" << t.spin.count() << "us";
    if (t.wait_spin) os << std::exchange(sep, ", ") << "wait_spin=" << t.wait_spin->count() << "us";
    return os << '}';
  }
};
static_assert(Transport<InProcess>);

}  // namespace transport
}  // namespace v0
}  // namespace psx
