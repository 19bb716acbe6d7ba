#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries here, for Hopper (sm_90) unless told otherwise,
# and gathers them with every shared library they need (except the GPU driver and the C
# library) into gpu_bundle/ (ignored by git). A GPU machine with nothing installable then
# runs them through scripts/gpu_check.sh.
#
#   scripts/make_gpu_bundle.sh [ARCH]     e.g. 90 (H100/H200), 100 (B200)
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
arch=${1:-90}
scripts/setup.sh >/dev/null
export PATH="/usr/local/cuda/bin:$PATH"

if [[ ! -f build-gpu/build.ninja ]]; then
  meson setup build-gpu -Dcuda=enabled -Dgpu_arch="$arch" >/dev/null
else
  meson configure build-gpu -Dgpu_arch="$arch" >/dev/null
fi
ninja -C build-gpu

rm -rf gpu_bundle
mkdir -p gpu_bundle/bin gpu_bundle/lib
binaries=(build-gpu/tests/test_gpu build-gpu/tests/test_tensor build-gpu/tests/test_casts build-gpu/tests/test_ops
          build-gpu/tests/test_registry build-gpu/tests/test_safetensors build-gpu/tests/test_optimizers build-gpu/tests/test_nn
          build-gpu/tests/test_staging build-gpu/tests/test_devices build-gpu/tests/test_mpi
          build-gpu/tests/test_dist build-gpu/tests/test_data_parallel build-gpu/tests/test_low_rank
          build-gpu/tests/test_powersgd
          build-gpu/benchmarks/bench_ops build-gpu/benchmarks/bench_checkpoint build-gpu/benchmarks/bench_optimizers
          build-gpu/benchmarks/bench_collectives build-gpu/benchmarks/bench_ddp
          build-gpu/examples/digits_ddp build-gpu/examples/horovod_style
          build-gpu/examples/gpt_ddp build-gpu/tests/test_gpt_model build-gpu/tests/compare_checkpoints)
cp "${binaries[@]}" gpu_bundle/bin/
# The test fixtures and the trainers' data travel with the working tree (tests/fixtures,
# examples/data); gpu_check.sh points the binaries there.
# Every library the binaries load, except the driver (it must match the kernel module there),
# glibc's own libraries (always present, and tied to the dynamic loader), and the CUDA
# toolkit's (cudart, cuBLAS, NCCL: hundreds of MB, and the GPU machine has them, in its toolkit
# and its Python's nvidia-* packages; gpu_check.sh finds them there).
for binary in "${binaries[@]}"; do
  ldd "$binary" | awk '/=> \//{print $3}'
done | sort -u | while read -r library; do
  case "$(basename "$library")" in
    libcuda.so*|libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
    libcudart.so*|libcublas.so*|libcublasLt.so*|libnccl.so*|libnvrtc*|libnvJitLink*) ;;
    *) cp -L "$library" gpu_bundle/lib/ ;;
  esac
done
# No debug information: a device call carries 64 MiB in all, the working tree included.
strip --strip-unneeded gpu_bundle/bin/* gpu_bundle/lib/* 2>/dev/null || true
git rev-parse HEAD > gpu_bundle/COMMIT 2>/dev/null || true
echo "sm_$arch" > gpu_bundle/ARCH
size=$(du -sm gpu_bundle | cut -f1)
echo "gpu_bundle/: ${size} MB (a device call carries at most 64 MiB with the rest of the tree)"
du -sh gpu_bundle
