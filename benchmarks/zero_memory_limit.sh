#!/usr/bin/env bash
# A model that does not fit a rank's memory, trained under ZeRO stage 3: each rank of
# `bench_zero --memory S` runs under a resident-memory limit of its own (a memory cgroup per
# rank, benchmarks/memory_limited.sh), for each stage 0-3.
#   benchmarks/zero_memory_limit.sh [LIMIT_MIB [RANKS [LAYERS]]]     default: 768 4 96
# The default is the 100.7M-parameter Adam model (96 layers of 2^20 f32) on 4 ranks with 768 MiB
# each: twice the model's values (384 MiB), so that no stage that holds every value and a
# full-size gradient or optimizer state fits; stage 3 needs 16P/W = 384 MiB and its working set.
# Needs root and a writable memory cgroup (says so and exits 77 otherwise). Build first.
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/usage.sh" "$@"
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
limit=${1:-768}
ranks=${2:-4}
layers=${3:-96}
benchmarks/memory_limited.sh "$limit" true || exit $?  # a cgroup can be made here
printf '%s ranks, %s layers of 2^20 f32, Adam, each rank limited to %s MiB of resident memory\n' "$ranks" "$layers" "$limit"
for stage in 0 1 2 3; do
  output=$(mpirun --allow-run-as-root --oversubscribe -np "$ranks" \
    benchmarks/memory_limited.sh "$limit" build/benchmarks/bench_zero --memory "$stage" --layers "$layers" 2>&1)
  status=$?
  # A rank killed outright by mpirun (after another rank failed) leaves its empty cgroup.
  find /sys/fs/cgroup -maxdepth 8 -type d -name 'gradsync-limit-*' -exec rmdir {} + 2>/dev/null
  if [[ $status -eq 0 ]]; then
    printf 'stage %s: trained: %s\n' "$stage" "$(grep -o 'peak RSS.*' <<<"$output")"
  else
    printf 'stage %s: failed (exit %s): %s\n' "$stage" "$status" "$(grep -m1 'killed by its memory limit\|bench_zero:' <<<"$output")"
  fi
done
