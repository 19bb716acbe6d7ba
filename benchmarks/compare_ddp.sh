#!/usr/bin/env bash
# DataParallel against PyTorch DDP (gloo) on the same 25M-parameter model, ranks and microbatches:
#   benchmarks/compare_ddp.sh [RANKS] [MICROBATCHES]        e.g. benchmarks/compare_ddp.sh 2 1,4
# Build first (scripts/test.sh or meson compile -C build). Without /usr/bin/python3 + torch the
# torch columns are left out.
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/usage.sh" "$@"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ranks=${1:-2}
microbatches=${2:-1,4}
table=$(mktemp)
trap 'rm -f "$table"' EXIT
torch_args=()
if /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
  timeout 1800 /usr/bin/python3 benchmarks/torch_ddp.py --ranks "$ranks" --microbatches "$microbatches" --out "$table"
  torch_args=(--torch "$table")
fi
mpirun --allow-run-as-root --oversubscribe -np "$ranks" build/benchmarks/bench_ddp --microbatches "$microbatches" "${torch_args[@]}"
