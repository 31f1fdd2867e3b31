//! @file psx/detail/window.hpp
//! What a server remembers of one worker process's numbered messages, so
//! that each is executed once and in the order it was sent, whatever the
//! network did to it: lost with a connection and sent again, duplicated,
//! overtaken by a later one. Both transports that can lose or repeat a
//! message use it: `transport::Zmq` (a reconnect resends what was not
//! answered) and `transport::Simulated` (its fault model drops, duplicates
//! and delays messages), so the recovery code that the simulated fault
//! schedules exercise is the one that runs between processes.
//!
//! A worker numbers its messages to one server 1, 2, 3, ... and keeps each
//! until it is answered; every request tells the lowest it still waits on
//! (its floor), and the server forgets everything below. A window so holds
//! the messages in flight plus those answered since the worker's last
//! message. Bounded besides: the kept answers of reads (which carry
//! tensors) take at most `WindowLimits::bytes`, the oldest forgotten first
//! (a read sent again is simply executed again: that changes nothing); at
//! most `WindowLimits::calls` answers are kept, the oldest forgotten first,
//! and a message sent again below those is refused rather than executed
//! twice; at most `WindowLimits::calls` early messages wait for one before
//! them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <utility>

namespace psx {
inline namespace v0 {
namespace detail {

struct WindowLimits {
  std::size_t bytes = std::size_t{64} << 20;  //!< kept answers of reads
  std::size_t calls = std::size_t{1} << 16;   //!< kept answers, and early messages held back
};

//! One worker process's messages at one server. `Call` is a received
//! message (held while an earlier one is missing), `Answer` what is sent
//! again when a message comes again after it was answered.
template <class Call, class Answer>
class Window {
 public:
  struct Entry {
    bool answered = false;
    bool read = false;  // executing it again changes nothing
    Answer answer{};
    std::size_t bytes = 0;  // of the answer, counted against WindowLimits::bytes when `read`
  };

  //! What became of a message that arrived.
  enum class Arrival : std::uint8_t {
    run,        //!< next in order: the caller executes it, then each that `release` gives
    held,       //!< came early: kept (the call moved in) until those before it came
    overflow,   //!< came early, and the window holds as many early ones as it may: refuse it
    answered,   //!< came before and was answered: send `find(id)->answer` again
    running,    //!< came before, in progress (answered when done) or acknowledged (nobody waits)
    forgotten,  //!< came before, its answer is forgotten (over WindowLimits::calls): refuse it
  };

  Window() = default;
  explicit Window(std::uint64_t process, WindowLimits limits = {}) : process_(process), limits_(limits) {}

  //! The worker process's incarnation (its hello's); 0: none welcomed.
  std::uint64_t process() const noexcept { return process_; }
  //! The message expected next: those below were received.
  std::uint64_t next() const noexcept { return next_; }
  //! Early messages waiting for one before them.
  std::size_t held() const noexcept { return held_.size(); }
  //! Messages received and not acknowledged.
  std::size_t kept() const noexcept { return entries_.size(); }
  //! Bytes of read answers kept.
  std::size_t bytes() const noexcept { return bytes_; }

  //! Message `id` arrived; `read`: executing it again changes nothing.
  //! On `held` the call was moved into the window; on `run` the message
  //! counts as received, and the caller executes it now.
  Arrival arrive(std::uint64_t id, Call& call, bool read) {
    if (id < next_) {
      const auto it = entries_.find(id);
      if (it != entries_.end()) return it->second.answered ? Arrival::answered : Arrival::running;
      return id < refused_below_ ? Arrival::forgotten : Arrival::running;
    }
    if (id > next_) {
      if (held_.size() >= limits_.calls) return Arrival::overflow;
      held_.try_emplace(id, std::move(call), read);  // a duplicate of a held one: kept once
      return Arrival::held;
    }
    receive(id, read);
    return Arrival::run;
  }

  //! The held message that is now next in order, counted as received (the
  //! caller executes it), or none.
  std::optional<std::pair<std::uint64_t, Call>> release() {
    const auto it = held_.find(next_);
    if (it == held_.end()) return std::nullopt;
    std::pair<std::uint64_t, Call> out{it->first, std::move(it->second.first)};
    receive(it->first, it->second.second);
    held_.erase(it);
    return out;
  }

  //! The worker acknowledged every answer below `below` (its floor).
  void acknowledge(std::uint64_t below) {
    if (below <= floor_) return;
    floor_ = below;
    while (!entries_.empty() && entries_.begin()->first < below) forget(entries_.begin());
  }

  //! Keeps message `id`'s answer, if the window still waits for it (the
  //! worker may have acknowledged it meanwhile); `bytes` of tensors.
  void remember(std::uint64_t id, Answer answer, std::size_t bytes = 0) {
    const auto it = entries_.find(id);
    if (it == entries_.end()) return;
    Entry& e = it->second;
    e.answered = true;
    e.answer = std::move(answer);
    if (e.read) {
      e.bytes = bytes;
      bytes_ += bytes;
    }
    trim();
  }

  //! Message `id`'s entry, if it is kept.
  const Entry* find(std::uint64_t id) const {
    const auto it = entries_.find(id);
    return it == entries_.end() ? nullptr : &it->second;
  }

 private:
  void receive(std::uint64_t id, bool read) {
    ++next_;
    entries_[id].read = read;
  }
  void forget(typename std::map<std::uint64_t, Entry>::iterator it) {
    bytes_ -= it->second.bytes;
    entries_.erase(it);
  }
  // After an answer was kept: back within the limits.
  void trim() {
    for (auto it = entries_.begin(); bytes_ > limits_.bytes && it != entries_.end();) {
      if (it->second.answered && it->second.read)
        forget(it++);  // a read: executed again if it comes again
      else
        ++it;
    }
    for (auto it = entries_.begin(); entries_.size() > limits_.calls && it != entries_.end();) {
      if (!it->second.answered) {
        ++it;
        continue;
      }
      if (!it->second.read) refused_below_ = std::max(refused_below_, it->first + 1);
      forget(it++);
    }
  }

  std::uint64_t process_ = 0;
  WindowLimits limits_{};
  std::uint64_t next_ = 1;
  std::uint64_t floor_ = 0;          // messages below were acknowledged: forgotten
  std::uint64_t refused_below_ = 0;  // one below, not in entries_, may have been executed: refused
  std::map<std::uint64_t, std::pair<Call, bool>> held_;  // came early, wait for next_; with `read`
  std::map<std::uint64_t, Entry> entries_;
  std::size_t bytes_ = 0;
};

}  // namespace detail
}  // namespace v0
}  // namespace psx
