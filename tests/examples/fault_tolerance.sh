#!/usr/bin/env bash
# Fault tolerance across replica groups end to end (docs/fault_tolerance.md): a coordinator and
# 3 replica groups of 2 Gloo ranks of digits_ddp, each group under its own agent that starts it
# again when one of its ranks dies (what torchrun's agent does; tests/examples/torchrun.sh and
# benchmarks/fault_tolerance.sh run the real one).
#   fault_tolerance.sh CASE BUILD_DIR SOURCE_DIR
# CASE:
#   phases               a rank stops inside each phase in turn while the others are in it: the
#                        cross-group reduction, the vote (a group's leader), ZeRO 2's parameter
#                        gather inside a group, and a recovery source at each moment of its
#                        transfer (named, started, halfway, sent: its newcomer recovers from
#                        another group). phase:NAME runs one; recovery the four moments;
#                        FT_REPEAT=N repeats it N times in a row. Each time the job goes on without
#                        stopping, the group comes back and recovers, every group ends on the
#                        same step with the same model, and no sample is lost or trained twice.
#   coordinator_restart  (ZeRO 1 inside the groups) the coordinator is killed mid-run and started
#                        again 1 s later on its port: the groups wait for it and go on, and end alike.
#   min_replicas         --min-replicas 3 and a group that dies for good: the others end within
#                        the join timeout with the error naming the missing group.
#   gpt                  gpt_ddp (AdamW, bf16, --clip-norm 1) as 3 groups, one stopping in its
#                        reduction; the others wait for its replacement (--min-replicas 3), which
#                        recovers; the groups' --save files are byte-identical.
#   hsdp                 FT-HSDP (3 groups x 2 ranks, ZeRO 3 inside, gpt_ddp) against HSDP over 6
#                        ranks with shard groups of 2: within 1e-6, weights and AdamW's state;
#                        then HSDP inside 2 groups of 4 ranks, one rank dying, recovered by pieces.
#   every_group_lost     gpt_ddp's checkpoints across the groups: every group killed at once resumes
#                        from the last checkpoint, byte-identical to a job resumed from it.
# The reduction runs with ZeRO 3 inside the groups, the vote with fp16 and --clip-norm, the gather
# with ZeRO 2 and --clip-norm: the recoveries go by pieces under ZeRO.
set -uo pipefail
case_name=$1
build=$2
source=$3
examples=${GRADSYNC_EXAMPLES:-$build/examples}
# FT_SCRATCH=DIR keeps the logs there (else a temporary folder, removed at the end).
scratch=${FT_SCRATCH:-$(mktemp -d)}
mkdir -p "$scratch"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  [[ -n ${FT_SCRATCH:-} ]] || rm -rf "$scratch"
}
trap cleanup EXIT
export GRADSYNC_TIMEOUT_MS=20000
# The coordinator and every group present the same token (launch.sh keeps it for the groups).
GRADSYNC_STORE_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export GRADSYNC_STORE_TOKEN
failed=0
fail() {
  echo "FAIL: $*"
  failed=1
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

# start_coordinator PORT MIN_REPLICAS JOIN_TIMEOUT_MS [again]: a new job's coordinator, or with
# `again` the same job's started again (its state file keeps the high-water mark).
start_coordinator() {
  [[ ${4:-} == again ]] || rm -f "$scratch/coordinator.state"
  "$examples/coordinator" --port "$1" --replica-groups 3 --min-replicas "$2" --heartbeat-timeout-ms 1000 \
    --join-timeout-ms "$3" --state-file "$scratch/coordinator.state" >> "$scratch/coordinator.log" 2>&1 &
  coordinator=$!
  pids+=("$coordinator")
}

# agent GROUP MAX_RESTARTS ARGS...: the group's 2 ranks, started again (attempt 1, 2, ...) when one
# fails, up to MAX_RESTARTS times; a fresh rendezvous port each attempt, as torchrun's agent.
agent() {
  local group=$1 max=$2 attempt=0
  shift 2
  while :; do
    if TORCHELASTIC_RESTART_COUNT=$attempt MASTER_PORT='' "$source/scripts/launch.sh" 2 "$examples/digits_ddp" \
      --backend gloo --replica-groups 3 --replica-group "$group" --coordinator "127.0.0.1:$port" \
      --record-samples "$scratch/records.jsonl" "$@" >> "$scratch/group$group.log" 2>&1; then
      return 0
    fi
    ((attempt++ >= max)) && return 1
    sleep "${restart_delay:-0}"  # a slow replacement: the others train without it meanwhile
    echo "== agent: group $group started again (attempt $attempt)" >> "$scratch/group$group.log"
  done
}

epochs=4
common=(--epochs $epochs --batch 16 --delay-rank 0:5 --lr 0.1 --seed 3 --cross-timeout-ms 3000)

# run NAME FLAGS0 FLAGS1 FLAGS2: one job, each group with its own extra flags (quoted lists).
run_job() {
  local name=$1
  rm -f "$scratch"/group*.log "$scratch/records.jsonl" "$scratch/coordinator.log"
  port=$(free_port)
  start_coordinator "$port" 1 3000
  local start status=0
  start=$(date +%s%N)
  agent 0 3 "${common[@]}" $2 &
  local a0=$!
  agent 1 3 "${common[@]}" $3 &
  local a1=$!
  agent 2 3 "${common[@]}" $4 &
  local a2=$!
  wait $a0 || status=1
  wait $a1 || status=1
  wait $a2 || status=1
  kill -TERM "$coordinator" 2>/dev/null
  wait "$coordinator" 2>/dev/null
  local ms=$((($(date +%s%N) - start) / 1000000))
  echo "== $name: status $status, $ms ms"
  sed 's/^/   coordinator: /' "$scratch/coordinator.log" | grep -v "waiting for groups" | head -20
  for g in 0 1 2; do grep -E "discarded|recovered|sent|failed|started again|stopping|done at" "$scratch/group$g.log" |
    sed "s/^/   group $g: /" | head -12; done
  ((status == 0)) || { fail "$name: a group did not finish"; tail -n 20 "$scratch"/group*.log; return; }
  python3 "$source/tests/examples/check_samples.py" "$scratch/records.jsonl" --at-least $((1437 * epochs)) ||
    fail "$name: samples"
  same_finals "$name"
}

# The last attempt of every group ends on the same step with the same held-out accuracy.
same_finals() {
  local finals
  finals=$(for g in 0 1 2; do grep "done at step" "$scratch/group$g.log" | tail -1 |
    sed 's/.*done at step \([0-9]*\), [0-9]* samples, held-out accuracy \([0-9.]*\)%.*/\1 \2/'; done | sort -u)
  echo "   final (step, accuracy) of the groups: $(echo $finals)"
  [[ $(wc -l <<<"$finals") -eq 1 ]] || fail "$1: the groups ended apart"
  awk -v a="${finals#* }" 'BEGIN { exit !(a >= 90) }' || fail "$1: held-out accuracy ${finals#* } below 90%"
}

case $case_name in
  phases | phase:* | recovery)
    # phase:NAME runs one of them (and shows its groups' logs when it fails); recovery runs the
    # four recovery moments. FT_REPEAT=N runs it N times in a row, stopping at the first failure.
    only=${case_name#phase:}
    want() { [[ $case_name == phases || $only == "$1" || ($case_name == recovery && $1 =~ ^(named|started|halfway|sent)$) ]]; }
    for ((round = 1; round <= ${FT_REPEAT:-1}; round++)); do
    ((${FT_REPEAT:-1} == 1)) || echo "==== round $round of $FT_REPEAT"
    if want reduce; then
      # Its replacement starts 1 s late: the other two train on as a quorum of two meanwhile.
      # ZeRO 3 inside the groups: the newcomer's ranks recover by pieces, each from its place.
      restart_delay=1 run_job reduce "--zero 3" "--zero 3 --ft-die reduce:1.1@30" "--zero 3"
      grep -q "discarded" "$scratch/group0.log" || fail "reduce: group 0 discarded no step"
      grep -q "recovered" "$scratch/group1.log" || fail "reduce: group 1 did not recover"
      python3 "$source/tests/examples/check_samples.py" "$scratch/records.jsonl" | grep -q "with 2 group(s)" ||
        fail "reduce: no step ran with two groups"
    fi
    if want quorum; then
      # fp16 with its loss scaler and clipping, both after the commit on the cross-group average:
      # the recovery carries the scaler's state (and fp16's f32 master weights).
      fp16="--precision fp16 --clip-norm 5"
      run_job quorum "$fp16" "$fp16" "$fp16 --ft-die quorum:2.0@30"
      grep -q "recovered" "$scratch/group2.log" || fail "quorum: group 2 did not recover"
    fi
    # A recovery source dies at each moment of a transfer. Group 2 dies first; when it comes
    # back, its source (group 0's rank 0, the first up-to-date group) is killed when it has been
    # named, has sent the header, the values (halfway), or everything (the newcomer verifying).
    # The coordinator takes the newcomer for lost with its source (it cannot vote before its
    # transfer times out), so the survivors go on at once; group 2 recovers at a later quorum from
    # another source (or adopts what it verified), group 0 comes back and recovers too, and the job never goes below its highest committed step (check_samples.py:
    # the committed steps are recorded in order, without a gap or a repeat).
    # The job must outlast group 2's way back: after 'named', its newcomer waits out its rendezvous
    # timeout (3 s here) before it asks again; in 4 epochs the others once finished first (the
    # step it missed was then lost, as the coordinator says). 8 epochs leave it time.
    for moment in named started halfway sent; do
      want "$moment" || continue
      epochs=8
      common[1]=$epochs
      run_job "$moment" "--ft-die $moment:0.0@25" "" "--ft-die reduce:2.1@25"
      epochs=4
      common[1]=$epochs
      grep -q "stopping at '$moment'" "$scratch/group0.log" || fail "$moment: group 0 never was a source"
      grep -q "recovered" "$scratch/group2.log" || fail "$moment: group 2 did not recover"
      grep -q "recovered" "$scratch/group0.log" || fail "$moment: group 0 did not recover"
      # The newcomer is lost with its source: nobody waits for its vote until the vote timeout.
      ! grep -q "did not vote within" "$scratch/coordinator.log" || fail "$moment: the others waited for the newcomer"
    done
    if want gather; then
      run_job gather "--zero 2 --clip-norm 5" "--zero 2 --clip-norm 5 --ft-die gather:1.1@30" "--zero 2 --clip-norm 5"
      grep -q "recovered" "$scratch/group1.log" || fail "gather: group 1 did not recover"
    fi
    ((failed == 0)) || break
    done
    [[ $case_name == phase:* && $failed != 0 ]] && for g in 0 1 2; do sed "s/^/   group $g: /" "$scratch/group$g.log"; done
    ;;
  coordinator_restart)
    rm -f "$scratch"/group*.log "$scratch/records.jsonl"
    port=$(free_port)
    start_coordinator "$port" 1 3000
    for g in 0 1 2; do agent "$g" 0 "${common[@]}" --zero 1 & pids+=($!); done
    agents=("${pids[@]:1}")
    sleep 2
    kill -KILL "$coordinator"
    echo "== the coordinator killed at 2 s"
    had_state=false  # a step committed before the kill: the mark was saved, and must be read back
    [[ -f $scratch/coordinator.state ]] && had_state=true
    sleep 1
    start_coordinator "$port" 1 3000 again
    status=0
    for a in "${agents[@]}"; do wait "$a" || status=1; done
    kill -TERM "$coordinator" 2>/dev/null
    grep -v "waiting for groups" "$scratch/coordinator.log" | sed 's/^/   coordinator: /' | head
    for g in 0 1 2; do grep -E "done at" "$scratch/group$g.log" | sed "s/^/   group $g: /"; done
    ((status == 0)) || { fail "coordinator_restart: a group did not finish"; tail -n 20 "$scratch"/group*.log; }
    if $had_state; then
      grep -q "the high-water mark from $scratch/coordinator.state: step [1-9]" "$scratch/coordinator.log" ||
        fail "coordinator_restart: the restarted coordinator did not read the high-water mark from its state file"
    fi
    wait "$coordinator" 2>/dev/null
    grep -q "^high_water=[1-9]" "$scratch/coordinator.state" ||
      fail "coordinator_restart: the coordinator left no high-water mark in its state file"
    python3 "$source/tests/examples/check_samples.py" "$scratch/records.jsonl" --at-least $((1437 * epochs)) ||
      fail "coordinator_restart: samples"
    same_finals coordinator_restart
    ;;
  min_replicas)
    rm -f "$scratch"/group*.log
    port=$(free_port)
    start_coordinator "$port" 3 3000
    start=$(date +%s%N)
    agent 0 0 "${common[@]}" & a0=$!
    agent 1 0 "${common[@]}" & a1=$!
    agent 2 0 "${common[@]}" --ft-die reduce:2.0@20 & a2=$!
    wait $a0 && fail "min_replicas: group 0 ended well"
    wait $a1 && fail "min_replicas: group 1 ended well"
    wait $a2
    ms=$((($(date +%s%N) - start) / 1000000))
    kill -TERM "$coordinator" 2>/dev/null
    echo "== min_replicas: the groups ended after $ms ms"
    grep -h "needs at least" "$scratch"/group0.log "$scratch"/group1.log | head -2 | sed 's/^/   /'
    for g in 0 1; do
      grep -q "a quorum needs at least 3 of 3 replica groups.*groups 2 did not" "$scratch/group$g.log" ||
        fail "min_replicas: group $g did not end with the quorum's error"
    done
    ((ms < 30000)) || fail "min_replicas: took $ms ms"
    ;;
  gpt)
    # gpt_ddp as 3 groups of one rank, AdamW; group 1 stops in its cross-group reduction at step
    # 20. --min-replicas 3: the others wait for its replacement, which recovers; every group ends
    # with the same bytes (weights, AdamW's state, the step) in its --save.
    rm -f "$scratch"/group*.log
    port=$(free_port)
    start_coordinator "$port" 3 20000
    fixtures=$source/tests/fixtures
    gpt() {  # gpt GROUP EXTRA...
      local group=$1
      shift
      for attempt in 0 1; do
        TORCHELASTIC_RESTART_COUNT=$attempt MASTER_PORT='' "$source/scripts/launch.sh" 1 "$examples/gpt_ddp" \
          --data "$fixtures/gpt_train.bin" --vocab-size 17 --layers 2 --heads 2 --embd 16 --block 8 \
          --init "$fixtures/gpt_init.safetensors" --steps 60 --batch 2 --clip-norm 1.0 --precision bf16 --backend gloo \
          --replica-groups 3 --replica-group "$group" --coordinator "127.0.0.1:$port" \
          --save "$scratch/gpt$group.safetensors" "$@" >> "$scratch/group$group.log" 2>&1 && return 0
      done
      return 1
    }
    gpt 0 & a0=$!
    gpt 1 --ft-die reduce:1.0@20 & a1=$!
    gpt 2 & a2=$!
    status=0
    for a in $a0 $a1 $a2; do wait $a || status=1; done
    kill -TERM "$coordinator" 2>/dev/null
    grep -v "waiting for groups" "$scratch/coordinator.log" | sed 's/^/   coordinator: /' | head
    for g in 0 1 2; do grep -E "discarded|recovered|stopping|failed" "$scratch/group$g.log" | sed "s/^/   group $g: /" | head -5; done
    ((status == 0)) || { fail "gpt: a group did not finish"; tail -n 20 "$scratch"/group*.log; }
    grep -q "recovered" "$scratch/group1.log" || fail "gpt: group 1 did not recover"
    cmp "$scratch/gpt0.safetensors" "$scratch/gpt1.safetensors" && cmp "$scratch/gpt0.safetensors" "$scratch/gpt2.safetensors" &&
      echo "   the three groups saved the same bytes" || fail "gpt: the groups ended apart"
    ;;
  every_group_lost)
    # Checkpoints across the groups: gpt_ddp as 3 groups (bf16, --clip-norm 1), a checkpoint every
    # 10 steps written by one group (the first of the quorum that committed the step). Every group
    # kills itself after step 25; restarted, each resumes from the folder's latest (step 20), and
    # the coordinator (--accept-lost-steps) lets them go on below its high-water mark once no group
    # holding it came back within its join timeout. The job ends byte-identical to an uninterrupted
    # job resumed from a copy of that step-20 checkpoint.
    fixtures=$source/tests/fixtures
    tiny=(--data "$fixtures/gpt_train.bin" --vocab-size 17 --layers 2 --heads 2 --embd 16 --block 8
      --init "$fixtures/gpt_init.safetensors" --batch 2 --clip-norm 1.0 --precision bf16 --backend gloo --steps 60
      --checkpoint-every 10 --replica-groups 3)
    job() {  # job NAME CHECKPOINT_DIR EXTRA...: a coordinator and 3 groups, each restarted once
      local name=$1 folder=$2
      shift 2
      port=$(free_port)
      "$examples/coordinator" --port "$port" --replica-groups 3 --min-replicas 3 --join-timeout-ms 2000 \
        --accept-lost-steps > "$scratch/$name.coordinator.log" 2>&1 &
      coordinator=$!
      pids+=("$coordinator")
      for g in 0 1 2; do
        (for attempt in 0 1; do
          if ((attempt == 1 && g == 0)) && [[ $name == lost ]]; then cp -r "$folder" "$scratch/copy.partial" &&
            mv "$scratch/copy.partial" "$scratch/copy"; fi  # step 20's checkpoint, for the reference
          TORCHELASTIC_RESTART_COUNT=$attempt MASTER_PORT='' "$source/scripts/launch.sh" 1 "$examples/gpt_ddp" "${tiny[@]}" \
            --replica-group $g --coordinator "127.0.0.1:$port" --checkpoint-dir "$folder" \
            --save "$scratch/$name$g.safetensors" "$@" >> "$scratch/$name$g.log" 2>&1 && exit 0
        done; exit 1) &
        agents[g]=$!
      done
      for g in 0 1 2; do wait "${agents[g]}" || { fail "every_group_lost: $name: group $g failed"; tail "$scratch/$name$g.log"; }; done
      kill -TERM "$coordinator" 2>/dev/null
    }
    job lost "$scratch/checkpoints" --kill-rank 0:25
    grep -h "kills itself\|resuming from" "$scratch"/lost?.log | sed 's/^/   /'
    grep "below the high-water mark" "$scratch/lost.coordinator.log" | sed 's/^/   coordinator: /'
    grep -q "go on from step 20, below the high-water mark 25" "$scratch/lost.coordinator.log" ||
      fail "every_group_lost: the coordinator did not go on from step 20"
    job reference "$scratch/copy"
    for g in 0 1 2; do
      cmp "$scratch/lost$g.safetensors" "$scratch/reference0.safetensors" || fail "every_group_lost: group $g ended apart"
    done
    ((failed == 0)) && echo "   the restarted job ended byte-identical to the uninterrupted one resumed from step 20"
    ;;
  hsdp)
    # FT-HSDP against HSDP: gpt_ddp as 3 groups of 2 ranks, ZeRO 3 inside each, --clip-norm 1,
    # no failure, against one world of 6 ranks with shard groups of 2 (the same ranks see the same
    # sequences: group g's rank r is rank 2g + r). Within 1e-6, not bitwise: HSDP sums the pieces
    # across the shard groups and divides once by 6 (the Reducer's scale); fault tolerance averages
    # inside the group, then over the quorum's groups (whose number only the step knows), in one
    # coalesced allreduce whose ring cuts the pieces elsewhere than the Reducer's per-bucket ones.
    fixtures=$source/tests/fixtures
    tiny=(--data "$fixtures/gpt_train.bin" --vocab-size 17 --layers 2 --heads 2 --embd 16 --block 8
      --init "$fixtures/gpt_init.safetensors" --batch 2 --clip-norm 1.0 --backend gloo)
    model=("${tiny[@]}" --steps 30 --zero 3)
    MASTER_PORT='' "$source/scripts/launch.sh" 6 "$examples/gpt_ddp" "${model[@]}" --shard-group 2 \
      --save "$scratch/hsdp.safetensors" > "$scratch/hsdp.log" 2>&1 || { fail "hsdp: the HSDP run failed"; tail "$scratch/hsdp.log"; }
    port=$(free_port)
    start_coordinator "$port" 3 20000
    for g in 0 1 2; do
      MASTER_PORT='' "$source/scripts/launch.sh" 2 "$examples/gpt_ddp" "${model[@]}" --replica-groups 3 --replica-group $g \
        --coordinator "127.0.0.1:$port" --save "$scratch/ft$g.safetensors" > "$scratch/group$g.log" 2>&1 &
      agents[g]=$!
    done
    for g in 0 1 2; do wait "${agents[g]}" || { fail "hsdp: group $g failed"; tail "$scratch/group$g.log"; }; done
    kill -TERM "$coordinator" 2>/dev/null
    cmp "$scratch/ft0.safetensors" "$scratch/ft1.safetensors" && cmp "$scratch/ft0.safetensors" "$scratch/ft2.safetensors" ||
      fail "hsdp: the groups ended apart"
    compare=${GRADSYNC_COMPARE:-$build/tests/compare_checkpoints}
    "$compare" "$scratch/hsdp.safetensors" "$scratch/ft0.safetensors" 1e-6 > "$scratch/compare.log" 2>&1 ||
      fail "hsdp: the weights differ from HSDP's by more than 1e-6"
    "$compare" "$scratch"/hsdp.optimizer-*.safetensors "$scratch"/ft0.optimizer-*.safetensors 1e-6 >> "$scratch/compare.log" 2>&1 ||
      fail "hsdp: AdamW's state differs from HSDP's by more than 1e-6"
    echo "   FT-HSDP against HSDP, largest difference: $(grep -o 'max |a - b| = [0-9.e+-]*' "$scratch/compare.log" |
      awk '{ if ($NF + 0 > m) m = $NF + 0 } END { print m }')"
    # HSDP inside the groups too: 2 groups of 4 ranks, shard groups of 2 in each (ZeRO 2), group
    # 1's rank 3 stopping in its reduction at step 15; its replacement recovers by pieces (each
    # rank from its place) and both groups save the same bytes.
    port=$(free_port)
    "$examples/coordinator" --port "$port" --replica-groups 2 --min-replicas 2 --join-timeout-ms 20000 \
      > "$scratch/coordinator.log" 2>&1 &
    coordinator=$!
    pids+=("$coordinator")
    for g in 0 1; do
      (for attempt in 0 1; do
        TORCHELASTIC_RESTART_COUNT=$attempt MASTER_PORT='' "$source/scripts/launch.sh" 4 "$examples/gpt_ddp" "${tiny[@]}" \
          --zero 2 --shard-group 2 --steps 40 --replica-groups 2 --replica-group $g --coordinator "127.0.0.1:$port" \
          --save "$scratch/inner$g.safetensors" $( ((g == 1)) && echo --ft-die reduce:1.3@15) >> "$scratch/inner$g.log" 2>&1 && exit 0
      done; exit 1) &
      agents[g]=$!
    done
    for g in 0 1; do wait "${agents[g]}" || { fail "hsdp: group $g of the HSDP groups failed"; tail "$scratch/inner$g.log"; }; done
    kill -TERM "$coordinator" 2>/dev/null
    grep -h "sent at\|recovered" "$scratch"/inner*.log | sed 's/^/   HSDP inside: /'
    grep -q "recovered" "$scratch/inner1.log" || fail "hsdp: group 1 of the HSDP groups did not recover"
    cmp "$scratch/inner0.safetensors" "$scratch/inner1.safetensors" || fail "hsdp: the HSDP groups ended apart"
    ;;
  *)
    echo "unknown case $case_name" >&2
    exit 2
    ;;
esac
exit $failed
