#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains the digits classifier
# data-parallel on local ranks: 2 CPU ranks over MPI, or one rank per GPU over NCCL when this
# machine has GPUs and the build has NCCL. Ends by printing the held-out accuracy.
# Extra arguments go to the trainer (build/examples/digits_ddp --help lists them).
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
trainer=build/examples/digits_ddp
mpirun=(mpirun --oversubscribe)
[[ $(id -u) == 0 ]] && mpirun+=(--allow-run-as-root)
gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && grep -q 'GRADSYNC_WITH_NCCL 1' build/include/gradsync/config.h; then
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
fi
if ((gpus > 0)); then
  echo "== digits_ddp on $gpus GPU rank(s), NCCL"
  exec "${mpirun[@]}" -np "$gpus" "$trainer" --device cuda "$@"
fi
echo "== digits_ddp on 2 CPU ranks, MPI"
exec "${mpirun[@]}" -np 2 "$trainer" "$@"
