#!/usr/bin/env bash
# ZeRO's memory and time on a 25M-parameter Adam model:
#   benchmarks/compare_zero.sh [RANKS]        e.g. benchmarks/compare_zero.sh 4
# One run prints each stage's optimizer state per rank and step time (with the ratio to stage
# 0); then one process group per stage prints its peak RSS (a process's peak covers everything
# it ever held, so each stage needs its own). Build first (scripts/test.sh or meson compile -C build).
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/usage.sh" "$@"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ranks=${1:-4}
mpirun=(mpirun --allow-run-as-root --oversubscribe -np "$ranks")
"${mpirun[@]}" build/benchmarks/bench_zero
for stage in 0 1 2 3; do
  "${mpirun[@]}" build/benchmarks/bench_zero --memory "$stage"
done
