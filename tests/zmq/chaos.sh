#!/usr/bin/env bash
# The chaos test (issue 34): a synchronous job of 2 servers and 3 workers,
# each a process under `psx-launch --restart on-failure`, checkpointing every
# 10 steps, while a seeded schedule SIGKILLs random tasks at random moments:
# one kill aimed at a checkpoint save, one at a barrier, the rest anywhere in
# training. Every kill makes the job fail and restart from its last
# checkpoint (docs/faults.md); it must end with parameters bit-identical to
# an undisturbed in-process run (the chief compares).
#
#   chaos.sh LAUNCHER NODE            3 kills (the CI form, about a minute)
#   chaos.sh LAUNCHER NODE --long     20 kills (docs/faults.md has its figures)
#   PSX_CHAOS_SEED=n chaos.sh ...     replays a schedule (the seed is printed)
set -u
launcher=$1 node=$2
kills=3 steps=240
if [ "${3:-}" = --long ]; then kills=20 steps=1200; fi
seed=${PSX_CHAOS_SEED:-$(( $(date +%s%N) % 32768 ))}
RANDOM=$seed
work=$(mktemp -d)
launcher_pid=
cleanup() {
  [ -n "$launcher_pid" ] && kill -TERM "$launcher_pid" 2>/dev/null && wait "$launcher_pid" 2>/dev/null
  if [ -n "${PSX_CHAOS_KEEP:-}" ]; then echo "chaos: log kept in $work/job.log"; else rm -rf "$work"; fi
}
trap cleanup EXIT
now_ms() { echo $(($(date +%s%N) / 1000000)); }
echo "chaos: seed $seed, $kills kills, $steps steps (replay: PSX_CHAOS_SEED=$seed)"

# The job: a 2 s peer timeout (a dead peer is named in 2.2 s), restarts
# after 0.2 s, doubling to at most 1.6 s; 8 MiB of ballast makes each save
# long enough to be killed in.
"$launcher" --ps 2 --workers 3 --restart on-failure --max-restarts 100 --restart-backoff 0.2 --restart-backoff-max 1.6 \
  --pid-dir "$work/pids" -- \
  "$node" --steps "$steps" --pause-ms 25 --peer-timeout-ms 2000 --checkpoint "$work/ckpt" --every 10 \
  --ballast-mb 8 >"$work/job.log" 2>&1 &
launcher_pid=$!
started=$(now_ms)
tasks=(ps-0 ps-1 chief-0 worker-0 worker-1)

running() { kill -0 "$launcher_pid" 2>/dev/null; }
# The last step the chief said it saves or meets a barrier at (0: none yet).
progress() { grep -o '^\[chief\] chief 0: \(saving step\|barrier at\) [0-9]*' "$work/job.log" | tail -1 | grep -o '[0-9]*$' || echo 0; }
# wait_for PATTERN AFTER_LINE: until a line after AFTER_LINE of the log
# matches PATTERN (30 s at most); true when one did.
wait_for() {
  local pattern=$1 after=$2 k
  for ((k = 0; k < 600; k++)); do
    tail -n +"$((after + 1))" "$work/job.log" | grep -q -- "$pattern" && return 0
    running || return 1
    sleep 0.05
  done
  return 1
}
# kill_task NAME WHY: SIGKILLs the task's current process.
done_kills=0 lines_at_kill=0 kill_ms=0
recoveries=()
kill_task() {
  local name=$1 why=$2 pid
  pid=$(cat "$work/pids/$name" 2>/dev/null) || { echo "chaos: $name has no process now; kill skipped"; return; }
  lines_at_kill=$(wc -l <"$work/job.log")
  kill_ms=$(now_ms)
  kill -9 "$pid" 2>/dev/null || { echo "chaos: $name ($pid) already gone; kill skipped"; return; }
  done_kills=$((done_kills + 1))
  echo "chaos: kill $done_kills at $(( $(now_ms) - started )) ms: SIGKILL $name (pid $pid), $why, chief at step $(progress)"
}
# Kills only while training runs, before its last 40 steps: a kill after
# the end would restart a task whose peers are gone.
in_training() { running && [ "$(progress)" -lt $((steps - 40)) ] && [ "$(progress)" -ge 1 ]; }

wait_for 'chief 0: barrier at' 0 || { echo "chaos: FAIL: the job never started training"; cat "$work/job.log"; exit 1; }
for ((k = 0; k < kills; k++)); do
  kind=$((k % 3))
  if [ "$kind" = 0 ]; then
    sleep "$((RANDOM % 9 + 2))e-1"
    in_training || break
    kill_task "${tasks[RANDOM % 5]}" "at a random moment"
  elif [ "$kind" = 1 ]; then
    lines=$(wc -l <"$work/job.log")
    wait_for 'chief 0: saving step' "$lines" && in_training || break
    kill_task "ps-$((RANDOM % 2))" "during a checkpoint save"
  else
    lines=$(wc -l <"$work/job.log")
    wait_for 'barrier at' "$lines" && in_training || break
    kill_task "${tasks[RANDOM % 3 + 2]}" "during a barrier"
  fi
  # The job resumes (every task restarted, restored) before the next kill:
  # the time from the kill until the restarted chief has restored is the
  # recovery time.
  wait_for 'chief 0: starts at step' "$lines_at_kill" || break
  recovered=$(( $(now_ms) - kill_ms ))
  recoveries+=("$recovered")
  echo "chaos: training again $recovered ms after kill $done_kills (the chief resumed at step $(grep -o 'chief 0: starts at step [0-9]*' "$work/job.log" | tail -1 | grep -o '[0-9]*$'))"
  lines=$(wc -l <"$work/job.log")
  wait_for 'chief 0: barrier at' "$lines" || break
done

# The end: 240 s at most.
for ((k = 0; k < 2400 && $(running && echo 1 || echo 0); k++)); do sleep 0.1; done
if running; then
  echo "chaos: FAIL: the job still runs 240 s after the last kill"
  tail -40 "$work/job.log"
  exit 1
fi
wait "$launcher_pid"
status=$?
launcher_pid=
took=$(( $(now_ms) - started ))
restarts=$(grep -c '^psx-launch: .*restart [0-9]* of' "$work/job.log")
resumed=$(grep -o 'chief 0: starts at step [0-9]*' "$work/job.log" | grep -o '[0-9]*$' | tr '\n' ' ')
echo "chaos: $done_kills kills, $restarts restarts, the chief started at steps: $resumed; $took ms in all"
if [ "${#recoveries[@]}" -gt 0 ]; then
  sorted=($(printf '%s\n' "${recoveries[@]}" | sort -n))
  echo "chaos: from a kill to training again: min ${sorted[0]} ms, median ${sorted[$(( ${#sorted[@]} / 2 ))]} ms, max ${sorted[-1]} ms"
fi
if [ "$status" -ne 0 ] || ! grep -q "parameters bit-identical to the in-process cluster" "$work/job.log"; then
  echo "chaos: FAIL: psx-launch exited $status (seed $seed)"
  grep -v '^\[.*\] .*: \(saving step\|barrier at\|training\)' "$work/job.log" | tail -60
  exit 1
fi
if [ "$done_kills" -lt "$kills" ]; then
  echo "chaos: FAIL: only $done_kills of $kills kills landed (seed $seed)"
  exit 1
fi
grep -m1 "parameters bit-identical" "$work/job.log"
echo "chaos: passed"
