#!/usr/bin/env bash
# Installs what gradsync needs on Debian 12 (only what is missing), then configures and
# builds into ./build. Sourced or run by scripts/run.sh and scripts/test.sh; safe to rerun.
#
#   scripts/setup.sh                    packages + configure + build
#   scripts/setup.sh --with-reference   also PyTorch and the reference safetensors package,
#                                       needed only to regenerate fixtures and for the
#                                       optional interop test
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
case "${1:-}" in
  "" | --with-reference) ;;
  *) echo "setup.sh: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# clang and its runtime libraries: the fuzz target of the checks suite (libFuzzer). OpenBLAS: the
# GPT example's matrix products (through Eigen; the library itself does not use it). Doxygen:
# the API reference (scripts/docs.sh), which the checks suite builds.
packages=(meson ninja-build pkg-config cmake g++ libeigen3-dev nlohmann-json3-dev libgtest-dev
          libopenmpi-dev openmpi-bin libgloo-dev python3 clang libclang-rt-14-dev libopenblas-dev doxygen)
if [[ "${1:-}" == "--with-reference" ]]; then
  # matplotlib: scripts/plot_metrics.sh, which the documented GPT run's test runs as written.
  packages+=(python3-torch python3-numpy python3-pip python3-venv python3-matplotlib)
fi

source scripts/install_packages.sh
install_packages "${packages[@]}"
if [[ "${1:-}" == "--with-reference" ]]; then
  /usr/bin/python3 -c 'import safetensors' 2>/dev/null ||
    /usr/bin/python3 -m pip install -q --break-system-packages safetensors
fi

# The CUDA toolkit is optional; when it is installed in the standard place, use it.
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

if [[ ! -f build/build.ninja ]]; then
  echo "== configuring build/"
  meson setup build >/dev/null || { cat build/meson-logs/meson-log.txt | tail -40; exit 1; }
fi
echo "== building ($(nproc) cores)"
ninja -C build
