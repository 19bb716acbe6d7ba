#!/usr/bin/env bash
# The example trainers end to end, as a user runs them (2 ranks unless said otherwise):
#   trainers.sh CASE BUILD_DIR SOURCE_DIR
# CASE is one of: smoke_digits smoke_horovod smoke_engine three_ranks stragglers accuracy strategies resume interop
# mixed_precision clip_norm timeline uneven zero reshard powersgd gpt gpt_restart mismatched slow_links gpt_cuda.
# GRADSYNC_EXAMPLES and GRADSYNC_COMPARE point at the trainers and compare_checkpoints elsewhere
# (scripts/gpu_check.sh: the GPU bundle's).
set -euo pipefail
case_name=$1
build=$2
source=$3
examples=${GRADSYNC_EXAMPLES:-$build/examples}
compare=${GRADSYNC_COMPARE:-$build/tests/compare_checkpoints}
mpirun=(mpirun --allow-run-as-root --oversubscribe -np 2)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export GRADSYNC_TIMEOUT_MS=${GRADSYNC_TIMEOUT_MS:-60000}

# The loss of the last logged step is below the first one's.
loss_went_down() {
  local first last
  first=$(head -1 "$1" | sed 's/.*"loss": \([0-9.eE+-]*\).*/\1/')
  last=$(grep '"loss"' "$1" | tail -1 | sed 's/.*"loss": \([0-9.eE+-]*\).*/\1/')
  echo "loss: first step $first, last step $last"
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }'
}

# A trainer (digits_ddp: steps by --max-steps; gpt_ddp: by --steps) with FLAGS stopped after
# HALF steps and resumed to ALL ends byte for byte as a run that never stopped: weights, optimizer
# state, progress and whatever else the checkpoint holds.
#   resume_matches TRAINER HALF ALL FLAGS...
resume_matches() {
  local trainer=$1 half=$2 all=$3 steps=--max-steps
  shift 3
  [[ $trainer == gpt_ddp ]] && steps=--steps
  "${mpirun[@]}" "$examples/$trainer" "$@" $steps "$all" --save "$scratch/straight.safetensors"
  "${mpirun[@]}" "$examples/$trainer" "$@" $steps "$half" --save "$scratch/half.safetensors"
  "${mpirun[@]}" "$examples/$trainer" "$@" $steps "$all" --resume "$scratch/half.safetensors" \
    --save "$scratch/resumed.safetensors"
  cmp "$scratch/straight.safetensors" "$scratch/resumed.safetensors"
}

# The GPT cases' run: PyTorch's fixtures (tests/reference/generate_gpt_fixtures.py) for 20 steps.
fixtures=$source/tests/fixtures
gpt_args=(--data "$fixtures/gpt_train.bin" --vocab-size 17 --layers 2 --heads 2 --embd 16 --block 8 --length 8
          --init "$fixtures/gpt_init.safetensors" --lr 3e-3 --min-lr 3e-4 --warmup 5 --decay-steps 20
          --weight-decay 0.1 --eps 1e-6 --clip-norm 1 --quiet)
# losses_match RUN LOSSES BOUND: each of RUN's 20 logged losses within BOUND (relative) of LOSSES'.
losses_match() {
  sed 's/.*"loss": \([0-9.eE+-]*\).*/\1/' "$scratch/$1.jsonl" | paste - "$2" |
    awk -v run=$1 -v bound=$3 '{ d = $1 - $2; if (d < 0) d = -d; if (d > bound * $2) { print run ": step " NR - 1 ": loss " $1 ", PyTorch " $2; bad = 1 } }
                               END { if (NR != 20) { print run ": " NR " steps logged"; bad = 1 }; exit bad }'
}

case $case_name in
  smoke_digits)  # a fraction of an epoch over MPI
    "${mpirun[@]}" "$examples/digits_ddp" --max-steps 12 --metrics "$scratch/m.jsonl" --check-replicas
    loss_went_down "$scratch/m.jsonl" ;;
  smoke_horovod)  # over Gloo through the environment rendezvous, with the Horovod options
    "$source/scripts/launch.sh" 2 "$examples/horovod_style" --backend gloo --max-steps 12 --backward-passes-per-step 2 \
      --compression fp16 --clip-norm 5 --metrics "$scratch/m.jsonl" --check-replicas
    loss_went_down "$scratch/m.jsonl" ;;
  smoke_engine)  # the low-level API, converging to the generating model
    "${mpirun[@]}" "$examples/bring_your_own_engine" --epochs 40 ;;
  three_ranks)  # the defaults run on a world that 64 does not divide; an explicit --batch must divide
    mpirun --allow-run-as-root --oversubscribe -np 3 "$examples/digits_ddp" --max-steps 4 --check-replicas | tee "$scratch/out"
    grep -q "the default global batch 64 is 63 here" "$scratch/out"
    mpirun --allow-run-as-root --oversubscribe -np 3 "$examples/horovod_style" --max-steps 4 --check-replicas --quiet
    mpirun --allow-run-as-root --oversubscribe -np 3 "$examples/bring_your_own_engine" --epochs 2
    if mpirun --allow-run-as-root --oversubscribe -np 3 "$examples/digits_ddp" --max-steps 4 --batch 64 \
        >"$scratch/refused" 2>&1; then
      echo "--batch 64 on 3 ranks was accepted"; exit 1
    fi
    grep -q -- "--batch 64 must divide into 3 ranks x 1 passes" "$scratch/refused" ;;
  stragglers)  # rank 1 slowed by 40 ms a step: the summary names it, and the wait is about that
    mpirun --allow-run-as-root --oversubscribe -np 3 "$examples/digits_ddp" --max-steps 20 --stragglers 10 \
      --delay-rank 1:40 --metrics "$scratch/m.jsonl" | tee "$scratch/out"
    grep -q "step 20: slowest rank 1: the others waited" "$scratch/out"
    python3 - "$scratch/m.jsonl" <<'PY'
