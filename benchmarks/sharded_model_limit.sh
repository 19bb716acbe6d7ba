#!/usr/bin/env bash
# A model whose values alone exceed each rank's memory limit, constructed, initialized, trained,
# saved as one consolidated file and reloaded at another world size, every rank under a
# resident-memory limit of its own (benchmarks/memory_limited.sh: a memory cgroup per rank);
# and today's construction (rank 0 initializes the whole model, DataParallel broadcasts it)
# under the same limit.
#   benchmarks/sharded_model_limit.sh [LIMIT_MIB [RANKS [RELOAD_RANKS [LAYERS]]]]
# Default: 960 MiB per rank, 4 ranks, reloaded on 3, 256 layers of 2^20 f32 (268M parameters,
# 1024 MiB of values: more than the limit). SGD without momentum: a rank holds its pieces of the
# values and of the gradients (2 x 1024 / 4 MiB on 4 ranks, 2 x 1024 / 3 on 3) beside the process
# itself (about 170 MiB with MPI). Then PyTorch loads the file, when this machine's python3 has
# torch and safetensors (scripts/setup.sh --with-reference). Needs root and a writable memory cgroup (says so and exits 77
# otherwise). Build first.
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/usage.sh" "$@"
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
limit=${1:-960}
ranks=${2:-4}
reload=${3:-3}
layers=${4:-256}
benchmarks/memory_limited.sh "$limit" true || exit $?  # a cgroup can be made here
folder=$(mktemp -d "${TMPDIR:-/tmp}/gradsync-sharded-model.XXXXXX")
trap 'rm -rf "$folder"' EXIT
model=$folder/model.safetensors
run() {  # RANKS ARGS...: bench_sharded_model on RANKS ranks, each under the limit
  local n=$1
  shift
  mpirun --allow-run-as-root --oversubscribe -np "$n" \
    benchmarks/memory_limited.sh "$limit" build/benchmarks/bench_sharded_model --backend mpi --layers "$layers" "$@" 2>&1
  local status=$?
  # A rank killed outright by mpirun (after another rank failed) leaves its empty cgroup.
  find /sys/fs/cgroup -maxdepth 8 -type d -name 'gradsync-limit-*' -exec rmdir {} + 2>/dev/null
  return $status
}
printf 'Each rank limited to %s MiB of resident memory.\n\n' "$limit"
printf '== Today'"'"'s construction (rank 0 initializes the whole model, DataParallel broadcasts it), %s ranks\n' "$ranks"
if output=$(run "$ranks" --construct broadcast --steps 1); then
  printf '%s\n(it fit: raise --layers or lower the limit to show the difference)\n' "$output"
else
  printf 'failed (exit %s): %s\n' "$?" "$(grep -m1 'killed by its memory limit\|bench_sharded_model:' <<<"$output")"
fi
printf '\n== Never whole: constructed, initialized by pieces, trained, saved in parallel, %s ranks\n' "$ranks"
saved=$(run "$ranks" --steps 2 --save "$model") || { printf 'failed: %s\n' "$saved"; exit 1; }
grep -v '^model checksum \|saved .*ceiling' <<<"$saved" | sed "s|$folder/||"
grep 'saved .*ceiling' <<<"$saved" | sed "s|$folder/||"
printf '\n== Reloaded by ranges on %s ranks, trained one step\n' "$reload"
loaded=$(run "$reload" --steps 1 --load "$model") || { printf 'failed: %s\n' "$loaded"; exit 1; }
grep -v '^model checksum' <<<"$loaded" | sed "s|$folder/||"
wrote=$(grep -o 'model checksum after training [0-9a-f]*' <<<"$saved" | awk '{print $NF}')
read=$(grep -o '^model checksum [0-9a-f]\{16\}$' <<<"$loaded" | awk '{print $NF}')
if [[ -n $wrote && $wrote == "$read" ]]; then
  printf 'the reloaded model is the saved one: checksum %s on both\n' "$wrote"
else
  printf 'MISMATCH: saved checksum %s, reloaded %s\n' "$wrote" "$read"
  exit 1
fi
python=/usr/bin/python3  # Debian's, where scripts/setup.sh --with-reference installs torch and safetensors
[[ -x $python ]] || python=python3
if "$python" -c 'import torch, safetensors' 2>/dev/null; then
  "$python" - "$model" <<'PY'
import sys, json, torch
from safetensors import safe_open
with safe_open(sys.argv[1], framework="pt") as f:
    names = list(f.keys())
    count = sum(f.get_slice(n).get_shape()[0] for n in names)
    first = f.get_tensor(names[0])
print(f"PyTorch (safetensors {__import__('safetensors').__version__}, torch {torch.__version__}) opens it: "
      f"{len(names)} tensors, {count} elements; {names[0]}: mean {first.mean():.3g}, std {first.std():.4g}")
PY
else
  echo "(PyTorch's check skipped: this python3 has no torch and safetensors)"
fi
