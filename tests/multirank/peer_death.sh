#!/usr/bin/env bash
# Every phase of tests/multirank/peer_death.cpp on three (or four) local Gloo ranks: the survivors must
# fail naming the dead rank, each within 20 s although the timeout is 120 s.
#   tests/multirank/peer_death.sh build/tests/peer_death SOURCE_ROOT
set -uo pipefail
program=$1
launch=$2/scripts/launch.sh
export GRADSYNC_TIMEOUT_MS=120000
failed=0
for phase in zero1-gather zero2-reduce-scatter zero2-gather zero3-gather zero3-reduce-scatter join-shadow diloco-outer diloco-streaming duplicate duplicate-rank0 split hierarchical died-and-followed; do
  ranks=3
  [[ $phase == hierarchical ]] && ranks=4
  start=$(date +%s%N)
  output=$(timeout 60 "$launch" $ranks "$program" "$phase" 2>&1)
  status=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  survivors=$(grep -c "failed after" <<<"$output")
  echo "== $phase: status $status, $survivors survivors failed, $ms ms"
  echo "$output" | sed 's/^/   /'
  if ((status != 0 || survivors != ranks - 1 || ms > 20000)); then
    echo "FAIL: $phase"
    failed=1
  fi
done
# SIGTERM (what torchrun and mpirun send to stop the others) ends a rank that waits in a
# collective at once: gradsync installs no handler that would delay it.
port=$((20000 + RANDOM % 20000))
RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "${program%/*}/connect_world" gloo stopped-peer > /dev/null 2>&1 &
stopped=$!
RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "${program%/*}/connect_world" gloo stopped-peer > /dev/null 2>&1 &
waiting=$!
sleep 2
start=$(date +%s%N)
kill -TERM $waiting
while kill -0 $waiting 2>/dev/null && (($(date +%s%N) - start < 5000000000)); do sleep 0.05; done
ms=$((($(date +%s%N) - start) / 1000000))
kill -KILL $stopped $waiting 2>/dev/null
echo "== SIGTERM: the waiting rank ended $ms ms after it"
((ms < 2000)) || { echo "FAIL: SIGTERM"; failed=1; }
exit $failed
