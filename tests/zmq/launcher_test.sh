#!/usr/bin/env bash
# Tests of tools/psx-launch: the tasks it starts and their TF_CONFIG, the role
# prefixes, stopping everything when one process fails or the launcher is
# signalled (no process left behind), ipc addresses, --spec, bad arguments,
# restarts (--restart on-failure, PSX_RESTART_COUNT, back-off, pid files).
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
bad "--restart must be no or on-failure, got 'always'" --restart always -- "$touch_prog"
bad "--max-restarts and --restart-backoff(-max) need --restart on-failure" --max-restarts 2 -- "$touch_prog"
bad "--max-restarts and --restart-backoff(-max) need --restart on-failure" --restart no --restart-backoff 1 -- "$touch_prog"
bad "--restart-backoff-max must be a number of seconds" --restart on-failure --restart-backoff-max soon -- "$touch_prog"
bad "--max-restarts must be a whole number >= 0, got '-1'" --restart on-failure --max-restarts -1 -- "$touch_prog"
bad "--restart-backoff must be a number of seconds, got '1s'" --restart=on-failure --restart-backoff 1s -- "$touch_prog"
bad "--pid-dir: cannot make or write the directory" --pid-dir "$touch_prog/pids" -- "$touch_prog"
bad "--spec and --ps/--workers exclude each other" --spec "$tmp/spec.json" --ps 2 -- "$touch_prog"
bad "--spec and --transport exclude each other" --transport ipc --spec "$tmp/spec.json" -- "$touch_prog"
bad "cannot read the spec file" --spec "$tmp/no-such-file.json" -- "$touch_prog"
run --help
if [[ $rc != 0 ]] || ! grep -q '^usage: psx-launch' "$tmp/out"; then fail "--help: status $rc"; fi

# --- (f) restarts ---------------------------------------------------------------------
# A program that appends "PSX_RESTART_COUNT pid TF_CONFIG PSX_RENDEZVOUS" to
# $dir/<job>-<index>, then, by mode:
#   flaky: ps 0 exits 4 in its first two incarnations; everyone else exits 0
#   always: worker 0 exits 6, always; the others wait for $dir/go
#   wait: everyone waits for $dir/go (up to 15 s, then exits 9), then exits 0
#   ps-fails: ps 0 exits 4, always; the others wait for $dir/go
#   ps-fails-stubborn: the same, the others ignoring SIGTERM
# In mode flaky each checks that $PSX_RENDEZVOUS/pids/<job>-<index> holds its
# pid, and ps 0's last incarnation that the chief's file went with the chief.
restart_prog=$tmp/$marker-restart.sh
cat >"$restart_prog" <<'EOF'
#!/usr/bin/env bash
dir=$1 mode=$2
re='"task":\{"type":"([a-z]+)","index":([0-9]+)\}\}$'
[[ ${TF_CONFIG-} =~ $re ]] || { echo "bad TF_CONFIG: '${TF_CONFIG-}'"; exit 1; }
me=${BASH_REMATCH[1]}-${BASH_REMATCH[2]}
echo "${PSX_RESTART_COUNT-unset} $$ $TF_CONFIG $PSX_RENDEZVOUS" >>"$dir/$me"
echo "incarnation ${PSX_RESTART_COUNT-unset}"
wait_go() {
  for ((i = 0; i < 300; i++)); do [[ -e $dir/go ]] && exit 0; sleep 0.05; done
  exit 9
}
case $mode:$me in
  flaky:*)
    for ((i = 0; i < 100; i++)); do  # the launcher writes it once this runs
      [[ $(cat "$PSX_RENDEZVOUS/pids/$me" 2>/dev/null) == "$$" ]] && break
      sleep 0.05
    done
    ((i < 100)) || echo "# no pid file" >>"$dir/$me"
    [[ $me == ps-0 ]] || exit 0
    ((PSX_RESTART_COUNT < 2)) && exit 4
    for ((i = 0; i < 100; i++)); do  # the chief exits 0 at once
      [[ -e $PSX_RENDEZVOUS/pids/chief-0 ]] || break
      sleep 0.05
    done
    ((i < 100)) || echo "# stale pid file" >>"$dir/$me"
    exit 0 ;;
  always:worker-0) exit 6 ;;
  ps-fails*:ps-0) exit 4 ;;
  ps-fails-stubborn:*) trap '' TERM ;;
