// The CPUs for the worker side and the server side of bench_zmq and
// bench_procs: the first two of the process's affinity set, as on two hosts,
// unless PSX_BENCH_PIN=0 leaves the threads to the scheduler.
#pragma once

#include <sched.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace psx_bench {

struct Placement {
  int worker = -1, server = -1;  // -1: not pinned
};

inline Placement placement() {
  if (const char* p = std::getenv("PSX_BENCH_PIN"); p && std::string(p) == "0") return {};
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return {};
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  if (cpus.size() < 2) return {};
  return {cpus[0], cpus[1]};
}

// Moves the calling thread to `cpu` (nothing for -1); the threads it starts
// from now on inherit it (libzmq starts a context's threads with its first
// socket). `who` names the program in the warning when it cannot.
inline void run_on(int cpu, const char* who) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0) std::fprintf(stderr, "%s: cannot move a thread to CPU %d\n", who, cpu);
}

}  // namespace psx_bench
