#!/usr/bin/env bash
# Builds, tests and benchmarks psx's CUDA kernel layer in one go, on a GPU
# machine: nvidia-smi -L, the build (nvcc -std=c++20 -O3 -arch=sm_90, test
# and bench in parallel), the kernel and device-storage tests, the kernel tests under compute-sanitizer
# memcheck (quick sizes), then the benchmarks and their table.
#
# Run from the repository root:  benchmarks/gpu/run.sh
# Needs nvcc 12+ and g++; PSX_CUDA_ARCH overrides sm_90, PSX_GPU_BUILD_DIR the
# build folder (/tmp/psx-gpu-build). doctest is taken from .deps/doctest/
# (where the machine has no doctest package, carry /usr/include/doctest there
# as .deps/doctest/), else from the system include path.
set -euo pipefail

build=${PSX_GPU_BUILD_DIR:-/tmp/psx-gpu-build}
arch=${PSX_CUDA_ARCH:-sm_90}
mkdir -p "$build"
t0=$(date +%s)
stamp() { echo "   [$(( $(date +%s) - t0 )) s]"; }

echo "== GPU"
nvidia-smi -L || echo "nvidia-smi failed"

echo "== build: nvcc -std=c++20 -O3 -arch=$arch"
flags=(-std=c++20 -O3 -arch="$arch" -Iinclude -I.deps -Xcompiler=-Wall,-Wextra)
nvcc "${flags[@]}" tests/cuda/kernels.cu -o "$build/psx_cuda_tests" &
tests_pid=$!
nvcc "${flags[@]}" benchmarks/gpu/bench_kernels.cu -o "$build/psx_bench_gpu" &
bench_pid=$!
nvcc "${flags[@]}" tests/cuda/storage.cu -o "$build/psx_cuda_storage_tests" &
storage_pid=$!
wait "$tests_pid"
wait "$bench_pid"
wait "$storage_pid"
stamp

echo "== tests"
tests_rc=0
"$build/psx_cuda_tests" || tests_rc=$?
"$build/psx_cuda_storage_tests" || tests_rc=$?
stamp

echo "== compute-sanitizer --tool memcheck (PSX_CUDA_TESTS_QUICK=1)"
memcheck_rc=0
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$sanitizer" ]; then
  PSX_CUDA_TESTS_QUICK=1 "$sanitizer" --tool memcheck --error-exitcode 99 "$build/psx_cuda_tests" \
    >"$build/memcheck.log" 2>&1 || memcheck_rc=$?
  if grep -qi "device not supported" "$build/memcheck.log"; then
    echo "compute-sanitizer: device not supported; memcheck skipped"
    memcheck_rc=0
  else
    grep -E "ERROR SUMMARY|^=+ (Invalid|Program hit|Error)|test cases:|assertions:" "$build/memcheck.log" || true
    if [ "$memcheck_rc" -ne 0 ]; then
      echo "memcheck failed (exit $memcheck_rc); the end of its log:"
      tail -n 40 "$build/memcheck.log"
    fi
  fi
else
  echo "compute-sanitizer not found; memcheck skipped"
fi
stamp

echo "== bench"
bench_rc=0
"$build/psx_bench_gpu" || bench_rc=$?
stamp

echo "== summary: tests exit $tests_rc, memcheck exit $memcheck_rc, bench exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$memcheck_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
