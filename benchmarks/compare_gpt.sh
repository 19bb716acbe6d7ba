#!/usr/bin/env bash
# gpt_ddp against PyTorch DDP (gloo) training the same GPT (benchmarks/torch_gpt.py: the model of
# tests/reference/generate_gpt_fixtures.py, nanoGPT's), same config, ranks, batches, AdamW and
# clipping, one thread per rank on both sides:
#   benchmarks/compare_gpt.sh [RANKS] [small|documented]    (GRADSYNC_TORCH_PYTHON: a Python with torch)
# small (the default): 4 layers, 4 heads, width 128, 8 sequences of 64 per rank; documented: the
# run of docs/examples.md, 6 layers, 6 heads, width 384, 4 sequences of 256 per rank.
# Build first (scripts/test.sh or meson compile -C build). Without torch only ours is printed.
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/usage.sh" "$@"
set -euo pipefail
python=${GRADSYNC_TORCH_PYTHON:-/usr/bin/python3}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ranks=${1:-2}
case ${2:-small} in
  small) config=(--layers 4 --heads 4 --embd 128 --block 64 --batch 8); steps=30 ;;
  documented) config=(--layers 6 --heads 6 --embd 384 --block 256 --batch 4); steps=8 ;;
  *) echo "compare_gpt.sh: unknown config '$2' (small or documented)" >&2; exit 2 ;;
esac
data=$(mktemp)
trap 'rm -f "$data"' EXIT
python3 -c "
import random, struct, sys
random.seed(3)
sys.stdout.buffer.write(struct.pack('<200000H', *[random.randrange(65) for _ in range(200000)]))" >"$data"
GRADSYNC_NUM_THREADS=1 scripts/launch.sh "$ranks" build/examples/gpt_ddp --data "$data" --vocab-size 65 "${config[@]}" \
  --steps $steps --backend gloo | grep "^step" | tail -1 | sed "s/^/gradsync gpt_ddp: /"
if "$python" -c 'import torch.distributed' 2>/dev/null; then
  "$python" benchmarks/torch_gpt.py --ranks "$ranks" "${config[@]}" --steps $steps --vocab 65
fi
