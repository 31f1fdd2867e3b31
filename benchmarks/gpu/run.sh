#!/usr/bin/env bash
# Builds, tests and benchmarks psx's CUDA kernel layer in one go, on a GPU
# machine: nvidia-smi -L, the build (nvcc -std=c++20 -O3 -arch=sm_90, test
# and bench in parallel), the kernel and device-storage tests, both under
# compute-sanitizer memcheck (quick sizes), then the kernel benchmark (with
# its table) and the storage benchmark (a server's step, host against device).
#
# Run from the repository root:  benchmarks/gpu/run.sh
# Needs nvcc 12+ and g++; PSX_CUDA_ARCH overrides sm_90, PSX_GPU_BUILD_DIR the
# build folder (/tmp/psx-gpu-build). doctest is taken from .deps/doctest/
# (where the machine has no doctest package, carry /usr/include/doctest there
# as .deps/doctest/), else from the system include path. PSX_GPU_PREBUILT=1
# skips the build when the four programs are already in the build folder
# (built elsewhere with the same nvcc line and carried along).
set -euo pipefail

build=${PSX_GPU_BUILD_DIR:-/tmp/psx-gpu-build}
arch=${PSX_CUDA_ARCH:-sm_90}
mkdir -p "$build"
t0=$(date +%s)
stamp() { echo "   [$(( $(date +%s) - t0 )) s]"; }

echo "== GPU"
nvidia-smi -L || echo "nvidia-smi failed"

flags=(-std=c++20 -O3 -arch="$arch" -Iinclude -I.deps -Xcompiler=-Wall,-Wextra)
if [ "${PSX_GPU_PREBUILT:-0}" = 1 ] && [ -x "$build/psx_cuda_tests" ] && [ -x "$build/psx_bench_gpu" ] &&
   [ -x "$build/psx_cuda_storage_tests" ] && [ -x "$build/psx_bench_gpu_storage" ]; then
  echo "== build: prebuilt in $build"
else
  echo "== build: nvcc -std=c++20 -O3 -arch=$arch"
  nvcc "${flags[@]}" tests/cuda/kernels.cu -o "$build/psx_cuda_tests" &
  tests_pid=$!
  nvcc "${flags[@]}" benchmarks/gpu/bench_kernels.cu -o "$build/psx_bench_gpu" &
  bench_pid=$!
  nvcc "${flags[@]}" tests/cuda/storage.cu -o "$build/psx_cuda_storage_tests" &
  storage_pid=$!
  nvcc "${flags[@]}" benchmarks/gpu/bench_storage.cu -o "$build/psx_bench_gpu_storage" &
  bench_storage_pid=$!
  wait "$tests_pid"
  wait "$bench_pid"
  wait "$storage_pid"
  wait "$bench_storage_pid"
fi
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
  for program in psx_cuda_tests psx_cuda_storage_tests; do
    rc=0
    PSX_CUDA_TESTS_QUICK=1 "$sanitizer" --tool memcheck --error-exitcode 99 "$build/$program" \
      >"$build/memcheck-$program.log" 2>&1 || rc=$?
    if grep -qi "device not supported" "$build/memcheck-$program.log"; then
      echo "$program: compute-sanitizer: device not supported; memcheck skipped"
      continue
    fi
    echo "$program:"
    grep -E "ERROR SUMMARY|^=+ (Invalid|Program hit|Error)|test cases:|assertions:" "$build/memcheck-$program.log" || true
    if [ "$rc" -ne 0 ]; then
      echo "memcheck of $program failed (exit $rc); the end of its log:"
      tail -n 40 "$build/memcheck-$program.log"
      memcheck_rc=$rc
    fi
  done
else
  echo "compute-sanitizer not found; memcheck skipped"
fi
stamp

echo "== bench"
bench_rc=0
"$build/psx_bench_gpu" || bench_rc=$?
echo
"$build/psx_bench_gpu_storage" || bench_rc=$?
stamp

echo "== summary: tests exit $tests_rc, memcheck exit $memcheck_rc, bench exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$memcheck_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
