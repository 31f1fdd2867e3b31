// The main() of the GPU test programs: without a CUDA device they print why
// and exit with 77, which ctest reports as skipped (SKIP_RETURN_CODE).
#pragma once

#include <doctest/doctest.h>
#include <psx/cuda/memory.cuh>

#include <cstdio>

namespace psx_test {

inline int cuda_test_main(int argc, char** argv, const char* what, const char* note = "") {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("%s: skipped: no CUDA device (%s)\n", what,
                status != cudaSuccess ? cudaGetErrorString(status) : "cudaGetDeviceCount found none");
    return 77;
  }
  cudaDeviceProp prop{};
  psx::cuda::check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("%s on %s (sm_%d%d, %d multiprocessors)%s\n", what, prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, note);
  doctest::Context context(argc, argv);
  return context.run();
}

}  // namespace psx_test
