#!/usr/bin/env bash
# The collective sweep of every CPU backend with its raw library and torch.distributed beside it:
#   benchmarks/compare_collectives.sh [RANKS] [MAX_BYTES]
# (build first: scripts/test.sh or meson compile -C build). Needs a Python with torch (GRADSYNC_TORCH_PYTHON, default /usr/bin/python3)
# for the torch columns; without it they are left out.
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/usage.sh" "$@"
set -euo pipefail
# The torch to compare with: GRADSYNC_TORCH_PYTHON (e.g. a venv with a current torch from PyPI),
# else Debian's python3-torch.
python=${GRADSYNC_TORCH_PYTHON:-/usr/bin/python3}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ranks=${1:-2}
max_bytes=${2:-67108864}
bench=build/benchmarks/bench_collectives
table=$(mktemp)
trap 'rm -f "$table"' EXIT
torch_args=()
if "$python" -c 'import torch.distributed' 2>/dev/null; then
  timeout 1800 "$python" benchmarks/torch_collectives.py --ranks "$ranks" --max-bytes "$max_bytes" --out "$table"
  torch_args=(--torch "$table")
fi
mpirun --allow-run-as-root --oversubscribe -np "$ranks" "$bench" --backend mpi --max-bytes "$max_bytes" "${torch_args[@]}"
scripts/launch.sh "$ranks" "$bench" --backend gloo --max-bytes "$max_bytes" "${torch_args[@]}"
