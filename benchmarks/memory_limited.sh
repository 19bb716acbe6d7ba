#!/usr/bin/env bash
# Runs one command (one rank) under a resident-memory limit of its own: a memory cgroup that
# this script makes, joins, and removes when the command ends.
#   benchmarks/memory_limited.sh LIMIT_MIB COMMAND [ARGS...]
#   mpirun -np 4 benchmarks/memory_limited.sh 768 build/benchmarks/bench_zero --memory 3 --layers 96
# A command that needs more is killed by the kernel when it touches the page that goes over
# (the cgroup's OOM killer: no allocation fails first, as on a cluster's memory-limited job);
# this script then says so, naming the rank and the limit, and exits 137. Needs root and a
# writable memory cgroup (cgroup v2 with the memory controller, or v1's memory hierarchy);
# without one it says why and exits 77.
# Why not an address-space limit (ulimit -v): the arenas are paged mappings reserved at their
# full size and committed only where written, so an address-space limit counts memory that is
# never touched, and stages 2 and 3 would reserve as much as each other (docs/zero.md).
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/usage.sh" "$@"
set -uo pipefail
limit_mib=$1
shift
rank=${OMPI_COMM_WORLD_RANK:-${RANK:-0}}

# Where our own cgroup lives, in v2 (the unified hierarchy, if it has the memory controller)
# or in v1's memory hierarchy; the child goes under it, so any limit above still holds.
cgroup=""
if [[ -f /sys/fs/cgroup/cgroup.controllers ]] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
  own=$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)
  cgroup=/sys/fs/cgroup${own%/}/gradsync-limit-$$
  limit_file=memory.max
  kills() { awk '$1 == "oom_kill" {print $2}' "$cgroup/memory.events" 2>/dev/null; }
elif [[ -d /sys/fs/cgroup/memory ]]; then
  own=$(awk -F: '$2 == "memory" {print $3}' /proc/self/cgroup)
  base=/sys/fs/cgroup/memory${own%/}
  [[ -d $base ]] || base=/sys/fs/cgroup/memory
  cgroup=$base/gradsync-limit-$$
  limit_file=memory.limit_in_bytes
  kills() { awk '$1 == "oom_kill" {print $2}' "$cgroup/memory.oom_control" 2>/dev/null; }
fi
if [[ -z $cgroup ]] || ! mkdir "$cgroup" 2>/dev/null; then
  echo "memory_limited.sh: no writable memory cgroup here (needs root, and cgroup v2's memory controller or v1's memory hierarchy): not run" >&2
  exit 77
fi
parent=$(dirname "$cgroup")
cleanup() {
  echo $$ > "$parent/cgroup.procs" 2>/dev/null
  rmdir "$cgroup" 2>/dev/null || { sleep 0.2; rmdir "$cgroup"; }
}
trap cleanup EXIT
echo $((limit_mib * 1024 * 1024)) > "$cgroup/$limit_file"
[[ -f $cgroup/memory.swap.max ]] && echo 0 > "$cgroup/memory.swap.max"  # v2: the limit is RAM, not RAM + swap
[[ -f $cgroup/memory.swappiness ]] && echo 0 > "$cgroup/memory.swappiness" 2>/dev/null
echo $$ > "$cgroup/cgroup.procs"

"$@" &
child=$!
# Stopped (mpirun ends the job when a rank fails): stop the command too, and still clean up.
trap 'kill "$child" 2>/dev/null; wait "$child"; exit 143' TERM INT
wait $child
status=$?
killed=$(kills)
if [[ $status -eq 137 || ${killed:-0} -gt 0 ]]; then
  echo "rank $rank: killed by its memory limit of $limit_mib MiB (the memory cgroup's OOM killer): $1 does not fit" >&2
  exit 137
fi
exit $status
