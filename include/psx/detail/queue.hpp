//! @file psx/detail/queue.hpp
//! A closable multi-producer queue: the inbox of an in-process server.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>

namespace psx {
inline namespace v0 {
namespace detail {

template <class T>
class ClosableQueue {
 public:
  //! False (and `value` untouched) once closed.
  bool push(T&& value) {
    {
      std::lock_guard lock(mu_);
      if (closed_) return false;
      items_.push_back(std::move(value));
    }
    cv_.notify_one();
    return true;
  }

  //! Blocks for the next item; empty once closed and drained of nothing:
  //! items still queued at close are handed out by `take_all`.
  std::optional<T> pop() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return closed_ || !items_.empty(); });
    if (closed_) return std::nullopt;
    T value = std::move(items_.front());
    items_.pop_front();
    return value;
  }

  //! Like `pop`, but gives up at `deadline`: empty then too (check `closed()`).
  template <class TimePoint>
  std::optional<T> pop_until(TimePoint deadline) {
    std::unique_lock lock(mu_);
    auto ready = [&] { return closed_ || !items_.empty(); };
    if (deadline == TimePoint::max()) {
      cv_.wait(lock, ready);  // max() would overflow the timed wait's conversion
    } else {
      cv_.wait_until(lock, deadline, ready);
    }
    if (closed_ || items_.empty()) return std::nullopt;
    T value = std::move(items_.front());
    items_.pop_front();
    return value;
  }

  bool closed() const {
    std::lock_guard lock(mu_);
    return closed_;
  }

  //! Closes the queue; later pushes fail and `pop` returns empty.
  void close() noexcept {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }

  //! What was still queued (call after close).
  std::deque<T> take_all() {
    std::lock_guard lock(mu_);
    return std::exchange(items_, {});
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> items_;
  bool closed_ = false;
};

}  // namespace detail
}  // namespace v0
}  // namespace psx
