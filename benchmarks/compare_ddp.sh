#!/usr/bin/env bash
# DataParallel against PyTorch DDP (gloo) on the same 25M-parameter model, ranks and microbatches:
#   benchmarks/compare_ddp.sh [RANKS] [MICROBATCHES]        e.g. benchmarks/compare_ddp.sh 2 1,4
# Build first (scripts/test.sh or meson compile -C build). Without a Python with torch the
# torch columns are left out.
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/usage.sh" "$@"
set -euo pipefail
# The torch to compare with: GRADSYNC_TORCH_PYTHON (e.g. a venv with a current torch from PyPI),
# else Debian's python3-torch.
python=${GRADSYNC_TORCH_PYTHON:-/usr/bin/python3}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ranks=${1:-2}
microbatches=${2:-1,4}
table=$(mktemp)
trap 'rm -f "$table"' EXIT
torch_args=()
if "$python" -c 'import torch.distributed' 2>/dev/null; then
  timeout 1800 "$python" benchmarks/torch_ddp.py --ranks "$ranks" --microbatches "$microbatches" --out "$table"
  torch_args=(--torch "$table")
fi
mpirun --allow-run-as-root --oversubscribe -np "$ranks" build/benchmarks/bench_ddp --microbatches "$microbatches" "${torch_args[@]}"
