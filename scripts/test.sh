#!/usr/bin/env bash
# Builds and runs the whole test suite under every checking preset:
#   dev   optimized with line tables (-g1), every public header compiled on its own
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer
#   tsan  ThreadSanitizer
# Usage: scripts/test.sh [preset...]   (default: dev asan tsan)
set -euo pipefail
cd "$(dirname "$0")/.."
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(dev asan tsan)
jobs=$(nproc)
# The export test reads model.safetensors with the safetensors package,
# from PyPI (Debian 12 has none); without it, that check says it is skipped.
if ! /usr/bin/python3 -c 'import safetensors' 2>/dev/null; then
  /usr/bin/python3 -m pip install --quiet --break-system-packages safetensors >/dev/null 2>&1 ||
    echo "test.sh: the safetensors package could not be installed; its check will be skipped"
fi
# The summary test reads event files with the tensorboard package, likewise.
if ! /usr/bin/python3 -c 'import tensorboard' 2>/dev/null; then
  /usr/bin/python3 -m pip install --quiet --break-system-packages tensorboard >/dev/null 2>&1 ||
    echo "test.sh: the tensorboard package could not be installed; its check will be skipped"
fi
for preset in "${presets[@]}"; do
  echo "=== psx: ${preset} ==="
  t=$SECONDS
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
  if [ "$preset" = dev ]; then
    # Every public header compiles on its own (VERIFY_INTERFACE_HEADER_SETS).
    cmake --build --preset dev -j "$jobs" --target all_verify_interface_header_sets
  fi
  # The build's time (ctest prints the tests'): where a slow CI run spent it.
  echo "=== psx: ${preset} built in $((SECONDS - t)) s ==="
  ctest --preset "$preset" -j "$jobs"
done
