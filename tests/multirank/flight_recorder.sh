#!/usr/bin/env bash
# The flight recorder end to end: three ranks of flight_faults (Gloo, the environment
# rendezvous) with a fault planted on rank 2, the survivors' dumps on their failure, rank 2's on
# SIGUSR1, and scripts/flight_report.py's analysis, checked line by line.
#   flight_recorder.sh FLIGHT_FAULTS SOURCE_DIR [FAULT...]
set -euo pipefail
program=$1
source=$2
shift 2
faults=("$@")
((${#faults[@]})) || faults=(stopped skip differ)
scratch=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  rm -rf "$scratch"
}
trap cleanup EXIT

expect() {  # expect REPORT TEXT: the report has a line containing TEXT
  if ! grep -qF -- "$2" "$1"; then
    echo "FAIL: the report lacks: $2"
    exit 1
  fi
}

for fault in "${faults[@]}"; do
  dir=$scratch/$fault
  mkdir -p "$dir"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  pids=()
  for rank in 0 1 2; do
    RANK=$rank WORLD_SIZE=3 LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$port GRADSYNC_STORE_TOKEN=flight-test \
      GRADSYNC_TIMEOUT_MS=3000 GRADSYNC_RENDEZVOUS_TIMEOUT_MS=60000 GRADSYNC_FLIGHT_RECORDER_DIR=$dir \
      "$program" "$fault" >"$dir/out$rank.txt" 2>&1 &
    pids+=($!)
  done
  # Ranks 0 and 1 end with an error (a timeout or a mismatch) within seconds.
  for rank in 0 1; do
    if wait "${pids[$rank]}"; then echo "FAIL ($fault): rank $rank succeeded"; cat "$dir/out$rank.txt"; exit 1; fi
  done
  if [[ $fault == stopped ]]; then
    # Rank 2 is still in its endless compute: ask it for its record.
    kill -USR1 "${pids[2]}"
    for _ in $(seq 100); do [[ -f $dir/rank2.json ]] && break; sleep 0.1; done
    kill -9 "${pids[2]}" 2>/dev/null || true
  fi
  wait "${pids[2]}" 2>/dev/null || true
  for rank in 0 1; do grep -q "flight record: $dir/rank$rank.json" "$dir/out$rank.txt" ||
    { echo "FAIL ($fault): rank $rank's error does not say where its record is"; cat "$dir/out$rank.txt"; exit 1; }
    # Gloo's "Timed out waiting ...ms for recv" names nobody; the ranks that timed out together
    # name the one that did not.
    if [[ $fault == stopped ]] && ! grep -q "rank 2 did not time out: stopped, stuck elsewhere" "$dir/out$rank.txt"; then
      echo "FAIL ($fault): rank $rank's timeout does not name rank 2"; cat "$dir/out$rank.txt"; exit 1
    fi
  done
  python3 "$source/scripts/flight_report.py" "$dir" --world 3 | tee "$dir/report.txt"
  case $fault in
    stopped)  # the buckets (the Reducer's communicator, world/1) and the step status (world) wait for rank 2
      expect "$dir/report.txt" "ranks 0, 1 wait in allreduce #6 (sum), f32 x 3048 [bucket 0: fc.bias, fc.weight]"
      expect "$dir/report.txt" "rank 2 is behind: its last collective is allreduce #5 (sum), f32 x 3000 [bucket 1: embed.weight], completed (dumped for: SIGUSR1)"
      expect "$dir/report.txt" "ranks 0, 1 wait in allreduce #10 (sum), f64 x 11 [step status (used parameters, join flags)]"
      expect "$dir/report.txt" "rank 2 is behind: its last collective is allreduce #9 (avg), f32 x 1 [the loss, averaged], completed" ;;
    skip)
      expect "$dir/report.txt" "mismatch at #17: ranks 0, 1 run allreduce #17 (sum), f32 x 2000 [bucket 1: fc.weight]"
      expect "$dir/report.txt" "but rank 2 runs allreduce #17 (sum), f32 x 1000 [bucket 2: fc.bias], the others' #18: rank 2 skipped #17" ;;
    differ)
      expect "$dir/report.txt" "mismatch at #11: ranks 0, 1 run allreduce #11 (avg), f32 x 1 [the loss, averaged]"
      expect "$dir/report.txt" "but rank 2 runs allgather #11, f32 x 1 [the loss, averaged]" ;;
  esac
  echo "== $fault: the report names rank 2 and the operation"
