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
export GRADSYNC_FIXTURE_DIR="$PWD/$bundle/fixtures"
out=${OUT:-/tmp/gradsync-gpu-check}
mkdir -p "$out"

nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
echo "bundle: $(cat $bundle/COMMIT 2>/dev/null) built for $(cat $bundle/ARCH)"

declare -a summary
run() {  # run NAME COMMAND...: prints the output, records pass/fail and seconds
  local name=$1
  shift
  local start=$SECONDS
  echo "== $name"
  timeout 240 "$@" 2>&1 | tee "$out/$name.log"
  local status=${PIPESTATUS[0]}
  summary+=("$(printf '%-22s %-6s %4ss' "$name" "$([[ $status == 0 ]] && echo PASS || echo "FAIL($status)")" $((SECONDS - start)))")
}

run gpu_tests "$bundle/bin/test_gpu" --gtest_brief=1
for suite in tensor casts ops registry safetensors optimizers nn; do
  run "unit_$suite" "$bundle/bin/test_$suite" --gtest_brief=1
done
run bench_ops_cuda "$bundle/bin/bench_ops" --device cuda:0 --elements $((1 << 28))
run bench_ops_cpu "$bundle/bin/bench_ops" --device cpu
run bench_optim_cuda "$bundle/bin/bench_optimizers" --device cuda:0 --sizes 16,64,256
# NCCL, world of one (one GPU holds one rank): our layer against a raw NCCL communicator.
run bench_nccl "$bundle/bin/bench_collectives" --backend nccl --max-bytes $((256 << 20))

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
grep -hE '^(memory|axpy|scale|cast|dot|squared)' "$out/bench_ops_cuda.log" | sed 's/^/cuda  /'
grep -hE 'Mi ' "$out/bench_optim_cuda.log" | sed 's/^/cuda  /'
grep -hE '^allreduce +(4|1048576|268435456) ' "$out/bench_nccl.log" | sed 's/^/nccl  /'
