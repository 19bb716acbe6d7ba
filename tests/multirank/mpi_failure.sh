#!/usr/bin/env bash
# MPI jobs that fail must end with our error, never a hang or a third-party abort.
#   mpi_failure.sh CONNECT_WORLD mismatch       every rank reports "collective mismatch", rc 0
#   mpi_failure.sh CONNECT_WORLD stopped-peer   rank 1 stops itself; rank 0 times out, prints
#                                               the error, and the job ends (MPI_Abort) well
#                                               within the limit instead of hanging in MPI_Finalize
set -uo pipefail
program=$1
case_name=$2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
run() { timeout 60 mpirun --allow-run-as-root --oversubscribe -np 2 "$program" mpi "$case_name" >"$log" 2>&1; }
case $case_name in
  mismatch)
    run; rc=$?
    cat "$log"
    [[ $rc -eq 0 ]] || { echo "FAIL: rc $rc"; exit 1; }
    for rank in 0 1; do
      grep -q "rank $rank got: .*collective mismatch" "$log" || { echo "FAIL: rank $rank did not report the mismatch"; exit 1; }
    done
    ;;
  stopped-peer)
    start=$(date +%s)
    GRADSYNC_TIMEOUT_MS=3000 run; rc=$?
    cat "$log"
    elapsed=$(( $(date +%s) - start ))
    [[ $rc -ne 124 ]] || { echo "FAIL: the job hung (killed after 60 s)"; exit 1; }
    grep -q "rank 0 got: .*did not complete within 3000 ms" "$log" || { echo "FAIL: rank 0 reported no timeout"; exit 1; }
    grep -q "ending the job with MPI_Abort" "$log" || { echo "FAIL: no MPI_Abort notice"; exit 1; }
    echo "the job ended after ${elapsed} s (rc $rc)"
    ;;
  *) echo "unknown case $case_name"; exit 2 ;;
esac
echo PASS
