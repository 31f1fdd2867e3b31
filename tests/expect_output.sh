#!/usr/bin/env bash
# Usage: expect_output.sh REGEX COMMAND [ARG...]
# Runs COMMAND and passes only when it exits 0 and a line of its output
# (stdout and stderr, shown merged) matches the extended regular expression REGEX: a
# test's proof that it ran its checks. (ctest's PASS_REGULAR_EXPRESSION
# alone ignores the exit status, so a command that printed its line and then
# failed, or was stopped by a sanitizer at exit, passed.) Exit 77 (skipped)
# is passed on.
set -u
regex=${1:?usage: expect_output.sh REGEX COMMAND [ARG...]}
shift
(($# > 0)) || { echo "usage: expect_output.sh REGEX COMMAND [ARG...]" >&2; exit 2; }
out=$(mktemp "${TMPDIR:-/tmp}/psx-expect.XXXXXX") || exit 1
trap 'rm -f "$out"' EXIT
"$@" 2>&1 | tee "$out"
code=${PIPESTATUS[0]}
((code == 77)) && exit 77
if ((code != 0)); then
  echo "expect_output: $1 exited with status $code" >&2
  exit 1
fi
if ! grep -Eq -- "$regex" "$out"; then
  echo "expect_output: $1 printed no line matching '$regex'" >&2
  exit 1
fi
