#!/usr/bin/env bash
# Training across a slow link: gpt_ddp on the character corpus on two simulated nodes of two Gloo
# ranks (scripts/simulate_nodes.sh), each strategy for the same wall-clock budget, the validation
# loss every 32 steps against the seconds (docs/slow_links.md, docs/benchmarks.md):
#   DDP flat and hierarchical, PowerSGD rank 4, DiLoCo H = 8 and 32 (synchronous inside a node,
#   across the nodes every H steps) and streaming DiLoCo (H = 32, 4 fragments, each overlapping 2
#   inner steps, bf16 on the wire).
#
#   sudo benchmarks/slow_links.sh [--rate 1gbit] [--budget 180] [--out runs/slow]
#
# Writes OUT/RATE/<strategy>.jsonl (gpt_ddp --metrics) and OUT/RATE/<strategy>.txt (its output), then
# prints one line per strategy: steps, tokens/s, bytes off the node per step, the last validation
# loss. scripts/plot_metrics.sh OUT/plot.png --wallclock OUT/RATE/*.jsonl draws them.
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/usage.sh" "$@"
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rate=1gbit
budget=180
out=$root/runs/slow
strategies="ddp ddp_hierarchical powersgd4 diloco8 diloco32 streaming"
while [[ $# -gt 0 ]]; do
  case $1 in
    --rate) rate=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --strategies) strategies=$2; shift 2 ;;
    *) echo "slow_links.sh: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
corpus=$root/runs/kjv_char
[[ -f $corpus/train.bin ]] || "$root/scripts/prepare_char_corpus.sh" "$corpus"
vocab=$(python3 -c "import json; print(json.load(open('$corpus/meta.json'))['vocab_size'])")
mkdir -p "$out/$rate"
model=(--data "$corpus/train.bin" --val "$corpus/val.bin" --vocab-size "$vocab" --layers 4 --heads 4 --embd 192
       --block 64 --batch 4 --steps 100000 --lr 1e-3 --min-lr 1e-4 --warmup 50 --decay-steps 2000 --backend gloo
       --val-every 32 --time-budget "$budget")
for strategy in $strategies; do
  hierarchical=0
  extra=()
  case $strategy in
    ddp) ;;
    ddp_hierarchical) hierarchical=1 ;;
    powersgd4) extra=(--powersgd-rank 4 --powersgd-start 10) ;;
    diloco8) extra=(--diloco 8 --inner-group 2) ;;
    diloco32) extra=(--diloco 32 --inner-group 2) ;;
    streaming) extra=(--diloco 32 --inner-group 2 --streaming-fragments 4 --fragment-delay 2 --outer-compression bf16) ;;
    *) echo "slow_links.sh: unknown strategy $strategy" >&2; exit 2 ;;
  esac
  GRADSYNC_HIERARCHICAL=$hierarchical "$root/scripts/simulate_nodes.sh" --rate "$rate" -- \
    "$root/build/examples/gpt_ddp" "${model[@]}" "${extra[@]}" --metrics "$out/$rate/$strategy.jsonl" \
    > "$out/$rate/$strategy.txt" 2>&1 || { echo "slow_links.sh: $strategy failed:"; tail -5 "$out/$rate/$strategy.txt"; exit 1; }
  python3 - "$out/$rate/$strategy.jsonl" "$strategy" "$rate" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
steps = [r for r in records if "tokens_per_s" in r]
vals = [r for r in records if "val_loss" in r]
seconds = steps[-1]["seconds"]
tokens_per_step = 4 * 4 * 64  # 4 ranks x --batch 4 x --block 64
per_step_bytes = steps[-1]["node_bytes_sent"] / len(steps)
print(f"{sys.argv[3]:>7} {sys.argv[2]:<17} {len(steps):5d} steps in {seconds:6.1f} s  "
      f"{len(steps) * tokens_per_step / seconds:7.0f} tokens/s  {per_step_bytes / 1e6:8.2f} MB off node 0 per step  "
      f"last validation loss {vals[-1]['val_loss']:.4f}")
PY
done
