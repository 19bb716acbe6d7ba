#!/usr/bin/env bash
# Fault tolerance measured under the real torchrun (docs/fault_tolerance.md, docs/benchmarks.md):
# digits_ddp as 3 replica groups of 2 Gloo ranks, one torchrun agent per group (--max-restarts)
# and the coordinator, while a killer SIGKILLs a random rank of a random group every --every
# committed steps, --kills times. Side by side, the same job (6 ranks, the same global batch) as
# one torchrun --max-restarts with checkpoints every --checkpoint-every steps, under the same
# kill schedule. Each also runs once without kills.
#
#   benchmarks/fault_tolerance.sh [--out runs/ft] [--kills 10] [--every 40] [--epochs 24]
#                                 [--checkpoint-every 20] [--delay-ms 20] [--noise-seeds "4 5"]
#
# --noise-seeds: the uninterrupted replica job again with these seeds (another initialization and
# data order), for the run-to-run noise the killed run's final accuracy is compared with.
#
# Needs the torch venv (scripts/torch_env.sh). Writes OUT/<run>/ (metrics, logs, the kills) and
# prints benchmarks/fault_tolerance_report.py's table: wall clock, steps lost per failure, the
# survivors' time to their next committed step, the replacements' time to rejoin, final loss and
# held-out accuracy.
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/usage.sh" "$@"
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$root/runs/ft
kills=10
every=40
epochs=24
checkpoint_every=20
delay_ms=20
noise_seeds=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --kills) kills=$2; shift 2 ;;
    --every) every=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --checkpoint-every) checkpoint_every=$2; shift 2 ;;
    --delay-ms) delay_ms=$2; shift 2 ;;
    --noise-seeds) noise_seeds=$2; shift 2 ;;
    *) echo "fault_tolerance.sh: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
venv=${GRADSYNC_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gradsync/torch-venv}
[[ -f $venv/.ready ]] || "$root/scripts/torch_env.sh" > /dev/null
torchrun=("$venv/bin/python" -m torch.distributed.run --monitor-interval 0.1)
build=${GRADSYNC_BUILD:-$root/build}
digits=$build/examples/digits_ddp
[[ -x $digits && -x $build/examples/coordinator ]] || "$root/scripts/setup.sh" > /dev/null
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore GRADSYNC_TIMEOUT_MS=20000
GRADSYNC_STORE_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export GRADSYNC_STORE_TOKEN
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Every run: --batch 16 per group of 2 (8 per rank), the global batch 48 either way.
seed=3
common=(--backend gloo --epochs "$epochs" --lr 0.1 --delay-rank "0:$delay_ms")

# The last committed step in these metrics files (0 before the first).
last_step() { cat "$@" 2>/dev/null | grep -o '"step": [0-9]*, "epoch": [0-9]*, "loss"' | grep -o '[0-9]*' |
  awk 'NR % 2 == 1 && $1 > m { m = $1 } END { print m + 0 }'; }

# killer RUN PATTERN METRICS...: SIGKILLs a random process matching PATTERN (a worker, never an
# agent) each time the committed step passes the next multiple of --every, --kills times;
# writes RUN/kills.txt: unix time, the step, the killed command line's group.
killer() {
  local run=$1 pattern=$2 done=0
  shift 2
  # The same schedule in every run: each kill --every steps after the last, give or take a
  # quarter (so that kills do not fall on the checkpoints' steps).
  RANDOM=7
  local jitter=$((every / 4)) next
  next=$((every + RANDOM % (2 * jitter + 1) - jitter))
  while ((done < kills)); do
    local step
    step=$(last_step "$@")
    if ((step >= next)); then
      local victims victim
      mapfile -t victims < <(pgrep -f "$pattern")
      if ((${#victims[@]} > 0)); then
        victim=${victims[RANDOM % ${#victims[@]}]}
        local group
        group=$(tr '\0' ' ' < "/proc/$victim/cmdline" 2>/dev/null | grep -o -- '--replica-group [0-9]*' | grep -o '[0-9]*$')
        kill -KILL "$victim" 2>/dev/null &&
          echo "$(date +%s.%N) $step ${group:--1} $victim" >> "$run/kills.txt" && done=$((done + 1)) &&
          next=$((next + every + RANDOM % (2 * jitter + 1) - jitter))
      fi
    fi
    sleep 0.05
    [[ -f $run/finished ]] && break
  done
}

# replica_job RUN KILL(0|1): the coordinator, 3 agents, the killer.
replica_job() {
  local run=$out/$1 kill=$2
  rm -rf "$run" && mkdir -p "$run"
  local port
  port=$(free_port)
  "$build/examples/coordinator" --port "$port" --replica-groups 3 --heartbeat-timeout-ms 1000 \
    > "$run/coordinator.log" 2>&1 &
  local coordinator=$! agents=() start
  start=$(date +%s.%N)
  for g in 0 1 2; do
    "${torchrun[@]}" --standalone --nproc-per-node 2 --max-restarts $((kills + 5)) --no-python "$digits" "${common[@]}" \
      --seed "$seed" --batch 16 --replica-groups 3 --replica-group "$g" --coordinator "127.0.0.1:$port" \
      --metrics "$run/group$g.jsonl" --record-samples "$run/records.jsonl" > "$run/group$g.log" 2>&1 &
    agents+=($!)
  done
  local killer_pid=
  if ((kill)); then
    killer "$run" "^[^ ]*examples/digits_ddp .*--replica-groups 3" "$run"/group{0,1,2}.jsonl &
    killer_pid=$!
  fi
  local status=0
  for a in "${agents[@]}"; do wait "$a" || status=1; done
  echo "$(date +%s.%N) $start $status" > "$run/finished"
  [[ -n $killer_pid ]] && wait "$killer_pid"
  kill -TERM "$coordinator" && wait "$coordinator"
  python3 "$root/tests/examples/check_samples.py" "$run/records.jsonl" > "$run/samples.txt" 2>&1 || true
}

# restart_job RUN KILL(0|1): one torchrun of 6 ranks, checkpoints every --checkpoint-every steps.
restart_job() {
  local run=$out/$1 kill=$2
  rm -rf "$run" && mkdir -p "$run"
  local start
  start=$(date +%s.%N)
  "${torchrun[@]}" --standalone --nproc-per-node 6 --max-restarts $((kills + 5)) --no-python "$digits" "${common[@]}" \
    --seed "$seed" --batch 48 --checkpoint-dir "$run/checkpoints" --checkpoint-every "$checkpoint_every" \
    --metrics "$run/metrics.jsonl" > "$run/run.log" 2>&1 &
  local agent=$! killer_pid=
  if ((kill)); then
    killer "$run" "^[^ ]*examples/digits_ddp .*--checkpoint-dir" "$run/metrics.jsonl" &
    killer_pid=$!
  fi
  local status=0
  wait "$agent" || status=1
  echo "$(date +%s.%N) $start $status" > "$run/finished"
  [[ -n $killer_pid ]] && wait "$killer_pid"
}

echo "fault_tolerance.sh: $kills kills every $every steps, $epochs epochs, checkpoints every $checkpoint_every steps"
replica_job replicas_plain 0
replica_job replicas_killed 1
restart_job restarts_plain 0
restart_job restarts_killed 1
for seed in $noise_seeds; do replica_job "replicas_seed$seed" 0; done
python3 "$root/benchmarks/fault_tolerance_report.py" "$out"