esac
wait_go
EOF
chmod +x "$restart_prog"

fresh() { rm -rf "$tmp/r" "$tmp/pids" && mkdir -p "$tmp/r"; }  # no stale pid file can name a reused pid
records() { grep -v '^#' "$tmp/r/$1" 2>/dev/null; }  # job-index: its lines, without the "# " notes
counts() { records "$1" | cut -d' ' -f1 | tr '\n' ' '; }
# Waits up to 20 s for a pid file that holds something other than $2; sets pid.
wait_pid_file() {  # file, old pid
  local i
  for ((i = 0; i < 400; i++)); do
    pid=$(cat "$1" 2>/dev/null)
    [[ -n $pid && $pid != "${2-}" ]] && return 0
    sleep 0.05
  done
  return 1
}

# Fails twice, then succeeds: restarted as the same task, counts 0, 1, 2,
# the back-off 0.2 s then 0.4 s (0.6 s at least).
fresh
run --ps 1 --workers 2 --restart on-failure --restart-backoff 0.2 -- "$restart_prog" "$tmp/r" flaky
[[ $rc == 0 ]] || { fail "(f) flaky: exit status $rc, expected 0"; show; }
[[ $(counts ps-0) == "0 1 2 " ]] || { fail "(f) flaky: ps 0's PSX_RESTART_COUNT: $(counts ps-0), expected 0 1 2"; show; }
[[ $(counts chief-0) == "0 " && $(counts worker-0) == "0 " ]] ||
  { fail "(f) flaky: the others ran once: chief $(counts chief-0), worker $(counts worker-0)"; show; }
[[ $(records ps-0 | cut -d' ' -f3- | sort -u | wc -l) == 1 ]] ||
  { fail "(f) flaky: ps 0 restarted with another TF_CONFIG or PSX_RENDEZVOUS:"$'\n'"$(cat "$tmp/r/ps-0")"; }
