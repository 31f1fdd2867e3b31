#!/usr/bin/env bash
# Tests of tools/psx-launch: the tasks it starts and their TF_CONFIG, the role
# prefixes, stopping everything when one process fails or the launcher is
# signalled (no process left behind), ipc addresses, --spec, bad arguments.
# Usage: launcher_test.sh PATH/TO/psx-launch. Exit 0: every check passed.
set -u

launch=${1:?usage: launcher_test.sh PATH/TO/psx-launch}
[[ -x $launch ]] || { echo "launcher_test: '$launch' is not an executable file" >&2; exit 1; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/psx-launcher-test.XXXXXX") || exit 1
# A string in the command line of every process a test starts, for pgrep.
marker="psxlaunchertest$$x$RANDOM"
cleanup() {
  local pid
  for pid in $(pgrep -f "$marker"); do kill -s KILL "$pid" 2>/dev/null; done  # only what this test started
  rm -rf "$tmp"
}
trap cleanup EXIT

failures=0
fail() {
  printf 'FAIL: %s\n' "$*" >&2
  failures=$((failures + 1))
}
show() {  # the launcher's output, after a failed check
  printf -- '--- stdout:\n%s\n--- stderr:\n%s\n---\n' "$(cat "$tmp/out")" "$(cat "$tmp/err")" >&2
}

ms() { local t=${EPOCHREALTIME//[!0-9]/}; echo $((10#$t / 1000)); }

# Runs psx-launch "$@"; sets rc and elapsed (milliseconds); output in $tmp/out
# and $tmp/err. A launcher that hangs gets SIGTERM after 20 s (status 124).
limit=()
command -v timeout >/dev/null && limit=(timeout -k 5 20)
run() {
  local t0
  t0=$(ms)
  "${limit[@]}" "$launch" "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  elapsed=$(($(ms) - t0))
}

# Fails when a process of this test is still alive (after up to 5 seconds:
# a process sent SIGKILL takes a moment to go, longer on a loaded machine).
check_none_left() {
  local i
  for ((i = 0; i < 100; i++)); do
    pgrep -f "$marker" >/dev/null || return 0
    sleep 0.05
  done
  fail "$1: processes left behind: $(pgrep -af "$marker" | tr '\n' ';')"
}

# A program that reports what it was given. Its path holds the marker.
echo_prog=$tmp/$marker-echo.sh
cat >"$echo_prog" <<'EOF'
#!/usr/bin/env bash
re='"task":\{"type":"([a-z]+)","index":([0-9]+)\}\}$'
[[ ${TF_CONFIG-} =~ $re ]] || { echo "bad TF_CONFIG: '${TF_CONFIG-}'"; exit 1; }
type=${BASH_REMATCH[1]} index=${BASH_REMATCH[2]}
[[ -d ${PSX_RENDEZVOUS-} ]] || { echo "PSX_RENDEZVOUS is not a directory: '${PSX_RENDEZVOUS-}'"; exit 1; }
cluster=${TF_CONFIG#'{"cluster":'}
cluster=${cluster%%',"task":'*}
echo "task $type $index"
echo "cluster $cluster"
echo "rendezvous $PSX_RENDEZVOUS"
echo "stderr $type $index" >&2
printf '%s' "$TF_CONFIG" >"$1/tf-config-$type-$index"
printf 'last line without a newline'
EOF
chmod +x "$echo_prog"

# The JSON files written by the echo program, checked with python3 when there is one.
check_tf_configs() {  # what, expected task count
  command -v python3 >/dev/null || return 0
  local out
  out=$(python3 - "$tmp/tf" "$2" <<'PY'
import glob, json, os, sys
d, n = sys.argv[1], int(sys.argv[2])
files = sorted(glob.glob(os.path.join(d, "tf-config-*")))
if len(files) != n:
    sys.exit("%d TF_CONFIG files, expected %d" % (len(files), n))
for f in files:
    c = json.load(open(f))
    t = c["task"]
    if os.path.basename(f) != "tf-config-%s-%d" % (t["type"], t["index"]):
        sys.exit("%s holds task %r" % (f, t))
    if sorted(c) != ["cluster", "task"] or t["index"] >= len(c["cluster"][t["type"]]):
        sys.exit("%s: %r" % (f, c))
PY
  ) || fail "$1: TF_CONFIG is not right: $out"
}

# --- (a) --ps 2 --workers 3: five processes, their tasks, prefixed output ----
mkdir -p "$tmp/tf"
run --ps 2 --workers 3 -- "$echo_prog" "$tmp/tf"
[[ $rc == 0 ]] || { fail "(a) exit status $rc, expected 0"; show; }
expected_tasks='[chief] task chief 0
[ps 0] task ps 0
[ps 1] task ps 1
[worker 0] task worker 0
[worker 1] task worker 1'
got=$(grep ' task ' "$tmp/out" | sort)
[[ $got == "$expected_tasks" ]] || { fail "(a) tasks:"$'\n'"$got"$'\n'"expected:"$'\n'"$expected_tasks"; show; }
a_cluster='{"chief":["127.0.0.1:0"],"worker":["127.0.0.1:0","127.0.0.1:0"],"ps":["127.0.0.1:0","127.0.0.1:0"]}'
[[ $(grep -cF "] cluster $a_cluster" "$tmp/out") == 5 ]] || { fail "(a) every process sees the cluster $a_cluster"; show; }
got=$(grep ' stderr ' "$tmp/err" | sort | tr '\n' ';')
[[ $got == '[chief] stderr chief 0;[ps 0] stderr ps 0;[ps 1] stderr ps 1;[worker 0] stderr worker 0;[worker 1] stderr worker 1;' ]] ||
  { fail "(a) stderr lines prefixed by role: $got"; show; }
[[ $(grep -c '^\[[a-z0-9 ]*\] last line without a newline$' "$tmp/out") == 5 ]] ||
  { fail "(a) a last line without a newline keeps its own line"; show; }
rendezvous=$(sed -n 's/^\[[a-z0-9 ]*\] rendezvous //p' "$tmp/out" | sort -u)
[[ $(wc -l <<<"$rendezvous") == 1 && -n $rendezvous ]] || fail "(a) one PSX_RENDEZVOUS for all: $rendezvous"
[[ ! -e $rendezvous ]] || fail "(a) $rendezvous is still there after the launcher exited"
check_tf_configs "(a)" 5

# --- (b) a worker exits 3 while the others sleep: all stopped, status 3 ------
fail_prog=$tmp/$marker-fail.sh
cat >"$fail_prog" <<'EOF'
#!/usr/bin/env bash
marker=$1 mode=$2
case $mode:$TF_CONFIG in
  sleep:*) ;;
  *'"task":{"type":"worker","index":0}'*)
    sleep 0.5
    echo "worker 0 gives up"
    case $mode in
      signal) kill -KILL $$ ;;
      clean) (exec -a "leftover-$marker" sleep 60) & exit 0 ;;
      *) exit 3 ;;
    esac ;;
