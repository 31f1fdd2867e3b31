// Test helpers shared by the psx test translation units.
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

namespace psx_test {

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
