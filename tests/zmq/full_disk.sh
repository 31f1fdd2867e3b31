#!/usr/bin/env bash
# A save onto a full disk: a 1 MiB tmpfs holds one checkpoint of the test
# program; a second save of the same step with 4 MiB more to write fails
# with ENOSPC. The save must fail on every task with a checkpoint_error
# that says so, and the checkpoint already there must load as it was, bit
# for bit (a save writes under a temporary name and renames it into place).
#
#   full_disk.sh LAUNCHER NODE
#
# Needs root to mount a tmpfs; exits 77 (ctest: skipped) otherwise.
set -u
launcher=$1 node=$2
skip() { echo "skipped: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root to mount a tmpfs"
work=$(mktemp -d)
disk="$work/disk"
mkdir -p "$disk"
cleanup() {
  umount "$disk" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
mount -t tmpfs -o size=1m tmpfs "$disk" 2>/dev/null || skip "cannot mount a tmpfs here"
fail() { echo "FAIL: $*"; sed 's/^/    /' "$work/out.log"; exit 1; }

"$launcher" --ps 2 --workers 2 -- "$node" --steps 20 --save "$disk/run" >"$work/out.log" 2>&1 ||
  fail "the first save (into an empty 1 MiB tmpfs) failed"
ckpt=$(ls -d "$disk"/run/ckpt-* 2>/dev/null | head -1)
[ -n "$ckpt" ] || fail "no checkpoint after the first save"
cp -r "$ckpt" "$work/before"

"$launcher" --ps 2 --workers 2 -- "$node" --steps 20 --save "$disk/run" --ballast-mb 4 >"$work/out.log" 2>&1
status=$?
[ "$status" != 0 ] || fail "a save of 4 MiB more into the full tmpfs succeeded"
grep -q "No space left on device" "$work/out.log" || fail "the save's error does not say the disk is full"
echo "full_disk: the second save failed with status $status: $(grep -m1 'No space left on device' "$work/out.log")"

"$node" --compare "$work/before" "$ckpt" >"$work/out.log" 2>&1 ||
  fail "the checkpoint that was there does not load as it was"
echo "full_disk: $(cat "$work/out.log")"
echo "full_disk: all passed"
