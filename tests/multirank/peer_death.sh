#!/usr/bin/env bash
# Every phase of tests/multirank/peer_death.cpp on three local Gloo ranks: the survivors must
# fail naming the dead rank, each within 20 s although the timeout is 120 s.
#   tests/multirank/peer_death.sh build/tests/peer_death SOURCE_ROOT
set -uo pipefail
program=$1
launch=$2/scripts/launch.sh
export GRADSYNC_TIMEOUT_MS=120000
failed=0
for phase in zero1-gather zero2-reduce-scatter zero2-gather join-shadow duplicate duplicate-rank0; do
  start=$(date +%s%N)
  output=$(timeout 60 "$launch" 3 "$program" "$phase" 2>&1)
  status=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  survivors=$(grep -c "failed after" <<<"$output")
  echo "== $phase: status $status, $survivors survivors failed, $ms ms"
  echo "$output" | sed 's/^/   /'
  if ((status != 0 || survivors != 2 || ms > 20000)); then
    echo "FAIL: $phase"
    failed=1
  fi
done
exit $failed
