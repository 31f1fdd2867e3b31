// Test helpers shared by the psx test translation units.
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace psx_test {

// The calling thread's n-th allocation from now (0: the next) throws
// std::bad_alloc; -1 turns it off (tests/main.cpp replaces operator new,
// where can_fail_allocations() says so: not under ThreadSanitizer).
void fail_allocation(long n) noexcept;
bool can_fail_allocations() noexcept;

// A gradient that depends on the value pulled, the worker, the step and the
// element (toy_step's usual `grad`).
inline float toy_grad(float value, std::size_t worker, std::size_t step, std::size_t i) {
  return std::sin(value * static_cast<float>(worker + 1) + static_cast<float>(step) * 0.37f +
                  static_cast<float>(i) * 0.11f);
}

// Worker 0 leaves a pull of dense "x" (4 floats) unwaited that waits for
// worker 1's second step while worker 1 waits for worker 0 in a barrier;
// `drop(handle)` then throws or lets the handle go. A cancel must end the
// pull: the handle's destructor waited for it for ever. Two steps of
// gradient 1 from each worker when nothing throws; worker 1's last step is
// in before either returns.
template <class Worker, class Drop>
void drop_a_kept_pull(Worker& w, Drop&& drop) {
  std::vector<float> x(4), later(4), g(4, 1.0f);
  w.pull("x", x);
  w.push("x", g);
  w.step();
  if (w.index() == 0) {
    w.push("x", g);
    w.step();
    auto h = w.pull_async("x", later);  // waits for worker 1's step 2
    CHECK_FALSE(h.ready());
    drop(h);
    w.barrier();
  } else {
    w.barrier();
    w.push("x", g);
    w.step();
  }
  w.barrier();
}

// One step of the tests' toy model: pulls dense "w" (`w_size` floats) and
// the rows `ids` of sparse "emb" (`dim` wide), pushes for each value read
// `grad(value, worker, step, index)`, then steps. A gradient that depends
// on every value read makes any difference in what a worker reads show.
template <class Worker, class Grad>
void toy_step(Worker& w, std::size_t t, const std::vector<std::uint64_t>& ids, std::size_t w_size, std::size_t dim,
              Grad grad) {
  std::vector<float> wv(w_size), gw(w_size), rows(ids.size() * dim), grows(ids.size() * dim);
  w.pull("w", wv);
  w.pull_rows("emb", ids, rows);
  for (std::size_t i = 0; i < wv.size(); ++i) gw[i] = grad(wv[i], w.index(), t, i);
  for (std::size_t i = 0; i < rows.size(); ++i) grows[i] = grad(rows[i], w.index(), t, i);
  w.push("w", gw);
  w.push_rows("emb", ids, grows);
  w.step();
}

// Aborts the whole test binary if the scope is not left within `limit`:
// a test that hangs fails loudly instead of stalling CI.
class Watchdog {
 public:
  explicit Watchdog(std::string what, std::chrono::seconds limit = std::chrono::seconds(60))
      : what_(std::move(what)), thread_([this, limit] {
          std::unique_lock lock(mu_);
          if (!cv_.wait_for(lock, limit, [&] { return done_; })) {
            std::fprintf(stderr, "watchdog: '%s' hung for more than %llds\n", what_.c_str(),
                         static_cast<long long>(limit.count()));
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::string what_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// A fresh directory of its own under the system's temp directory, removed
// with everything in it when the scope ends.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "psx") {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::filesystem::path path;
};

// Runs `f`, which must throw E, and returns the message.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception of the named type");
  return {};
}

}  // namespace psx_test
