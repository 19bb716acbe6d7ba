#!/usr/bin/env bash
# Runs on a machine with a GPU: the gpu test suite and the GPU benchmarks, then a short
# summary table. Needs nothing installed there beyond the driver: the binaries and their
# libraries come from gpu_bundle/ (make it with scripts/make_gpu_bundle.sh where the
# build dependencies exist, and carry it). Finishes in well under 5 minutes.
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
if (($#)); then echo "gpu_check.sh: unknown argument '$1' (it takes none; --help)" >&2; exit 2; fi
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bundle=gpu_bundle
if [[ ! -x $bundle/bin/test_gpu ]]; then
  echo "gpu_check: $bundle/ is missing; run scripts/make_gpu_bundle.sh on a build machine and carry it" >&2
  exit 2
fi
# The bundle's libraries, then the machine's CUDA toolkit and its Python's nvidia-* packages
# (cudart, cuBLAS, NCCL are not bundled: see make_gpu_bundle.sh).
cuda_dirs=""
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           $(find / -maxdepth 7 -type d -path '*site-packages/nvidia/*/lib' 2>/dev/null | sort -u); do
  [[ -d $dir ]] && cuda_dirs="$cuda_dirs:$dir"
done
export LD_LIBRARY_PATH="$PWD/$bundle/lib$cuda_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd "$bundle/bin/test_gpu" | grep -E 'nccl|cublas|cudart|not found' | sed 's/^/lib: /' 
export GRADSYNC_FIXTURE_DIR="$PWD/tests/fixtures"
out=${OUT:-/tmp/gradsync-gpu-check}
mkdir -p "$out"

nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
echo "bundle: $(cat $bundle/COMMIT 2>/dev/null) built for $(cat $bundle/ARCH)"

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
gpus=${gpus:-0}
echo "gpus: $gpus"
have_mpirun=0
command -v mpirun >/dev/null 2>&1 && have_mpirun=1
mpi_run=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
digits=(--data examples/data/digits.safetensors --epochs 3 --quiet --check-replicas)

declare -a summary
run() {  # run NAME COMMAND...: prints the output, records pass/fail and seconds
  local name=$1
  shift
  local start=$SECONDS
  echo "== $name"
  timeout 240 "$@" 2>&1 | tee "$out/$name.log"
  local status=${PIPESTATUS[0]}
  local verdict
  verdict=$([[ $status == 0 ]] && echo PASS || echo "FAIL($status)")
  # A gtest binary whose every test skipped passed nothing: say so.
  if [[ $status == 0 ]] && grep -q 'SKIPPED \]' "$out/$name.log" && ! grep -q 'PASSED  \] [1-9]' "$out/$name.log"; then
    verdict=SKIP
  fi
  summary+=("$(printf '%-26s %-8s %4ss' "$name" "$verdict" $((SECONDS - start)))")
}
skip() {  # skip NAME REASON
  echo "== $1: skipped: $2"
  summary+=("$(printf '%-26s %-8s %s' "$1" SKIP "$2")")
}

# 1. Tests: the gpu suite (kernels, optimizers, NCCL with a world of one running every device
#    scenario, the engine's own stream, Gloo staging), the unit suites, then the device suite on
#    Gloo with 1-4 ranks sharing the GPU, MPI likewise, and NCCL with one rank per GPU.
run gpu_tests "$bundle/bin/test_gpu" --gtest_brief=1
for suite in staging tensor casts ops registry safetensors optimizers nn; do
  run "unit_$suite" "$bundle/bin/test_$suite" --gtest_brief=1
done
# The CUDA instances of the parameterised suites (their CPU instances run in CI).
run devices_gloo_1-4_ranks "$bundle/bin/test_devices" --gtest_brief=1 --gtest_filter='*cuda*:NcclRanks.*'
run checklist_horovod "$bundle/bin/test_dist" --gtest_brief=1 --gtest_filter='*cuda*'
run checklist_ddp "$bundle/bin/test_data_parallel" --gtest_brief=1 --gtest_filter='*cuda*'
# PowerSGD on the device: its kernels (cuBLAS products, the orthogonalizations) against the
# host's, then every PyTorch fixture case with the gradients on cuda:0.
run low_rank_cuda "$bundle/bin/test_low_rank" --gtest_brief=1 --gtest_filter='*cuda*'
run powersgd_cuda "$bundle/bin/test_powersgd" --gtest_brief=1 --gtest_filter='*cuda*'
if ((have_mpirun)); then
  for ranks in 2 4; do
    run "devices_mpi_np$ranks" "${mpi_run[@]}" -np "$ranks" "$bundle/bin/test_mpi" --gtest_brief=1 \
      --gtest_filter='Mpi.EveryCollective*:MpiDevices.*'
  done
  if ((gpus >= 2)); then
    run "nccl_np$gpus" "${mpi_run[@]}" -np "$gpus" "$bundle/bin/test_mpi" --gtest_brief=1 --gtest_filter='NcclOverMpi.*'
  else
    skip nccl_multi_rank "NCCL needs one GPU per rank; this machine has $gpus"
  fi
else
  skip devices_mpi "no mpirun on this machine"
  if ((gpus >= 2)); then
    run "nccl_np$gpus" scripts/launch.sh "$gpus" "$bundle/bin/test_devices" --gtest_brief=1 --gtest_filter='NcclRanks.*'
  else
    skip nccl_multi_rank "NCCL needs one GPU per rank; this machine has $gpus"
  fi
fi

# 2. Benchmarks, each beside its ceiling from the same run.
run bench_ops_cuda "$bundle/bin/bench_ops" --device cuda:0 --elements $((1 << 28))
run bench_optim_cuda "$bundle/bin/bench_optimizers" --device cuda:0 --sizes 64,256
# NCCL, world of one (or G ranks): our layer against a raw NCCL communicator.
run bench_nccl "$bundle/bin/bench_collectives" --backend nccl --max-bytes $((256 << 20))
# Device tensors staged through Gloo: 2 ranks on the GPU, against host allreduce + copies.
run bench_gloo_staged scripts/launch.sh 2 "$bundle/bin/bench_collectives" --backend gloo --device cuda \
  --max-bytes $((64 << 20))
# DataParallel on the GPU: the step with and without communication, and the hidden share.
run bench_ddp_nccl "$bundle/bin/bench_ddp" --backend nccl --device cuda --microbatches 1,4 --steps 5
run bench_ddp_gloo_staged scripts/launch.sh 2 "$bundle/bin/bench_ddp" --backend gloo --device cuda \
  --microbatches 1,4 --steps 3

# 3. The trainers on the GPU: every strategy with --find-unused and the replica check; Horovod
#    style with fp16 compression and two backward passes per step. One rank on NCCL, two
#    sharing the GPU through Gloo, and one per GPU on NCCL where there are several.
for strategy in single multi forced auto; do
  run "digits_nccl_$strategy" "$bundle/bin/digits_ddp" --backend nccl --device cuda --microbatches 2 \
    --sync-strategy "$strategy" --find-unused "${digits[@]}"
  run "digits_gloo2_$strategy" scripts/launch.sh 2 "$bundle/bin/digits_ddp" --backend gloo --device cuda \
    --microbatches 2 --sync-strategy "$strategy" --find-unused "${digits[@]}"
done
run horovod_nccl_fp16_bpps2 "$bundle/bin/horovod_style" --backend nccl --device cuda --compression fp16 \
  --backward-passes-per-step 2 "${digits[@]}"
run horovod_gloo2_fp16_bpps2 scripts/launch.sh 2 "$bundle/bin/horovod_style" --backend gloo --device cuda \
  --compression fp16 --backward-passes-per-step 2 "${digits[@]}"
# The GPT trainer with its model on the GPU (examples/gpt/gpt_kernels.cu): the device's forward
# and backward against the host's and against finite differences, then 20 steps against
# PyTorch's on one rank, two sharing the GPU (ZeRO 0 and 3), bf16, and NCCL with several GPUs.
run gpt_model_cuda "$bundle/bin/test_gpt_model" --gtest_brief=1 --gtest_filter='GptModelCuda.*'
run gpt_trainer_cuda env GRADSYNC_EXAMPLES="$bundle/bin" GRADSYNC_COMPARE="$bundle/bin/compare_checkpoints" \
  tests/examples/trainers.sh gpt_cuda "$bundle" "$PWD"
# Its speed on the GPU: nanoGPT's shakespeare_char size (6 x 6 x 384, block 256), 16 sequences.
run gpt_speed_cuda "$bundle/bin/gpt_ddp" --data tests/fixtures/gpt_train.bin --vocab-size 17 --layers 6 --heads 6 \
  --embd 384 --block 256 --batch 16 --steps 30 --device cuda
if ((gpus >= 2)); then
  run "digits_nccl_np$gpus" scripts/launch.sh "$gpus" "$bundle/bin/digits_ddp" --backend nccl --device cuda \
    --microbatches 2 --sync-strategy forced --find-unused "${digits[@]}"
fi

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
grep -hE '^(memory|copy|axpy|scale|cast|dot|squared)' "$out/bench_ops_cuda.log" | sed 's/^/cuda  /'
grep -hE 'Mi ' "$out/bench_optim_cuda.log" | sed 's/^/cuda  /'
grep -hE '^allreduce +(4|1048576|4194304|268435456) ' "$out/bench_nccl.log" | sed 's/^/nccl  /'
grep -hE '^ +(4096|1048576|16777216|67108864) ' "$out/bench_gloo_staged.log" | sed 's/^/staged/'
grep -hE '^(single|multi|forced) ' "$out/bench_ddp_nccl.log" | sed 's/^/ddp nccl  /'
grep -hE '^(single|multi|forced) ' "$out/bench_ddp_gloo_staged.log" | sed 's/^/ddp gloo2 /'
grep -hE '^step +29 ' "$out/gpt_speed_cuda.log" | sed 's/^/gpt cuda  /'
