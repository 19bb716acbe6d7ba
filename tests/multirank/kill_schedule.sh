#!/usr/bin/env bash
# The kill -9 schedule: three Gloo ranks of digits_ddp, started as a launcher would (RANK,
# WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and one of them SIGKILLed at a random moment of the
# rendezvous, the connection or the first steps of training. Every survivor must fail, within
# the timeout plus a second of the kill, with a message that names the dead rank ("rank 1",
# "rank(s) 1, 2 (not arrived yet)", "ranks 0, 1 said nothing", "rank 0, which serves it").
#   tests/multirank/kill_schedule.sh DIGITS_DDP TRIALS [SEED]
# `meson test kill_schedule` runs 10 trials; docs/communication.md has longer runs by hand.
set -uo pipefail
program=$1
trials=$2
RANDOM=${3:-11}
export GRADSYNC_TIMEOUT_MS=3000 GRADSYNC_STORE_TOKEN=kill-schedule
limit_ms=$((GRADSYNC_TIMEOUT_MS + 1000))
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
failed=0 named=0 survivors_total=0
for ((trial = 0; trial < trials; ++trial)); do
  victim=$((RANDOM % 3))
  after_ms=$((RANDOM % 700))  # the rendezvous, the connection, the first steps
  port=$(free_port)
  pids=()
  for r in 0 1 2; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$program" --backend gloo --epochs 40 --quiet > "$scratch/$r.log" 2>&1 &
    pids+=($!)
  done
  sleep "$(printf '0.%03d' "$after_ms")"
  kill -KILL "${pids[$victim]}"
  killed=$(date +%s%N)
  for r in 0 1 2; do
    ((r == victim)) && continue
    survivors_total=$((survivors_total + 1))
    # Each survivor, waited for until the limit (then killed: a hang is a failure).
    while kill -0 "${pids[$r]}" 2>/dev/null && (($(date +%s%N) - killed < (limit_ms + 2000) * 1000000)); do sleep 0.02; done
    ended=$(date +%s%N)
    kill -KILL "${pids[$r]}" 2>/dev/null
    wait "${pids[$r]}"
    status=$?
    ms=$(((ended - killed) / 1000000))
    message=$(grep -v "^gradsync: tcp store: closed the connection" "$scratch/$r.log" | tail -c 600 | tr '\n' ' ')
    if ((status != 0)) && grep -Eq "rank(s|\(s\))?[ -]([0-9]+, )*$victim([^0-9]|$)" <<<"$message" && ((ms <= limit_ms)); then
      named=$((named + 1))
    else
      failed=1
      echo "FAIL trial $trial: rank $victim killed at ${after_ms} ms; rank $r: status $status after $ms ms: $message"
    fi
  done
  wait "${pids[$victim]}" 2>/dev/null
done 2>/dev/null  # (bash's "Killed" lines for the processes it was told to kill)
echo "kill schedule: $trials trials, $named of $survivors_total survivors named the dead rank within the timeout plus a second"
exit $failed
