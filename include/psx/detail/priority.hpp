//! @file psx/detail/priority.hpp
//! Background work that must not slow training down: a thread that lowers
//! its own CPU priority (a server's checkpoint writer).
#pragma once

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>
#endif

namespace psx {
inline namespace v0 {
namespace detail {

//! Puts the calling thread in Linux's SCHED_IDLE class: the scheduler
//! runs it on the CPU time other threads leave, and a thread of training
//! that wakes takes its core at once (with a 2-core machine and three
//! training threads, a writer at nice +10 still cut training to 0.14-0.17x
//! of its speed while a save was written, SCHED_IDLE to 0.28-0.32x:
//! bench_table_save). It is not starved: CFS still gives it a small share.
//! Where the class is refused, the thread's nice value goes up by 10
//! instead. Linux only (elsewhere nothing changes).
inline void lower_this_thread() noexcept {
#if defined(__linux__)
  sched_param p{};
  p.sched_priority = 0;
  if (::pthread_setschedparam(::pthread_self(), SCHED_IDLE, &p) == 0) return;
  const auto tid = static_cast<id_t>(::gettid());
  const int now = ::getpriority(PRIO_PROCESS, tid);
  (void)::setpriority(PRIO_PROCESS, tid, now + 10 > 19 ? 19 : now + 10);
#endif
}

}  // namespace detail
}  // namespace v0
}  // namespace psx