grep -q '"task":{"type":"ps","index":0}' "$tmp/r/ps-0" || fail "(f) flaky: ps 0's TF_CONFIG: $(cat "$tmp/r/ps-0")"
! grep -q 'no pid file' "$tmp/r"/* || fail "(f) flaky: \$PSX_RENDEZVOUS/pids/<job>-<index> did not name the process: $(grep -l 'no pid file' "$tmp/r"/*)"
! grep -q 'stale pid file' "$tmp/r/ps-0" || fail "(f) flaky: the chief's pid file outlived it by 5 s"
got=$(grep '^psx-launch: ' "$tmp/err")
expected='psx-launch: ps 0 exited with status 4; restart 1 of 3 in 0.2 s
psx-launch: ps 0 exited with status 4; restart 2 of 3 in 0.4 s'
[[ $got == "$expected" ]] || { fail "(f) flaky: the launcher's lines:"$'\n'"$got"$'\n'"expected:"$'\n'"$expected"; show; }
[[ $(grep -c '^\[ps 0\] incarnation [012]$' "$tmp/out") == 3 ]] || { fail "(f) flaky: the restarts' output, prefixed"; show; }
((elapsed >= 600)) || fail "(f) flaky: done in ${elapsed} ms, before the 0.2 + 0.4 s back-off"
check_none_left "(f) flaky"

# Always fails: restarted --max-restarts times (back-off 0.1, 0.2, 0.4 s),
# then the others stopped and its status.
fresh
run --ps 1 --workers 2 --restart on-failure --max-restarts 3 --restart-backoff 0.1 -- "$restart_prog" "$tmp/r" always
[[ $rc == 6 ]] || { fail "(f) always: exit status $rc, expected 6"; show; }
[[ $(counts worker-0) == "0 1 2 3 " ]] || { fail "(f) always: worker 0's PSX_RESTART_COUNT: $(counts worker-0)"; show; }
got=$(grep '^psx-launch: ' "$tmp/err")
expected='psx-launch: worker 0 exited with status 6; restart 1 of 3 in 0.1 s
psx-launch: worker 0 exited with status 6; restart 2 of 3 in 0.2 s
psx-launch: worker 0 exited with status 6; restart 3 of 3 in 0.4 s
psx-launch: worker 0 exited with status 6; no restarts left (3 of 3); stopping the others'
[[ $got == "$expected" ]] || { fail "(f) always: the launcher's lines:"$'\n'"$got"$'\n'"expected:"$'\n'"$expected"; show; }
((elapsed >= 700)) || fail "(f) always: done in ${elapsed} ms, before the 0.1 + 0.2 + 0.4 s back-off"
[[ $(counts ps-0) == "0 " ]] || fail "(f) always: ps 0 ran $(counts ps-0)"
check_none_left "(f) always"

# SIGKILL to a task's current process, found in --pid-dir: restarted, its
# new pid in the file; everyone exits 0 once told to; the files removed at exit.
fresh
"${limit[@]}" "$launch" --ps 1 --workers 2 --restart on-failure --restart-backoff 0.1 --pid-dir "$tmp/pids" \
  -- "$restart_prog" "$tmp/r" wait >"$tmp/out" 2>"$tmp/err" &
launcher_pid=$!
if wait_pid_file "$tmp/pids/ps-0" && old=$pid && wait_pid_file "$tmp/pids/worker-0" && wait_pid_file "$tmp/pids/chief-0"; then
  kill -s KILL "$old"
  wait_pid_file "$tmp/pids/ps-0" "$old" || fail "(f) SIGKILL: no new pid in $tmp/pids/ps-0 within 20 s"
  new=$pid
else
  fail "(f) SIGKILL: no pid files in $tmp/pids within 20 s"
fi
touch "$tmp/r/go"
wait "$launcher_pid"
rc=$?
[[ $rc == 0 ]] || { fail "(f) SIGKILL: exit status $rc, expected 0"; show; }
grep -qx 'psx-launch: ps 0 exited with status 137 (SIGKILL); restart 1 of 3 in 0.1 s' "$tmp/err" ||
  { fail "(f) SIGKILL: no restart line"; show; }
[[ $(counts ps-0) == "0 1 " ]] || { fail "(f) SIGKILL: ps 0's PSX_RESTART_COUNT: $(counts ps-0)"; show; }
[[ $(records ps-0 | cut -d' ' -f2 | tr '\n' ' ') == "${old-} ${new-} " ]] ||
  fail "(f) SIGKILL: pids $(records ps-0 | cut -d' ' -f2 | tr '\n' ' '), the pid files said ${old-} then ${new-}"
[[ -z $(ls -A "$tmp/pids") ]] || fail "(f) SIGKILL: pid files left at exit: $(ls -A "$tmp/pids")"
check_none_left "(f) SIGKILL"

# The same with --restart no: today's behaviour, everyone stopped.
fresh
"${limit[@]}" "$launch" --ps 1 --workers 2 --restart no --pid-dir "$tmp/pids" \
  -- "$restart_prog" "$tmp/r" wait >"$tmp/out" 2>"$tmp/err" &
launcher_pid=$!
if wait_pid_file "$tmp/pids/worker-0" && wait_pid_file "$tmp/pids/ps-0" && wait_pid_file "$tmp/pids/chief-0"; then
  kill -s KILL "$(cat "$tmp/pids/worker-0")"
else
  fail "(f) --restart no: no pid files in $tmp/pids within 20 s"
fi
wait "$launcher_pid"
rc=$?
[[ $rc == 137 ]] || { fail "(f) --restart no: exit status $rc, expected 137"; show; }
grep -qx 'psx-launch: worker 0 exited with status 137; stopping the others' "$tmp/err" ||
  { fail "(f) --restart no: the message"; show; }
[[ $(grep -c '^psx-launch: ' "$tmp/err") == 1 ]] || { fail "(f) --restart no: other lines"; show; }
[[ $(counts worker-0) == "0 " ]] || fail "(f) --restart no: worker 0 ran $(counts worker-0)"
check_none_left "(f) --restart no"

# SIGTERM to the launcher during a 30 s back-off: no restart, all stopped
# well before the back-off would end.
fresh
set -m
"$launch" --ps 1 --workers 2 --restart on-failure --restart-backoff 30 -- "$restart_prog" "$tmp/r" ps-fails >"$tmp/out" 2>"$tmp/err" &
launcher_pid=$!
set +m
for ((i = 0; i < 400; i++)); do
  grep -q 'restart 1 of 3 in 30.0 s' "$tmp/err" && [[ -s $tmp/r/chief-0 && -s $tmp/r/worker-0 ]] && break
  sleep 0.05
done
((i < 400)) || { fail "(f) SIGTERM in the back-off: no restart line within 20 s"; show; }
t0=$(ms)
kill -s TERM "$launcher_pid"
for ((i = 0; i < 200; i++)); do kill -0 "$launcher_pid" 2>/dev/null || break; sleep 0.05; done
kill -s KILL "$launcher_pid" 2>/dev/null  # still there after 10 s: the checks below fail
wait "$launcher_pid"
rc=$?
elapsed=$(($(ms) - t0))
[[ $rc == 143 ]] || { fail "(f) SIGTERM in the back-off: exit status $rc, expected 143"; show; }
((elapsed < 10000)) || fail "(f) SIGTERM in the back-off: took ${elapsed} ms to stop"
grep -qx 'psx-launch: got SIGTERM; stopping every process' "$tmp/err" || { fail "(f) SIGTERM in the back-off: message"; show; }
[[ $(counts ps-0) == "0 " ]] || { fail "(f) SIGTERM in the back-off: ps 0 ran $(counts ps-0)"; show; }
check_none_left "(f) SIGTERM in the back-off"

# The same with a 0.5 s back-off, and the others ignoring SIGTERM for their
# --grace of 2 s: the restart, due while they stop, does not come.
fresh
set -m
"$launch" --ps 1 --workers 2 --grace 2 --restart on-failure --restart-backoff 0.5 \
  -- "$restart_prog" "$tmp/r" ps-fails-stubborn >"$tmp/out" 2>"$tmp/err" &
launcher_pid=$!
set +m
for ((i = 0; i < 400; i++)); do
  grep -q 'restart 1 of 3 in 0.5 s' "$tmp/err" && [[ -s $tmp/r/chief-0 && -s $tmp/r/worker-0 ]] && break
  sleep 0.05
done
((i < 400)) || { fail "(f) SIGTERM in the back-off, --grace 2: no restart line within 20 s"; show; }
kill -s TERM "$launcher_pid"
for ((i = 0; i < 200; i++)); do kill -0 "$launcher_pid" 2>/dev/null || break; sleep 0.05; done
kill -s KILL "$launcher_pid" 2>/dev/null
wait "$launcher_pid"
rc=$?
[[ $rc == 143 ]] || { fail "(f) SIGTERM in the back-off, --grace 2: exit status $rc, expected 143"; show; }
[[ $(counts ps-0) == "0 " ]] || { fail "(f) SIGTERM in the back-off, --grace 2: ps 0 ran $(counts ps-0)"; show; }
check_none_left "(f) SIGTERM in the back-off, --grace 2"

check_none_left "the end"
if ((failures > 0)); then
  echo "launcher_test: $failures checks failed" >&2
  exit 1
fi
echo "launcher_test: all checks passed"
