// What the GPU benchmarks share: medians of wall-clock timings, and the
// opening line naming the device (or exit 77 without one).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace psx_bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Median wall-clock milliseconds of `reps` runs after `warmup` (for paths
// that synchronize or run on the CPU).
template <class F>
double wall_ms(F&& f, int reps, int warmup) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(t);
}

// Prints "<program> on <device> (...)" and returns 0, or says there is no
// CUDA device and returns 77 (ctest's skip code).
inline int open_device(const char* program, bool quick) {
  int devices = 0;
  cudaDeviceProp prop{};
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 ||
      cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("%s: no CUDA device\n", program);
    return 77;
  }
  std::printf("%s on %s (sm_%d%d, %d SMs, %.0f GiB)%s\n\n", program, prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, static_cast<double>(prop.totalGlobalMem) / (1 << 30), quick ? ", quick" : "");
  return 0;
}

}  // namespace psx_bench
