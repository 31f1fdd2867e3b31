#!/usr/bin/env bash
# Builds and runs the whole test suite under every checking preset:
#   dev   optimized with debug info, every public header compiled on its own
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer
#   tsan  ThreadSanitizer
# Usage: scripts/test.sh [preset...]   (default: dev asan tsan)
set -euo pipefail
cd "$(dirname "$0")/.."
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(dev asan tsan)
jobs=$(nproc)
for preset in "${presets[@]}"; do
  echo "=== psx: ${preset} ==="
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
  if [ "$preset" = dev ]; then
    # Every public header compiles on its own (VERIFY_INTERFACE_HEADER_SETS).
    cmake --build --preset dev -j "$jobs" --target all_verify_interface_header_sets
  fi
  ctest --preset "$preset" -j "$jobs"
done
