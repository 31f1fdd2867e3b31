// The process's own memory as the kernel counts it, for the benchmarks and
// tests that measure resident memory (bench_table_memory, bench_table_save,
// tests/core/table_memory.cpp).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

namespace psx_bench {

// A field of /proc/self/status ("VmRSS", "VmHWM"), in bytes (0: not found).
inline std::uint64_t proc_status(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::size_t n = std::strlen(field);
  while (std::getline(in, line))
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':')
      return std::strtoull(line.c_str() + n + 1, nullptr, 10) * 1024;  // "VmRSS:   1234 kB"
  return 0;
}

}  // namespace psx_bench
