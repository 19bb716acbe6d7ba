#!/usr/bin/env bash
# Starts N local ranks of a program with the environment rendezvous (what torchrun does),
# for the Gloo backend without mpirun:
#   scripts/launch.sh 4 build/examples/digits_ddp --backend gloo
# Sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for each rank. For several
# machines, run it on each with NODE_RANK, NNODES and MASTER_ADDR set (rank = node * N + local).
# When one rank fails, the others are stopped; the exit status is the first failure's. SIGINT
# (Ctrl-C), SIGTERM and SIGHUP stop every rank (status 130, 143, 129). A rank that is still there
# GRADSYNC_LAUNCH_GRACE_S seconds (5) after it was told to stop is killed: the launcher never ends
# and never waits for ever with a rank behind it.
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
set -uo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 RANKS_PER_NODE PROGRAM [ARGS...]   (env: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT)" >&2
  exit 2
fi
per_node=$1
shift
nodes=${NNODES:-1}
node=${NODE_RANK:-0}
export WORLD_SIZE=$((per_node * nodes))
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
if [[ -z "${MASTER_PORT:-}" ]]; then
  # A free port on this machine (only meaningful when all ranks are local).
  MASTER_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])' 2>/dev/null ||
                echo $((20000 + RANDOM % 20000)))
fi
export MASTER_PORT
# The rendezvous store refuses whoever does not present the job's token: a random one for ranks
# that all start here; across machines every node must share it (set GRADSYNC_STORE_TOKEN on
# each, or let the ranks derive it from MASTER_ADDR, MASTER_PORT and WORLD_SIZE).
if [[ -z "${GRADSYNC_STORE_TOKEN:-}" && $nodes -eq 1 ]]; then
  GRADSYNC_STORE_TOKEN=$(od -An -N16 -tx1 /dev/urandom 2>/dev/null | tr -d ' \n')
  [[ -n "$GRADSYNC_STORE_TOKEN" ]] && export GRADSYNC_STORE_TOKEN
fi

pids=()
for ((local = 0; local < per_node; ++local)); do
  RANK=$((node * per_node + local)) LOCAL_RANK=$local "$@" &
  pids+=($!)
done

# The first rank to fail decides the job's status and stops the others. SIGTERM, and SIGCONT for
# a stopped rank to act on it; a signal to this launcher stops every rank the same way (the ranks
# of a script ignore SIGINT, so Ctrl-C on the terminal alone would leave them training).
status=0
grace=${GRADSYNC_LAUNCH_GRACE_S:-5}
told_to_stop=""  # $SECONDS when the ranks were told to stop
stop_ranks() {
  [[ -n $told_to_stop ]] && return
  told_to_stop=$SECONDS
  kill -TERM "${pids[@]}" 2>/dev/null
  kill -CONT "${pids[@]}" 2>/dev/null
}
note_exit() {
  local code=$1
  if ((code != 0 && status == 0)); then
    status=$code
    echo "launch.sh: a rank exited with status $code; stopping the others" >&2
    stop_ranks
  fi
}
on_signal() {
  echo "launch.sh: $1; stopping every rank" >&2
  ((status == 0)) && status=$2
  stop_ranks
}
trap 'on_signal "interrupted (SIGINT)" 130' INT
trap 'on_signal "terminated (SIGTERM)" 143' TERM
trap 'on_signal "hung up (SIGHUP)" 129' HUP
# Watch the ranks until all have ended. Not with `wait -n`: when ranks end together, bash may
# reap several while reporting one, and a later `wait -n` finds no child and returns 127, a
# failure no rank had (seen in CI). Asking for a rank by process id once it is gone is reliable:
# bash keeps the status of every background process it started.
running=("${pids[@]}")
while ((${#running[@]} > 0)); do
  still=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      still+=("$pid")
    else
      wait "$pid"
      note_exit $?
    fi
  done
  running=("${still[@]}")
  if ((${#running[@]} > 0)) && [[ -n $told_to_stop ]] && ((SECONDS - told_to_stop >= grace)); then
    echo "launch.sh: ${#running[@]} rank(s) still running ${grace} s after they were told to stop; killing them" >&2
    kill -KILL "${running[@]}" 2>/dev/null
    told_to_stop=$((SECONDS + 3600))  # once
  fi
  ((${#running[@]} > 0)) && sleep 0.05
done
exit $status
