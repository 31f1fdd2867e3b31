//! @file psx/detail/cpus.hpp
//! How many CPUs this process may run on, for the transports' decisions to
//! spin or sleep.
#pragma once

#include <algorithm>
#include <cstddef>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

namespace psx {
inline namespace v0 {
namespace detail {

// The logical CPUs this process may run on: its CPU affinity set where the
// platform tells it (Linux, up to 1024 CPUs), else the machine's hardware
// threads; at least 1.
inline std::size_t usable_cores() noexcept {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return static_cast<std::size_t>(std::max(CPU_COUNT(&set), 1));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace detail
}  // namespace v0
}  // namespace psx