esac
[[ $mode == clean ]] && exit 0
[[ $mode == stubborn ]] && trap '' TERM  # ignores SIGTERM, and so does its sleep
# A child in the program's process group, as a real program's threads' helpers would be.
(exec -a "child-$marker" sleep 60) &
wait
EOF
chmod +x "$fail_prog"

# --grace 30: a launcher that waited out the grace after every program had
# gone would be stopped by the 20 s limit (status 124).
run --ps 2 --workers 3 --grace 30 -- "$fail_prog" "$marker" exit
[[ $rc == 3 ]] || { fail "(b) exit status $rc, expected 3"; show; }
((elapsed < 15000)) || fail "(b) took ${elapsed} ms, expected about 500"
grep -qx 'psx-launch: worker 0 exited with status 3; stopping the others' "$tmp/err" ||
  { fail "(b) no 'worker 0 exited with status 3' message"; show; }
grep -qx '\[worker 0\] worker 0 gives up' "$tmp/out" || { fail "(b) the failing worker's output"; show; }
check_none_left "(b)"

# Killed by a signal: 128 + 9.
run --ps 1 --workers 2 -- "$fail_prog" "$marker" signal
[[ $rc == 137 ]] || { fail "(b) killed by SIGKILL: exit status $rc, expected 137"; show; }
grep -qx 'psx-launch: worker 0 exited with status 137; stopping the others' "$tmp/err" ||
  { fail "(b) no 'exited with status 137' message"; show; }