import json, sys
reports = [json.loads(line)["stragglers"] for line in open(sys.argv[1]) if "stragglers" in line]
assert len(reports) == 2, reports
for report in reports:
    assert report["slowest"] == 1, report
    assert 30 <= report["waited_ms_per_step"] <= 80, report  # 40 ms a step, give or take scheduling
print("stragglers: rank 1 named in both windows,", [round(r["waited_ms_per_step"], 1) for r in reports], "ms/step")
PY
    ;;
  accuracy)  # the target: at least 95% held-out accuracy, fixed seed
    "${mpirun[@]}" "$examples/digits_ddp" --epochs 20 --seed 1 --min-accuracy 0.95 --quiet ;;
  strategies)  # same final weights: bitwise across ranks (--check-replicas), within tolerance across strategies
    for strategy in single multi forced; do
      "${mpirun[@]}" "$examples/digits_ddp" --microbatches 4 --sync-strategy $strategy --find-unused --max-steps 30 \
        --check-replicas --quiet --save "$scratch/$strategy.safetensors"
    done
    "$compare" "$scratch/single.safetensors" "$scratch/forced.safetensors" 0
    "$compare" "$scratch/single.safetensors" "$scratch/multi.safetensors" 1e-5 ;;
  resume)  # interrupted at step 13 and resumed = uninterrupted, byte for byte (weights and optimizer state)
    resume_matches digits_ddp 13 40 --optimizer adam --microbatches 2 --quiet
    echo "resumed run matches the uninterrupted run byte for byte" ;;
  powersgd)  # PowerSGD: the accuracy target at rank 1; interrupted and resumed = uninterrupted, byte for byte
    # (its error feedback, P, Q and generator ride in the checkpoint)
    "${mpirun[@]}" "$examples/digits_ddp" --epochs 20 --seed 1 --powersgd-rank 1 --min-accuracy 0.95 --quiet
    resume_matches digits_ddp 13 40 --optimizer adam --microbatches 2 --quiet --powersgd-rank 2 --powersgd-start 5
    echo "resumed PowerSGD run matches the uninterrupted run byte for byte" ;;
  gpt)  # nanoGPT's GPT, 20 steps on 1 rank (Gloo) and on 2 (MPI; ZeRO 0, 1, 2, 3; the sync strategies
         # over two microbatches) and 4 (HSDP: ZeRO 2 and 3 in 2 groups of 2), against PyTorch's (tests/reference/generate_gpt_fixtures.py):
         # each step's loss within 1e-5 relative, the final weights within 1e-4; bf16; uneven
    args=("${gpt_args[@]}")
    "$examples/gpt_ddp" "${args[@]}" --steps 20 --batch 4 --backend gloo --metrics "$scratch/one.jsonl" \
      --save "$scratch/one.safetensors"
    "${mpirun[@]}" "$examples/gpt_ddp" "${args[@]}" --steps 20 --batch 2 --backend mpi --metrics "$scratch/two.jsonl" \
      --save "$scratch/two.safetensors"
    for stage in 1 2 3; do  # ZeRO: the same run, AdamW's state (at 2 the gradients, at 3 the parameters) sharded
      "${mpirun[@]}" "$examples/gpt_ddp" "${args[@]}" --steps 20 --batch 2 --backend mpi --zero $stage \
        --metrics "$scratch/zero$stage.jsonl" --save "$scratch/zero$stage.safetensors"
    done
    for strategy in multi forced auto; do  # two microbatches of one sequence: the same mean gradient
      "${mpirun[@]}" "$examples/gpt_ddp" "${args[@]}" --steps 20 --batch 2 --backend mpi --microbatches 2 \
        --sync-strategy $strategy --metrics "$scratch/$strategy.jsonl" --save "$scratch/$strategy.safetensors"
    done
    # HSDP: 4 ranks as 2 groups of 2, ZeRO 3 (and 2) inside each group, replicated across them
    for stage in 2 3; do
      mpirun --allow-run-as-root --oversubscribe -np 4 "$examples/gpt_ddp" "${args[@]}" --steps 20 --batch 1 \
        --backend mpi --zero $stage --shard-group 2 --metrics "$scratch/hsdp$stage.jsonl" --save "$scratch/hsdp$stage.safetensors"
    done
    for run in one two zero1 zero2 zero3 multi forced auto hsdp2 hsdp3; do
      losses_match $run "$fixtures/gpt_train_losses.txt" 1e-5
      "$compare" "$fixtures/gpt_final.safetensors" "$scratch/$run.safetensors" 1e-4
    done
    # bf16 parameters and gradients, f32 arithmetic and master weights, against PyTorch doing the
    # same (generate_gpt_fixtures.py, training_bf16). One rank: losses within 1e-5 (measured
    # 2.4e-7) and the bf16 weights within one bf16 ulp at 1.0 (measured: one ulp at most, in 4 of
    # the 28 tensors). Two ranks round their half-batch gradients to bf16 before averaging where PyTorch's one rank rounds the
    # whole batch's once: losses within 1e-4 (measured 3e-5), weights within one bf16 ulp at the
    # LayerNorm weights' magnitude of 1, 2^-8 (measured: one ulp, in one LayerNorm weight).
    "$examples/gpt_ddp" "${args[@]}" --steps 20 --batch 4 --backend gloo --precision bf16 --metrics "$scratch/bf16_one.jsonl" \
      --save "$scratch/bf16_one.safetensors"
    "${mpirun[@]}" "$examples/gpt_ddp" "${args[@]}" --steps 20 --batch 2 --backend mpi --precision bf16 \
      --metrics "$scratch/bf16_two.jsonl" --save "$scratch/bf16_two.safetensors"
    losses_match bf16_one "$fixtures/gpt_train_losses_bf16.txt" 1e-5
    losses_match bf16_two "$fixtures/gpt_train_losses_bf16.txt" 1e-4
    for run in bf16_one bf16_two; do "$compare" "$fixtures/gpt_final_bf16.safetensors" "$scratch/$run.safetensors" 0.0040; done
    # Uneven inputs through Join: rank 1 stops after 15 of 20 steps and shadows rank 0's; ZeRO's
    # joined rank steps its pieces with rank 0's learning rate (the schedule it no longer runs),
    # so the three runs end with the same weights.
    for stage in 0 1 2 3; do
      "${mpirun[@]}" "$examples/gpt_ddp" "${args[@]}" --steps 20 --batch 2 --backend mpi --uneven --zero $stage \
        --save "$scratch/uneven$stage.safetensors"
    done
    for stage in 1 2 3; do "$compare" "$scratch/uneven0.safetensors" "$scratch/uneven$stage.safetensors" 1e-6; done
    # ... and under HSDP on 4 ranks (2 groups of 2, ZeRO 3): ranks 2 and 3 run out first (13 and 12
    # of 20 steps), so group 1 shadows whole while group 0 steps on; the same weights as ZeRO 3
    # over all 4 ranks under the same Join.
    for group in 2 -1; do
      mpirun --allow-run-as-root --oversubscribe -np 4 "$examples/gpt_ddp" "${args[@]}" --steps 20 --batch 1 \
        --backend mpi --uneven --zero 3 --shard-group $group --save "$scratch/uneven_hsdp$group.safetensors"
    done
    "$compare" "$scratch/uneven_hsdp-1.safetensors" "$scratch/uneven_hsdp2.safetensors" 1e-6
    # The end of a run: the validation loss over the ranks, and a sample of 20 tokens.
    "${mpirun[@]}" "$examples/gpt_ddp" "${args[@]}" --steps 20 --batch 2 --val "$fixtures/gpt_train.bin" --sample 20 \
      >"$scratch/end.txt"
    grep -q "^validation loss [0-9.]*$" "$scratch/end.txt"
    [[ $(sed -n '/^sample:$/{n;p}' "$scratch/end.txt" | wc -w) == 20 ]]
    # Interrupted at step 7 and resumed (weights, AdamW's state, the step; ZeRO 1's consolidated).
    resume_matches gpt_ddp 7 20 "${args[@]}" --batch 2 --zero 1
    # The metrics carry each step's learning rate, and the gradient norm with clipping off too.
    "$examples/gpt_ddp" "${args[@]}" --steps 3 --batch 4 --backend gloo --clip-norm 0 --metrics "$scratch/noclip.jsonl"
    [[ $(grep -c '"grad_norm": [0-9]' "$scratch/noclip.jsonl") == 3 && $(grep -c '"lr": [0-9]' "$scratch/noclip.jsonl") == 3 ]]
    grep -q '"loss": [0-9]\.[0-9]\{7,\}' "$scratch/noclip.jsonl"  # more than 6 decimals
    # --save is nanoGPT's model as PyTorch loads it (strict), AdamW's state in the file beside it
    # that it names (skipped without Debian's torch and safetensors).
    ls "$scratch"/one.optimizer-*.safetensors > /dev/null
    /usr/bin/python3 "$source/tests/reference/check_gpt_nanogpt_load.py" "$scratch/one.safetensors" || [[ $? == 77 ]]
    # A model file whose optimizer file is missing, or not the one saved with it, is refused.
    cp "$scratch/one.safetensors" "$scratch/lonely.safetensors"
    if "$examples/gpt_ddp" "${args[@]}" --steps 21 --batch 4 --backend gloo --resume "$scratch/lonely.safetensors" \
         > "$scratch/refused" 2>&1; then echo "a model file without its optimizer file resumed"; exit 1; fi
    grep -q "keeps its optimizer state in .*lonely.optimizer-.*, which is not there" "$scratch/refused"
    # ... or names another save's optimizer file (whole, so its checksum matches its name): refused.
    "$examples/gpt_ddp" "${args[@]}" --steps 3 --batch 4 --backend gloo --save "$scratch/other.safetensors" > /dev/null
    other=$(ls "$scratch"/other.optimizer-*.safetensors)
    other_id=${other##*.optimizer-}
    other_id=${other_id%.safetensors}
    cp "$other" "$scratch/lonely.optimizer-$other_id.safetensors"
    python3 - "$scratch/one.safetensors" "$scratch/lonely.safetensors" "$other_id" <<'PY'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
length = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + length])
header["__metadata__"]["checkpoint.optimizer_xxh64"] = sys.argv[3]
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(text)) + text + data[8 + length:])
PY
    if "$examples/gpt_ddp" "${args[@]}" --steps 21 --batch 4 --backend gloo --resume "$scratch/lonely.safetensors" \
         > "$scratch/refused" 2>&1; then echo "a model file naming another save's optimizer file resumed"; exit 1; fi
    grep -q "lonely.optimizer-$other_id.safetensors is not the optimizer state saved with .*lonely.safetensors (its global_step is 3, the model file's 20)" "$scratch/refused" ||
      { cat "$scratch/refused"; exit 1; }
    # ... or is a FIFO (its checksum read to the end, for ever): refused at once, naming it.
    rm "$scratch/lonely.optimizer-$other_id.safetensors"
    mkfifo "$scratch/lonely.optimizer-$other_id.safetensors"
    if timeout 20 "$examples/gpt_ddp" "${args[@]}" --steps 21 --batch 4 --backend gloo --resume "$scratch/lonely.safetensors" \
         > "$scratch/refused" 2>&1; then echo "a FIFO for an optimizer file resumed"; exit 1; fi
    grep -q "lonely.optimizer-$other_id.safetensors' is a FIFO, not a regular file" "$scratch/refused" ||
      { cat "$scratch/refused"; exit 1; }
    echo "gpt_ddp's 20 steps match PyTorch on 1, 2 and 4 ranks, ZeRO 1, 2, 3 and HSDP (2 groups of 2, ZeRO 2 and 3), every sync strategy and bf16 included;" \
      "uneven runs end alike under ZeRO 0-3 and HSDP; a resumed run is byte for byte" ;;
  gpt_cuda)  # the gpt case's 20 steps with the model on a GPU (examples/gpt/gpt_kernels.cu), against the
             # same PyTorch fixtures and bounds: one rank, two sharing the GPU through Gloo (staged through
             # the host), ZeRO 3 over those two, bf16 (the CPU's two-rank bounds: cuBLAS sums in another
             # order, which may move a bf16 rounding by one ulp), one rank per GPU on NCCL where there are
             # several. Skipped, saying why, without a GPU (scripts/gpu_check.sh runs it where there is one).
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [[ ${gpus:-0} == 0 ]]; then echo "skipped: no GPU here (nvidia-smi lists none)"; exit 77; fi
    launch=("$source/scripts/launch.sh" 2)
    "$examples/gpt_ddp" "${gpt_args[@]}" --steps 20 --batch 4 --device cuda --metrics "$scratch/one.jsonl" \
      --save "$scratch/one.safetensors"
    "${launch[@]}" "$examples/gpt_ddp" "${gpt_args[@]}" --steps 20 --batch 2 --device cuda --backend gloo \
      --metrics "$scratch/two.jsonl" --save "$scratch/two.safetensors"
    "${launch[@]}" "$examples/gpt_ddp" "${gpt_args[@]}" --steps 20 --batch 2 --device cuda --backend gloo --zero 3 \
      --metrics "$scratch/zero3.jsonl" --save "$scratch/zero3.safetensors"
    runs=(one two zero3)
    if ((gpus >= 2)); then
      "${launch[@]}" "$examples/gpt_ddp" "${gpt_args[@]}" --steps 20 --batch 2 --device cuda --backend nccl \
        --metrics "$scratch/nccl.jsonl" --save "$scratch/nccl.safetensors"
      runs+=(nccl)
    fi
    for run in "${runs[@]}"; do
      losses_match $run "$fixtures/gpt_train_losses.txt" 1e-5
      "$compare" "$fixtures/gpt_final.safetensors" "$scratch/$run.safetensors" 1e-4
    done
    "$examples/gpt_ddp" "${gpt_args[@]}" --steps 20 --batch 4 --device cuda --precision bf16 \
      --metrics "$scratch/bf16.jsonl" --save "$scratch/bf16.safetensors"
    losses_match bf16 "$fixtures/gpt_train_losses_bf16.txt" 1e-4
    "$compare" "$fixtures/gpt_final_bf16.safetensors" "$scratch/bf16.safetensors" 0.0040
    echo "gpt_ddp on the GPU: ${runs[*]} bf16 match PyTorch's 20 steps" ;;
  interop)  # PyTorch's weights after 25 SGD steps, reproduced from the same initial weights and data
    fixture=$source/tests/fixtures/mlp_sgd
    "${mpirun[@]}" "$examples/digits_ddp" --data "$fixture/data.safetensors" --init "$fixture/init.safetensors" \
      --optimizer sgd --momentum 0 --lr 0.1 --batch 64 --microbatches 2 --no-shuffle --holdout 0 --hidden 16 \
      --max-steps 25 --epochs 100 --quiet --save "$scratch/ours.safetensors"
    "$compare" "$fixture/final.safetensors" "$scratch/ours.safetensors" 1e-5 ;;
  mixed_precision)  # 16-bit weights with f32 master weights reach the same target; fp16 resumes exactly
    "${mpirun[@]}" "$examples/digits_ddp" --precision bf16 --epochs 20 --seed 1 --min-accuracy 0.95 --quiet --check-replicas
    "${mpirun[@]}" "$examples/digits_ddp" --precision fp16 --epochs 20 --seed 1 --min-accuracy 0.95 --quiet --check-replicas
    "$source/scripts/launch.sh" 2 "$examples/horovod_style" --backend gloo --precision fp16 --clip-norm 1 --epochs 20 \
      --min-accuracy 0.95 --quiet --check-replicas
    resume_matches digits_ddp 11 30 --precision fp16 --optimizer adam --quiet  # weights, master weights, moments, loss scale
    echo "fp16 resumed run matches the uninterrupted run byte for byte" ;;
  clip_norm)  # the total norm the trainers report equals an independent computation: one process
              # over the same 64 samples (no shuffling: rank r's half is rows r, r+2, ...), no reduction
    norm_of() { grep '"grad_norm"' "$1" | head -1 | sed 's/.*"grad_norm": \([0-9.eE+-]*\).*/\1/'; }
    common=(--no-shuffle --max-steps 1 --clip-norm 0.1 --quiet)
    "$examples/digits_ddp" --backend gloo "${common[@]}" --metrics "$scratch/one.jsonl"
    "${mpirun[@]}" "$examples/digits_ddp" "${common[@]}" --metrics "$scratch/ddp.jsonl"
    "$source/scripts/launch.sh" 2 "$examples/horovod_style" --backend gloo "${common[@]}" --metrics "$scratch/hvd.jsonl"
    one=$(norm_of "$scratch/one.jsonl"); ddp=$(norm_of "$scratch/ddp.jsonl"); hvd=$(norm_of "$scratch/hvd.jsonl")
    echo "total norm at step 1: one process $one, DataParallel $ddp, DistributedOptimizer $hvd"
    awk -v a="$one" -v b="$ddp" -v c="$hvd" 'function rel(x, y) { return (x > y ? x - y : y - x) / y }
      BEGIN { exit !(a > 0.1 && rel(b, a) < 1e-6 && rel(c, a) < 1e-6) }' ;;
  timeline)  # a 2-rank run's trace: structure checked per rank, then merged into one file
    "$source/scripts/launch.sh" 2 "$examples/digits_ddp" --backend gloo --max-steps 6 --microbatches 2 --quiet \
      --bucket-cap-mb 0.0001 --timeline "$scratch/run.json"
    "$build/tests/check_timeline" "$scratch/run.json" 2
    python3 "$source/scripts/timeline_merge.py" "$scratch/run.json" ;;
  uneven)  # ranks with different numbers of batches (3 ranks: 23, 19 and 15 steps per epoch) join and reach the target
    mpi3=(mpirun --allow-run-as-root --oversubscribe -np 3)
    "${mpi3[@]}" "$examples/digits_ddp" --uneven --batch 60 --microbatches 2 --sync-strategy auto --epochs 20 \
      --min-accuracy 0.95 --check-replicas --quiet
    "${mpi3[@]}" "$examples/digits_ddp" --uneven --batch 60 --precision fp16 --divide-by-active --sync-strategy multi \
      --microbatches 2 --epochs 20 --min-accuracy 0.95 --check-replicas --quiet
    "${mpi3[@]}" "$examples/digits_ddp" --uneven --batch 60 --zero 2 --optimizer adam --clip-norm 1 --epochs 20 \
      --min-accuracy 0.95 --check-replicas --quiet
    "$source/scripts/launch.sh" 3 "$examples/horovod_style" --backend gloo --uneven --batch 60 \
      --backward-passes-per-step 2 --optimizer adam --epochs 20 --min-accuracy 0.95 --check-replicas --quiet ;;
  zero)  # ZeRO stages 1-3 (and 1 and 3 with bf16 and clipping) reach the target with identical replicas
    for zero in 1 2; do
      "${mpirun[@]}" "$examples/digits_ddp" --zero $zero --optimizer adam --microbatches 2 --epochs 20 --min-accuracy 0.95 \
        --check-replicas --quiet
    done
    "${mpirun[@]}" "$examples/digits_ddp" --zero 1 --precision bf16 --clip-norm 1 --epochs 20 --min-accuracy 0.95 \
      --check-replicas --quiet
    # Checkpoints: ZeRO-1's consolidated checkpoint is byte for byte the unsharded run's; resumed
    # from a checkpoint taken at step 13, stage 1 reproduces it exactly and stage 2 within 1e-5.
    common=(--optimizer adam --microbatches 2 --quiet)
    "${mpirun[@]}" "$examples/digits_ddp" "${common[@]}" --max-steps 40 --save "$scratch/plain.safetensors"
    "${mpirun[@]}" "$examples/digits_ddp" "${common[@]}" --zero 1 --max-steps 40 --save "$scratch/zero1.safetensors"
    cmp "$scratch/plain.safetensors" "$scratch/zero1.safetensors"
    "${mpirun[@]}" "$examples/digits_ddp" "${common[@]}" --zero 2 --max-steps 13 --save "$scratch/half.safetensors"
    "${mpirun[@]}" "$examples/digits_ddp" "${common[@]}" --max-steps 40 --resume "$scratch/half.safetensors" --zero 1 \
      --save "$scratch/resumed1.safetensors"
    "${mpirun[@]}" "$examples/digits_ddp" "${common[@]}" --max-steps 40 --resume "$scratch/half.safetensors" --zero 2 \
      --save "$scratch/resumed2.safetensors"
    "$compare" "$scratch/plain.safetensors" "$scratch/resumed1.safetensors" 1e-5
    "$compare" "$scratch/plain.safetensors" "$scratch/resumed2.safetensors" 1e-5
    # Stage 3 (parameters sharded; each Linear a unit the example's engine gathers and releases),
    # on Gloo (MPI's busy-polling progress threads, three communicators per rank, crawl when the
    # ranks outnumber the cores): it trains, with bf16 and clipping too; its checkpoint (every
    # unit gathered for it) equals the unsharded run's, and resumed from step 13 it goes on alike.
    launch2=("$source/scripts/launch.sh" 2)
    "${launch2[@]}" "$examples/digits_ddp" --backend gloo --zero 3 --optimizer adam --microbatches 2 --epochs 20 \
      --min-accuracy 0.95 --check-replicas --quiet
    "${launch2[@]}" "$examples/digits_ddp" --backend gloo --zero 3 --precision bf16 --clip-norm 1 --epochs 20 \
      --min-accuracy 0.95 --check-replicas --quiet
    "${launch2[@]}" "$examples/digits_ddp" --backend gloo --zero 3 --precision fp16 --epochs 20 \
      --min-accuracy 0.95 --check-replicas --quiet  # the GradScaler: the finite check over the pieces
    "${launch2[@]}" "$examples/digits_ddp" --backend gloo "${common[@]}" --zero 3 --max-steps 40 \
      --save "$scratch/zero3.safetensors"
    "$compare" "$scratch/plain.safetensors" "$scratch/zero3.safetensors" 1e-5
    "${launch2[@]}" "$examples/digits_ddp" --backend gloo "${common[@]}" --zero 3 --max-steps 13 \
      --save "$scratch/half3.safetensors"
    "${launch2[@]}" "$examples/digits_ddp" --backend gloo "${common[@]}" --zero 3 --max-steps 40 \
      --resume "$scratch/half3.safetensors" --save "$scratch/resumed3.safetensors"
    "$compare" "$scratch/plain.safetensors" "$scratch/resumed3.safetensors" 1e-5
    # Uneven inputs under stage 3: the joined rank answers the other's gathers on its shadow thread.
    "${launch2[@]}" "$examples/digits_ddp" --backend gloo --zero 3 --uneven --optimizer adam --clip-norm 1 --epochs 20 \
      --min-accuracy 0.95 --check-replicas --quiet
    echo "ZeRO-1's checkpoint equals the unsharded one byte for byte; resumed runs match (stages 1-3); stage 3 uneven" ;;
  slow_links)  # LocalSGD and DiLoCo through the trainers' flags (examples/common/slow_links.h; the
               # algorithms themselves are checked against PyTorch in meson test local_sgd / diloco)
    # digits: both reach the target with the gradients never averaged after the warm-up
    "${mpirun[@]}" "$examples/digits_ddp" --epochs 20 --seed 1 --local-sgd 8 --min-accuracy 0.95 --quiet
    "${mpirun[@]}" "$examples/digits_ddp" --epochs 20 --seed 1 --optimizer adamw --lr 0.003 --diloco 8 --outer-warmup 10 \
      --min-accuracy 0.95 --quiet
    # gpt: LocalSGD every step and DiLoCo every step with the outer SGD at lr 1 without momentum both
    # average the models after every inner step: the same run to rounding (measured 7.5e-9), and not
    # DDP's (which averages the gradients: 1e-2 apart), so the gradients were indeed left local.
    args=("${gpt_args[@]}" --steps 20 --batch 2 --backend mpi)
    "${mpirun[@]}" "$examples/gpt_ddp" "${args[@]}" --local-sgd 1 --save "$scratch/local1.safetensors"
    "${mpirun[@]}" "$examples/gpt_ddp" "${args[@]}" --diloco 1 --outer-lr 1 --outer-momentum 0 --save "$scratch/diloco1.safetensors"
    "${mpirun[@]}" "$examples/gpt_ddp" "${args[@]}" --save "$scratch/ddp.safetensors"
    "$compare" "$scratch/local1.safetensors" "$scratch/diloco1.safetensors" 1e-6
    if "$compare" "$scratch/local1.safetensors" "$scratch/ddp.safetensors" 1e-3 > /dev/null; then
      echo "LocalSGD ended where DDP did: were the gradients synchronized?"; exit 1
    fi
    # Streaming DiLoCo across 2 groups of 2 (each synchronous inside), bf16 on the wire, the
    # validation loss every 5 steps into the metrics, stopped by a time budget at the first point.
    mpirun --allow-run-as-root --oversubscribe -np 4 "$examples/gpt_ddp" "${args[@]}" --diloco 4 --streaming-fragments 2 \
      --fragment-delay 1 --inner-group 2 --outer-compression bf16 --val "$fixtures/gpt_train.bin" --val-every 5 \
      --time-budget 1e-9 --metrics "$scratch/streaming.jsonl" > "$scratch/streaming.txt"
    [[ $(grep -c '"val_loss"' "$scratch/streaming.jsonl") == 1 ]]  # the budget ended it at step 5
    grep -q '"step": 5, .*"outer_bytes_sent": [1-9]' "$scratch/streaming.jsonl"  # both fragments launched by then
    # DiLoCo across 2 groups of 2 whose inner AdamW is ZeRO 1 or 2 over the group: the run with a
    # plain DataParallel inside, bit for bit (measured 0).
    for stage in 0 1 2; do
      mpirun --allow-run-as-root --oversubscribe -np 4 "$examples/gpt_ddp" "${gpt_args[@]}" --steps 20 --batch 1 \
        --backend mpi --diloco 4 --inner-group 2 --zero $stage --save "$scratch/inner_zero$stage.safetensors"
    done
    for stage in 1 2; do "$compare" "$scratch/inner_zero0.safetensors" "$scratch/inner_zero$stage.safetensors" 0; done
    # Refused: ZeRO without inner groups (every rank its own replica), ZeRO 3 (sharded values);
    # DiLoCo's options without --diloco.
    if "${mpirun[@]}" "$examples/gpt_ddp" "${args[@]}" --diloco 4 --zero 1 > "$scratch/refused" 2>&1; then exit 1; fi
    grep -q "run without --zero (but 1 or 2 with --inner-group)" "$scratch/refused"
    if "${mpirun[@]}" "$examples/digits_ddp" --local-sgd 4 --outer-lr 0.5 > "$scratch/refused" 2>&1; then exit 1; fi
    grep -q "are DiLoCo's: they need --diloco H" "$scratch/refused"
    echo "LocalSGD and DiLoCo reach the digits target; LocalSGD = DiLoCo(lr 1) in gpt_ddp, unlike DDP; streaming runs;" \
      "DiLoCo over inner ZeRO 1 and 2 = over inner DDP" ;;
  reshard)  # written by 4 ranks, resumed on 2 and on 3 (ZeRO stages 0-2): the same global batch, training goes on
    launch=("$source/scripts/launch.sh")
    for zero in 0 1 2; do
      rm -rf "$scratch/four"
      "${launch[@]}" 4 "$examples/digits_ddp" --backend gloo --zero $zero --optimizer adam --batch 48 --epochs 3 \
        --checkpoint-dir "$scratch/four" --checkpoint-every 10 --quiet --metrics "$scratch/four.jsonl"
      for world in 2 3; do
        rm -rf "$scratch/again" && cp -r "$scratch/four" "$scratch/again"
        # Loaded and saved at once (no step): the state every rank's pieces make is the consolidated
        # state the 4 ranks wrote, byte for byte.
        "${launch[@]}" $world "$examples/digits_ddp" --backend gloo --zero $zero --optimizer adam --epochs 3 \
          --checkpoint-dir "$scratch/again" --quiet --save "$scratch/reloaded.safetensors"
        cmp "$scratch/four/$(cat "$scratch/four/latest")" "$scratch/reloaded.safetensors"
        # Training goes on with the global batch of 48 (24 or 16 per rank), the loss below the 4-rank run's start.
        "${launch[@]}" $world "$examples/digits_ddp" --backend gloo --zero $zero --optimizer adam --epochs 8 \
          --checkpoint-dir "$scratch/again" --metrics "$scratch/again.jsonl" --min-accuracy 0.9 --check-replicas \
          | tee "$scratch/out"
        grep -q "global batch 48 = $world x" "$scratch/out"
        awk -v first="$(head -1 "$scratch/four.jsonl" | sed 's/.*"loss": \([0-9.eE+-]*\).*/\1/')" \
          -v later="$(head -1 "$scratch/again.jsonl" | sed 's/.*"loss": \([0-9.eE+-]*\).*/\1/')" \
          'BEGIN { print "loss: 4 ranks first step " first ", resumed on '$world' first step " later; exit !(later < first / 2) }'
      done
    done
    # A global batch the new world cannot split is refused, naming both.
    if "${launch[@]}" 5 "$examples/digits_ddp" --backend gloo --epochs 4 --checkpoint-dir "$scratch/again" \
         > "$scratch/refused" 2>&1; then
      echo "resuming a batch of 48 on 5 ranks was not refused"; exit 1
    fi
    grep -q "global batch of 48, which does not split evenly into 5 ranks" "$scratch/refused"
    echo "resumed on 2 and 3 ranks at ZeRO stages 0-2: consolidated state equal, training went on" ;;
  gpt_restart)  # gpt_ddp's automatic resume (the digits trainers' code, examples/common/checkpoints.h): a run
                # whose rank 1 SIGKILLs itself after step 13, started again with the same command, resumes from
                # the folder's latest checkpoint (step 10) and ends byte for byte as an uninterrupted run, at
                # ZeRO 0, 1 and 3 (stage 3 gathers the model for each checkpoint and releases it again)
    for zero in 0 1 3; do
      rm -rf "$scratch/straight" "$scratch/restarted"
      "${mpirun[@]}" "$examples/gpt_ddp" "${gpt_args[@]}" --steps 20 --batch 2 --zero $zero \
        --checkpoint-dir "$scratch/straight" --checkpoint-every 5 --save "$scratch/straight.safetensors"
      if "${mpirun[@]}" "$examples/gpt_ddp" "${gpt_args[@]}" --steps 20 --batch 2 --zero $zero \
          --checkpoint-dir "$scratch/restarted" --checkpoint-every 5 --kill-rank 1:13 \
          --save "$scratch/restarted.safetensors" > "$scratch/killed" 2>&1; then
        echo "the run with --kill-rank 1:13 was not killed"; cat "$scratch/killed"; exit 1
      fi
      grep -q "rank 1 kills itself after step 13" "$scratch/killed"
      [[ $(cat "$scratch/restarted/latest") == step_10.safetensors ]]
      # (gpt_args without its last word, --quiet: the resumed run says where it resumed from)
      "${mpirun[@]}" "$examples/gpt_ddp" "${gpt_args[@]:0:${#gpt_args[@]}-1}" --steps 20 --batch 2 --zero $zero \
        --checkpoint-dir "$scratch/restarted" --checkpoint-every 5 --save "$scratch/restarted.safetensors" \
        > "$scratch/resumed"
      grep -q "resuming from $scratch/restarted/step_10.safetensors" "$scratch/resumed"
      cmp "$scratch/straight.safetensors" "$scratch/restarted.safetensors"
      cmp "$scratch/straight/step_20.safetensors" "$scratch/restarted/step_20.safetensors"
    done
    # The folder's global batch is the run's: resuming it with another --batch is refused, naming both.
    if "${mpirun[@]}" "$examples/gpt_ddp" "${gpt_args[@]}" --steps 20 --batch 1 --checkpoint-dir "$scratch/restarted" \
         > "$scratch/refused" 2>&1; then
      echo "resuming a global batch of 4 with --batch 1 on 2 ranks was not refused"; exit 1
    fi
    grep -q "trained with a global batch of 4 sequences; this run's is 2" "$scratch/refused"
    # A --checkpoint-dir that is a file is refused before the first step.
    touch "$scratch/a_file"
    if "${mpirun[@]}" "$examples/gpt_ddp" "${gpt_args[@]}" --steps 20 --batch 2 --checkpoint-dir "$scratch/a_file" \
         > "$scratch/refused" 2>&1; then
      echo "a --checkpoint-dir that is a file was not refused"; exit 1
    fi
    grep -q "checkpoint-dir $scratch/a_file is not a folder" "$scratch/refused"
    echo "gpt_ddp killed at step 13 and started again resumed from step 10 and ended byte for byte (ZeRO 0, 1, 3)" ;;
  mismatched)  # settings that must agree across ranks, compared at the start: a difference is an error on every
              # rank naming the setting and the ranks, before any step; the program is named once per line
    one=(mpirun --allow-run-as-root --oversubscribe -np 1)
    refused() {  # refused OUT TEXT...: the run failed, took no step, and every rank's error has each TEXT
      local out=$1
      shift
      if ! grep -q "the ranks do not hold the same settings" "$out"; then echo "not refused as expected:"; cat "$out"; exit 1; fi
      for text in "$@"; do grep -qF -- "$text" "$out" || { echo "the error lacks: $text"; cat "$out"; exit 1; }; done
      if grep -q "^epoch\|^step " "$out"; then echo "steps were taken before the refusal"; cat "$out"; exit 1; fi
      if grep -q "digits_ddp: digits_ddp:\|gpt_ddp: gpt_ddp:" "$out"; then echo "a doubled prefix"; cat "$out"; exit 1; fi
    }
    if "${one[@]}" "$examples/digits_ddp" --batch 60 --epochs 3 : -np 1 "$examples/digits_ddp" --batch 62 --epochs 3 \
        > "$scratch/batch" 2>&1; then echo "--batch 60 and 62 trained"; exit 1; fi
    refused "$scratch/batch" "Setting #0 is --batch 60 on rank 0 but --batch 62 on rank 1" \
      "Setting #0 is --batch 62 on rank 1 but --batch 60 on rank 0"
    if "${one[@]}" "$examples/digits_ddp" --batch 60 : -np 1 "$examples/digits_ddp" --batch 60 \
        : -np 1 "$examples/digits_ddp" --batch 30 > "$scratch/three" 2>&1; then echo "--batch 60, 60, 30 trained"; exit 1; fi
    refused "$scratch/three" "--batch 30 on rank 2"
    head -c 4000 "$fixtures/gpt_train.bin" > "$scratch/other.bin"
    if "${one[@]}" "$examples/gpt_ddp" "${gpt_args[@]}" --batch 2 : -np 1 "$examples/gpt_ddp" "${gpt_args[@]}" --batch 2 \
        --data "$scratch/other.bin" > "$scratch/data" 2>&1; then echo "two data files trained"; exit 1; fi
    refused "$scratch/data" "--data $(stat -c %s "$fixtures/gpt_train.bin") bytes" "--data 4000 bytes"
    if "${one[@]}" "$examples/horovod_style" --op sum : -np 1 "$examples/horovod_style" > "$scratch/op" 2>&1; then
      echo "--op sum and average trained"; exit 1
    fi
    refused "$scratch/op" "--op sum on rank 0 but --op average on rank 1"
    # Progress reaches a file as it is printed: a rank SIGKILLed after step 30 has left its first
    # epoch's line (22 steps of 64) behind, not lost it in a block buffer.
    if "$examples/digits_ddp" --kill-rank 0:30 > "$scratch/killed" 2>&1; then echo "--kill-rank 0:30 lived"; exit 1; fi
    grep -q "^epoch   1/20" "$scratch/killed" || { echo "the killed run's progress was lost"; cat "$scratch/killed"; exit 1; }
    echo "mismatched settings refused at the start on every rank, naming them; progress survives a kill" ;;
  *) echo "unknown case $case_name" >&2; exit 2 ;;
esac
