//! @file psx/detail/priority.hpp
//! Background work that must not slow training down: a thread that lowers
//! its own CPU priority (a server's checkpoint writer).
#pragma once

#if defined(__linux__)
#include <sys/resource.h>
#include <unistd.h>
#endif

namespace psx {
inline namespace v0 {
namespace detail {

//! Raises the calling thread's nice value by 10 (at most 19), so that on
//! a busy machine the scheduler gives it about a tenth of a core that
//! training threads want, and all the time they leave (RocksDB lowers its
//! compaction threads the same way). Linux only (elsewhere, and where it
//! is not allowed, nothing changes).
inline void lower_this_thread() noexcept {
#if defined(__linux__)
  const auto tid = static_cast<id_t>(::gettid());
  const int now = ::getpriority(PRIO_PROCESS, tid);
  (void)::setpriority(PRIO_PROCESS, tid, now + 10 > 19 ? 19 : now + 10);
#endif
}

}  // namespace detail
}  // namespace v0
}  // namespace psx
