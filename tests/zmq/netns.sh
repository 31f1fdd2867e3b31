#!/usr/bin/env bash
# Multi-host synchronous training over tcp, each "host" a network namespace:
# host 1 (10.231.0.1) runs ps 0 and the chief, host 2 (10.231.0.2) runs ps 1
# and three workers, joined by a veth link. The chief compares its result
# with the in-process cluster's, bit for bit. Each server must listen on its
# own interface's address only (checked with ss). Then the same cluster
# trains again, longer, while the link goes down for 4 s (no reset: TCP
# holds what it had, within the default 30 s peer timeout) and comes back:
# nothing is lost, the result is bit-identical again.
#
#   netns.sh NODE      (NODE: the psx_zmq_node binary)
#
# Needs root and iproute2's ip and ss; exits 77 (ctest: skipped) with the
# reason otherwise.
set -u
node=$1
skip() { echo "skipped: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "needs iproute2's ip"
command -v ss >/dev/null || skip "needs iproute2's ss"

h1=psx-h1-$$ h2=psx-h2-$$ v1=psxv1-$$ v2=psxv2-$$
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  ip netns del "$h1" 2>/dev/null
  ip netns del "$h2" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$h1" 2>/dev/null || skip "cannot create a network namespace here"
ip netns add "$h2" || exit 1
ip link add "$v1" type veth peer name "$v2" || skip "cannot create a veth pair here"
ip link set "$v1" netns "$h1" && ip link set "$v2" netns "$h2" || exit 1
ip -n "$h1" addr add 10.231.0.1/24 dev "$v1" && ip -n "$h2" addr add 10.231.0.2/24 dev "$v2" || exit 1
for h in "$h1" "$h2"; do ip -n "$h" link set lo up; done
ip -n "$h1" link set "$v1" up && ip -n "$h2" link set "$v2" up || exit 1

a=10.231.0.1:0 b=10.231.0.2:0
cluster="{\"chief\":[\"$a\"],\"worker\":[\"$b\",\"$b\",\"$b\"],\"ps\":[\"$a\",\"$b\"]}"
mkdir -p "$work/rv"
args=(--steps 10)
# run HOST NAME TYPE INDEX
run() {
  ip netns exec "$1" env TF_CONFIG="{\"cluster\":$cluster,\"task\":{\"type\":\"$3\",\"index\":$4}}" \
    PSX_RENDEZVOUS="$work/rv" "$node" "${args[@]}" >"$work/$2.log" 2>&1 &
  pids+=($!)
  eval "pid_$2=$!"
}
run "$h1" ps0 ps 0
run "$h2" ps1 ps 1

# Each server listens on its host's address only, not on every interface
# (checked before the workers start, while the servers wait for them).
# (Up to 25 s each: a loaded machine is slow to start them, and the servers
# give up on a chief that has not appeared after 30 s.)
for k in 0 1; do
  eval "pid=\$pid_ps$k"
  for _ in $(seq 500); do [ -s "$work/rv/ps-$k" ] || ! kill -0 "$pid" 2>/dev/null && break; sleep 0.05; done
  if [ ! -s "$work/rv/ps-$k" ]; then
    echo "FAIL: server $k published no endpoint (within 25 s, or before it exited)"
    sed 's/^/    /' "$work/ps$k.log"
    exit 1
  fi
done
p0=$(sed 's/.*://' "$work/rv/ps-0") p1=$(sed 's/.*://' "$work/rv/ps-1")
failures=0
listen0=$(ip netns exec "$h1" ss -ltnH "sport = :$p0" | awk '{print $4}')
listen1=$(ip netns exec "$h2" ss -ltnH "sport = :$p1" | awk '{print $4}')
if [ "$listen0" != "10.231.0.1:$p0" ] || [ "$listen1" != "10.231.0.2:$p1" ]; then
  echo "FAIL: servers listen on '$listen0' and '$listen1', expected 10.231.0.1:$p0 and 10.231.0.2:$p1"
  failures=$((failures + 1))
fi
# finish: every task exits 0 within 60 s and the chief's result is bit-identical.
finish() {
  local name pid status
  for name in ps0 ps1 chief w0 w1 w2; do
    eval "pid=\$pid_$name"
    for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then echo "FAIL: $phase: $name still runs after 60 s"; failures=$((failures + 1)); continue; fi
    wait "$pid"; status=$?
    if [ "$status" != 0 ]; then
      echo "FAIL: $phase: $name exited with $status"; sed 's/^/    /' "$work/$name.log"; failures=$((failures + 1))
    fi
  done
  cat "$work/chief.log"
  grep -q "parameters bit-identical to the in-process cluster" "$work/chief.log" ||
    { echo "FAIL: $phase: the chief's result is not bit-identical"; failures=$((failures + 1)); }
}
phase="training across the link"
run "$h1" chief chief 0
for i in 0 1 2; do run "$h2" w$i worker $i; done
finish

phase="the link down for 4 s mid-training"
args=(--steps 300 --pause-ms 10)
rm -rf "$work/rv"; mkdir -p "$work/rv"
pids=()
run "$h1" ps0 ps 0
run "$h2" ps1 ps 1
run "$h1" chief chief 0
for i in 0 1 2; do run "$h2" w$i worker $i; done
for _ in $(seq 600); do grep -q ": training$" "$work/chief.log" 2>/dev/null && break; sleep 0.1; done
ip -n "$h1" link set "$v1" down
sleep 4
ip -n "$h1" link set "$v1" up
echo "netns: the link was down for 4 s from the chief's step 2 on"
finish
[ "$failures" = 0 ] || exit 1
echo "two hosts (network namespaces): servers on their own addresses only; training equals the in-process cluster, also with the link down for 4 s"