check_none_left "(b) signal"

# Programs that ignore SIGTERM get SIGKILL after --grace.
run --ps 1 --workers 2 --grace 0.5 -- "$fail_prog" "$marker" stubborn
[[ $rc == 3 ]] || { fail "(b) --grace: exit status $rc, expected 3"; show; }
# Under 5 s, the default grace: --grace was taken.
((elapsed >= 900 && elapsed < 5000)) || fail "(b) --grace 0.5 after a failure at 0.5 s took ${elapsed} ms"
check_none_left "(b) --grace"

# All exit 0, one leaving a child behind: status 0, the child killed.
run --ps 1 --workers 2 -- "$fail_prog" "$marker" clean
[[ $rc == 0 ]] || { fail "(b) all exit 0: exit status $rc"; show; }
check_none_left "(b) leftover child of a program that exited 0"

# SIGTERM, and SIGINT, to the launcher stop everything. (set -m: a background
# job of a script would otherwise start with SIGINT ignored.)
for sig in TERM INT; do
  set -m
  "$launch" --ps 1 --workers 2 -- "$fail_prog" "$marker" sleep >"$tmp/out" 2>"$tmp/err" &
  pid=$!
  set +m
  # Signal only once the three programs run (each has started its child): a
  # signal before the launcher has set its traps would kill it silently, with
  # nothing started, and a loaded machine can take longer than any fixed sleep.
  for ((i = 0; i < 400; i++)); do
    (($(pgrep -fc "child-$marker") >= 3)) && break
    sleep 0.05
  done
  ((i < 400)) || fail "(b) SIG$sig: the programs did not start within 20 s"
  t0=$(ms)
  kill -s "$sig" "$pid"
  for ((i = 0; i < 200; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  kill -s KILL "$pid" 2>/dev/null  # still there after 10 s: the check below fails
  wait "$pid"
  rc=$?
  elapsed=$(($(ms) - t0))
  expected=$((128 + $(kill -l "$sig")))
  [[ $rc == "$expected" ]] || { fail "(b) SIG$sig to the launcher: exit status $rc, expected $expected"; show; }
  ((elapsed < 3000)) || fail "(b) SIG$sig to the launcher: took ${elapsed} ms to stop"
  grep -qx "psx-launch: got SIG$sig; stopping every process" "$tmp/err" || { fail "(b) SIG$sig message"; show; }
  check_none_left "(b) SIG$sig to the launcher"
done

# --- (c) --transport ipc -------------------------------------------------------
rm -rf "$tmp/tf" && mkdir -p "$tmp/tf"
run --ps 2 --workers 2 --transport ipc -- "$echo_prog" "$tmp/tf"
[[ $rc == 0 ]] || { fail "(c) exit status $rc"; show; }
rendezvous=$(sed -n 's/^\[chief\] rendezvous //p' "$tmp/out")
r=ipc://$rendezvous
c_cluster="{\"chief\":[\"$r/worker-0\"],\"worker\":[\"$r/worker-1\"],\"ps\":[\"$r/ps-0\",\"$r/ps-1\"]}"
[[ $(grep -cF "] cluster $c_cluster" "$tmp/out") == 4 ]] || { fail "(c) ipc cluster, expected $c_cluster"; show; }
check_tf_configs "(c)" 4

# --- (d) --spec ------------------------------------------------------------------
if command -v python3 >/dev/null; then
  cat >"$tmp/spec.json" <<'EOF'
{
  "cluster": {
    "chief": ["localhost:5000"],
    "worker": ["localhost:5001"],
    "ps": ["localhost:5002", "localhost:5003", "localhost:5004"]
  },
  "task": {"type": "chief", "index": 0}
}
EOF
  rm -rf "$tmp/tf" && mkdir -p "$tmp/tf"
  run --spec "$tmp/spec.json" -- "$echo_prog" "$tmp/tf"
  [[ $rc == 0 ]] || { fail "(d) exit status $rc"; show; }
  got=$(grep ' task ' "$tmp/out" | sort | tr '\n' ';')
  [[ $got == '[chief] task chief 0;[ps 0] task ps 0;[ps 1] task ps 1;[ps 2] task ps 2;[worker 0] task worker 0;' ]] ||
    { fail "(d) tasks: $got"; show; }
  d_cluster='{"chief":["localhost:5000"],"worker":["localhost:5001"],"ps":["localhost:5002","localhost:5003","localhost:5004"]}'
  [[ $(grep -cF "] cluster $d_cluster" "$tmp/out") == 5 ]] || { fail "(d) cluster from the spec"; show; }
  check_tf_configs "(d)" 5

  # Just {"cluster": ...}, without a chief.
  printf '{"cluster": {"worker": ["h:1", "h:2"], "ps": ["h:3"]}}' >"$tmp/spec2.json"
  rm -rf "$tmp/tf" && mkdir -p "$tmp/tf"
  run --spec="$tmp/spec2.json" -- "$echo_prog" "$tmp/tf"
  got=$(grep ' task ' "$tmp/out" | sort | tr '\n' ';')
  [[ $rc == 0 && $got == '[ps 0] task ps 0;[worker 0] task worker 0;[worker 1] task worker 1;' ]] ||
    { fail "(d) a cluster-only spec: status $rc, tasks $got"; show; }

  printf '{"cluster": {"chief": ["h:1"], "ps": ["h:3"], "evaluator": ["h:4"]}}' >"$tmp/spec3.json"
  run --spec "$tmp/spec3.json" -- "$echo_prog" "$tmp/tf"
  if [[ $rc != 2 ]] || ! grep -q 'psx has no evaluator role' "$tmp/err"; then
    fail "(d) an evaluator job: status $rc"
    show
  fi
  printf '{"cluster": ' >"$tmp/spec4.json"
  run --spec "$tmp/spec4.json" -- "$echo_prog" "$tmp/tf"
  if [[ $rc != 2 ]] || ! grep -q "spec4.json: not JSON" "$tmp/err"; then
    fail "(d) a file that is not JSON: status $rc"
    show
  fi
else
  echo "launcher_test: no python3, --spec not tested" >&2
fi

# --- (e) bad arguments: a message and status 2, nothing started -------------------
touch_prog=$tmp/$marker-touch.sh
printf '#!/bin/sh\ntouch "%s/started"\n' "$tmp" >"$touch_prog"
chmod +x "$touch_prog"
bad() {  # expected words in the message, then the arguments
  local words=$1
  shift
  rm -f "$tmp/started"
  run "$@"
  if [[ $rc != 2 ]] || ! grep -q "^psx-launch: .*$words" "$tmp/err" || [[ -e $tmp/started ]]; then
    fail "(e) psx-launch $*: status $rc, expected 2 and a message with '$words'"
    show
  fi
}
bad "no PROGRAM given"
bad "no PROGRAM given" --ps 2 --
bad "--ps must be a whole number >= 1, got '0'" --ps 0 -- "$touch_prog"
bad "--ps must be a whole number >= 1, got 'x'" --ps x -- "$touch_prog"
bad "--workers needs a value" --workers
bad "--transport must be tcp or ipc, got 'udp'" --transport udp -- "$touch_prog"
bad "--grace must be a number of seconds, got 'soon'" --grace soon -- "$touch_prog"
bad "unknown option '--bogus'" --bogus -- "$touch_prog"
bad "--spec and --ps/--workers exclude each other" --spec "$tmp/spec.json" --ps 2 -- "$touch_prog"
bad "--spec and --transport exclude each other" --transport ipc --spec "$tmp/spec.json" -- "$touch_prog"
bad "cannot read the spec file" --spec "$tmp/no-such-file.json" -- "$touch_prog"
run --help
if [[ $rc != 0 ]] || ! grep -q '^usage: psx-launch' "$tmp/out"; then fail "--help: status $rc"; fi

check_none_left "the end"
if ((failures > 0)); then
  echo "launcher_test: $failures checks failed" >&2
  exit 1
fi
echo "launcher_test: all checks passed"
