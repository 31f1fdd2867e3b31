#!/usr/bin/env bash
# Checkpoints across processes (issue 6's acceptance test on the ZeroMQ
# transport): a cluster of processes trains 100 steps and saves; another
# trains 50 steps and saves; a new cluster of new processes, with another
# number of servers, restores that checkpoint and trains 50 more. The two
# step-100 checkpoints must hold the same parameters and optimizer slots,
# bit for bit, for Adam and for FTRL. Then the same with a checkpoint saved
# in the background while the processes trained on.
#
#   checkpoint.sh PSX_LAUNCH NODE
set -u
launch=$1
node=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
for opt in adam ftrl; do
  run() { "$launch" "$@" >>"$work/$opt.log" 2>&1 || { echo "FAIL ($opt): psx-launch $*"; cat "$work/$opt.log"; exit 1; }; }
  run --ps 2 --workers 3 -- "$node" --optimizer "$opt" --steps 100 --save "$work/$opt-straight"
  run --ps 2 --workers 3 -- "$node" --optimizer "$opt" --steps 50 --save "$work/$opt-halves"
  run --ps 3 --workers 3 --transport ipc -- "$node" --optimizer "$opt" --steps 100 \
    --restore "$work/$opt-halves/ckpt-0000000050" --save "$work/$opt-halves"
  if "$node" --compare "$work/$opt-straight/ckpt-0000000100" "$work/$opt-halves/ckpt-0000000100"; then
    echo "$opt: 100 steps straight == 50 steps, checkpoint, new processes (3 servers instead of 2), 50 more"
  else
    failures=$((failures + 1))
  fi
done
# Saves written in the background while the processes train on (the chief
# checks that the run ends bit-identical to an in-process one), and a new
# cluster resumed from one of them ends where the straight run did.
run() { "$launch" "$@" >>"$work/background.log" 2>&1 || { echo "FAIL (background): psx-launch $*"; cat "$work/background.log"; exit 1; }; }
run --ps 2 --workers 3 -- "$node" --optimizer adam --steps 100 --checkpoint "$work/background" --every 30 --background 1
run --ps 3 --workers 3 -- "$node" --optimizer adam --steps 100 --restore "$work/background/ckpt-0000000060" \
  --save "$work/background-resumed"
if "$node" --compare "$work/adam-straight/ckpt-0000000100" "$work/background-resumed/ckpt-0000000100"; then
  echo "adam: 100 steps straight == saved in the background at 60 while training on, new processes, 40 more"
else
  failures=$((failures + 1))
fi
[ "$failures" -eq 0 ] && echo "checkpoint.sh: all passed"
exit "$failures"
