#!/usr/bin/env bash
# Starts N local tasks of a program with the variables a plain `srun -n N` sets (and none of
# torchrun's or mpirun's), so that comm::connect's Slurm path runs end to end without Slurm:
#   fake_srun.sh N PROGRAM [ARGS...]
# The rendezvous host comes from the node list ("localhost" here), the port from the job id.
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/usage.sh" "$@"
set -uo pipefail
ntasks=$1
shift
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT OMPI_COMM_WORLD_SIZE PMI_SIZE PMIX_RANK MPI_LOCALNRANKS
export SLURM_NTASKS=$ntasks SLURM_JOB_ID=$((RANDOM * 7 + 1)) SLURM_NODEID=0 SLURM_STEP_NODELIST=localhost \
  SLURM_JOB_NODELIST=localhost
pids=()
for ((task = 0; task < ntasks; ++task)); do
  SLURM_PROCID=$task SLURM_LOCALID=$task "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit $status
