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
#                                 [--inside "--zero 3 --precision fp16 --clip-norm 5"]
#
# --inside: more trainer flags for every run (what runs inside the groups: ZeRO, precision,
# clipping). The report gives each recovery's bytes per source rank (by pieces under ZeRO) and
# its transfer rate, next to the raw Gloo broadcast of that size between two ranks, measured at
# the end of the same run (bench_collectives).
# --noise-seeds: the uninterrupted replica job again with these seeds (another initialization and
# data order), for the run-to-run noise the killed run's final accuracy is compared with.
# --stop group|rank|partition: instead of killing, SIGSTOP a random group (all its ranks: a hang,
# or a machine that stops answering) or one rank of it that is not its leader (its leader's
# heartbeat goes on), and SIGCONT it --stop-for seconds later (default 3); or cut the group's
# network off for that long (partition: each group and the coordinator on a node of their own,
# network namespaces joined by a switch, scripts/simulate_nodes.sh --driver; needs root). The
# replica job only, with the coordinator's default heartbeat timeout. The report then gives the
# survivors' first commit without that group after each stop.
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
stop=""
stop_for=3
inside=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --kills) kills=$2; shift 2 ;;
    --every) every=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --checkpoint-every) checkpoint_every=$2; shift 2 ;;
    --delay-ms) delay_ms=$2; shift 2 ;;
    --noise-seeds) noise_seeds=$2; shift 2 ;;
    --stop) stop=$2; shift 2 ;;
    --stop-for) stop_for=$2; shift 2 ;;
    --inside) inside=$2; shift 2 ;;
    *) echo "fault_tolerance.sh: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
if [[ $stop == partition && -z ${GRADSYNC_NETNS_PREFIX:-} ]]; then
  # Again inside four simulated nodes: the groups on nodes 0-2, the coordinator on node 3.
  exec "$root/scripts/simulate_nodes.sh" --nodes 4 --rate 10gbit --delay 50us --driver -- "$0" --out "$out" \
    --kills "$kills" --every "$every" --epochs "$epochs" --delay-ms "$delay_ms" --stop partition --stop-for "$stop_for"
fi
# node K (partition): run a command there; without namespaces, here.
node() {
  if [[ -n ${GRADSYNC_NETNS_PREFIX:-} ]]; then
    local k=$1
    shift
    ip netns exec "${GRADSYNC_NETNS_PREFIX}n$k" env GRADSYNC_GLOO_HOST="10.201.0.$((k + 1))" "$@"
  else
    shift
    "$@"
  fi
}
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
# shellcheck disable=SC2206  # (--inside: flags, split on purpose)
[[ -n $inside ]] && common+=($inside)

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
        if [[ -n $stop ]]; then
          stop_and_continue "$victim" "$group" || continue
        else
          kill -KILL "$victim" 2>/dev/null
        fi &&
          echo "$(date +%s.%N) $step ${group:--1} $victim" >> "$run/kills.txt" && done=$((done + 1)) &&
          next=$((next + every + RANDOM % (2 * jitter + 1) - jitter))
        # A stop: the next one only once this group is back (each stop is then measured alone).
        [[ -n $stop ]] && sleep $((stop_for + 1)) && next=$(($(last_step "$@") + every))
      fi
    fi
    sleep 0.05
    [[ -f $run/finished ]] && break
  done
}

# stop_and_continue VICTIM GROUP (--stop): SIGSTOPs the victim's group (every rank of it) or, with
# --stop rank, a rank of it other than its leader (the victim when it is one), in the background
# SIGCONTs it --stop-for seconds later; fails when there is none to stop.
stop_and_continue() {
  local victim=$1 group=$2 targets=()
  if [[ $stop == partition ]]; then
    # The group's link to the switch goes down: nothing in or out, its processes run on.
    ip -n "${GRADSYNC_NETNS_PREFIX}sw" link set "${GRADSYNC_NETNS_PREFIX}b$group" down || return 1
    (sleep "$stop_for"; ip -n "${GRADSYNC_NETNS_PREFIX}sw" link set "${GRADSYNC_NETNS_PREFIX}b$group" up) &
    return 0
  elif [[ $stop == group ]]; then
    mapfile -t targets < <(pgrep -f "^[^ ]*examples/digits_ddp .*--replica-group $group ")
  else
    for pid in $(pgrep -f "^[^ ]*examples/digits_ddp .*--replica-group $group "); do
      tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx 'RANK=0' || targets+=("$pid")
    done
    targets=("${targets[@]:0:1}")
  fi
  ((${#targets[@]} > 0)) || return 1
  kill -STOP "${targets[@]}" 2>/dev/null || return 1
  (sleep "$stop_for"; kill -CONT "${targets[@]}" 2>/dev/null) &
}

# replica_job RUN KILL(0|1): the coordinator, 3 agents, the killer.
replica_job() {
  local run=$out/$1 kill=$2
  rm -rf "$run" && mkdir -p "$run"
  local port
  port=$(free_port)
  # (--stop: the coordinator's default heartbeat timeout, which is what a stop costs)
  local heartbeat=(--heartbeat-timeout-ms 1000)
  [[ -n $stop ]] && heartbeat=()
  local host=127.0.0.1 bind=()  # (partition: the coordinator on node 3)
  [[ -n ${GRADSYNC_NETNS_PREFIX:-} ]] && host=10.201.0.4 bind=(--bind "$host")
  node 3 "$build/examples/coordinator" --port "$port" --replica-groups 3 "${heartbeat[@]}" "${bind[@]}" \
    > "$run/coordinator.log" 2>&1 &
  local coordinator=$! agents=() start
  start=$(date +%s.%N)
  for g in 0 1 2; do
    node "$g" "${torchrun[@]}" --standalone --nproc-per-node 2 --max-restarts $((kills + 5)) --no-python "$digits" "${common[@]}" \
      --seed "$seed" --batch 16 --replica-groups 3 --replica-group "$g" --coordinator "$host:$port" \
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

if [[ -n $stop ]]; then
  echo "fault_tolerance.sh: $kills stops (--stop $stop, ${stop_for} s each) every $every steps, $epochs epochs"
  mkdir -p "$out"
  echo "$stop" > "$out/stop.txt"
  replica_job replicas_killed 1
  python3 "$root/benchmarks/fault_tolerance_report.py" "$out"
  exit
fi
rm -f "$out/stop.txt"
echo "fault_tolerance.sh: $kills kills every $every steps, $epochs epochs, checkpoints every $checkpoint_every steps"
replica_job replicas_plain 0
replica_job replicas_killed 1
restart_job restarts_plain 0
restart_job restarts_killed 1
for seed in $noise_seeds; do replica_job "replicas_seed$seed" 0; done
# The raw transport, in the same run: Gloo's own broadcast between two ranks, up to 1 MiB.
bench=$build/benchmarks/bench_collectives
if [[ -x $bench ]]; then
  MASTER_PORT='' "$root/scripts/launch.sh" 2 "$bench" --backend gloo --max-bytes 1048576 --runs 3 > "$out/raw_collectives.txt" 2>&1 ||
    echo "fault_tolerance.sh: bench_collectives failed (no raw rate in the report)"
fi
echo "${inside:-(none)}" > "$out/inside.txt"
python3 "$root/benchmarks/fault_tolerance_report.py" "$out"
