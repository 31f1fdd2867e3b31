#!/usr/bin/env bash
# compare_builds.sh OLD NEW [ROUNDS]: two bench_zmq binaries (say, the build
# before a change to the transport and the one after) run in turn, ROUNDS
# times each (3), on the same machine in the same run; prints, per build, the
# median over its runs of psx's tcp 4 KiB push round trip and 1 MiB push
# throughput next to the raw-ZeroMQ figures each run measured beside them,
# and NEW over OLD. (bench_zmq's own psx/raw ratio is the steadier figure on
# a virtual machine whose speed drifts; both are printed.)
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for ((k = 0; k < rounds; k++)); do
  "$old" 3 >"$out/old-$k.txt" 2>&1
  "$new" 3 >"$out/new-$k.txt" 2>&1
done
# field: 1 = psx us, 2 = raw us, 3 = psx GB/s, 4 = raw GB/s, 5 = psx/raw
pick() {  # pick BUILD ROW FIELD: the median over the runs
  for f in "$out/$1"-*.txt; do
    grep "^tcp *$2 " "$f" | sed 's/^tcp *'"$2"' *//' |
      awk -v k="$3" '{ v[1] = $1; v[2] = $3; v[3] = $5; v[4] = $7; v[5] = $9; sub(/x$/, "", v[5]); print v[k] }'
  done | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'
}
printf '%-12s %10s %10s %9s %14s %16s %10s\n' "tcp psx" "old" "new" "new/old" "raw old, new" "psx/raw old, new" "ratio n/o"
for row in "push 4 KiB:1:2:us round trip" "push 1 MiB:3:4:GB/s"; do
  IFS=: read -r name field raw unit <<<"$row"
  o=$(pick old "$name" "$field") n=$(pick new "$name" "$field")
  wo=$(pick old "$name" "$raw") wn=$(pick new "$name" "$raw")
  ro=$(pick old "$name" 5) rn=$(pick new "$name" 5)
  awk -v name="$name" -v o="$o" -v n="$n" -v wo="$wo" -v wn="$wn" -v ro="$ro" -v rn="$rn" -v unit="$unit" \
    'BEGIN { printf "%-12s %10s %10s %8.3fx %6s, %-7s %7sx, %-7s %9.3fx  (%s)\n", name, o, n, n / o, wo, wn, ro, rn "x", rn / ro, unit }'
done
echo "compare_builds: $rounds runs of each, in turn"