done

# SIGUSR1 while a rank still waits at the rendezvous (no communicator yet, its peer late): the
# rank stays alive and dumps a record saying where it waits, which the report shows.
dir=$scratch/connecting
mkdir -p "$dir"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port GRADSYNC_STORE_TOKEN=flight-test \
  GRADSYNC_RENDEZVOUS_TIMEOUT_MS=60000 GRADSYNC_FLIGHT_RECORDER_DIR=$dir "$program" stopped >"$dir/out1.txt" 2>&1 &
pids=($!)
sleep 1
kill -USR1 "${pids[0]}"
for _ in $(seq 100); do [[ -f $dir/rank1.json ]] && break; sleep 0.1; done
[[ -f $dir/rank1.json ]] || { echo "FAIL: a rank at the rendezvous wrote no record on SIGUSR1"; cat "$dir/out1.txt"; exit 1; }
kill -0 "${pids[0]}" 2>/dev/null || { echo "FAIL: SIGUSR1 ended the rank waiting at the rendezvous"; cat "$dir/out1.txt"; exit 1; }
python3 "$source/scripts/flight_report.py" "$dir" --world 2 | tee "$dir/report.txt"
expect "$dir/report.txt" "rank 1 has no communicator yet: it waits at the rendezvous at 127.0.0.1:$port (dumped for: SIGUSR1)"
kill -9 "${pids[0]}" 2>/dev/null || true
echo "== SIGUSR1 at the rendezvous: the rank lives on and its record says where it waits"

# Damaged dumps beside good ones: each is named with why and left out, the others reported.
good=$scratch/skip
damaged=$scratch/damaged
mkdir -p "$damaged"
cp "$good/rank0.json" "$good/rank1.json" "$damaged/"
head -c 100 "$good/rank2.json" > "$damaged/rank2.json"                        # truncated
: > "$damaged/rank3.json"                                                       # empty
head -c 64 /dev/urandom > "$damaged/rank4.json"; printf '\xff\xfe' >> "$damaged/rank4.json"  # binary
mkdir "$damaged/rank5.json"                                                     # a folder
sed 's/"rank": 0,/"rank": -7,/' "$good/rank0.json" > "$damaged/rank6.json"     # a negative rank
cp "$good/rank1.json" "$damaged/rank7.json"                                     # a second claim on rank 1
echo '{"format": "something else"}' > "$damaged/rank8.json"                     # not a flight record
python3 -c 'print("[" * 100000 + "]" * 100000)' > "$damaged/rank9.json"         # nested 100,000 deep
python3 "$source/scripts/flight_report.py" "$damaged" --world 3 | tee "$damaged/report.txt"
expect "$damaged/report.txt" "rank2.json: left out: not whole JSON"
expect "$damaged/report.txt" "rank3.json: left out: empty"
expect "$damaged/report.txt" "rank4.json: left out: not"
expect "$damaged/report.txt" "rank5.json: left out: not a file"
expect "$damaged/report.txt" "rank6.json: left out: its rank -7 is not one of the job's"
expect "$damaged/report.txt" "rank1.json and rank7.json all claim rank 1: left out"
expect "$damaged/report.txt" "rank8.json: left out: not a flight record"
expect "$damaged/report.txt" "rank9.json: left out: nested too deep to be a flight record"
expect "$damaged/report.txt" "communicator world"
expect "$damaged/report.txt" "no dump from ranks 1, 2"
if python3 "$source/scripts/flight_report.py" "$scratch/nowhere" > "$damaged/none.txt"; then
  echo "FAIL: a missing folder was not an error"; exit 1
fi
expect "$damaged/none.txt" "is not a folder of flight records"
echo "== damaged dumps: each named and left out, the rest reported"
