#!/usr/bin/env bash
# Installs the built library into a scratch prefix, then configures, builds and runs (on 2
# ranks over Gloo) a CMake project that finds it with find_package(gradsync CONFIG), exactly as a
# user's CMake engine would.
#   run_cmake_consumer_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
source=$2
source "$(dirname "${BASH_SOURCE[0]}")/install_scratch.sh" "$1"
config=$(find "$root" -name gradsyncConfig.cmake | head -n 1)
[[ -n $config ]] || { echo "gradsyncConfig.cmake not installed"; exit 1; }
echo "found $config"

cmake -S "$source/tests/consumer/cmake" -B "$scratch/build" -DCMAKE_PREFIX_PATH="$root" -DCMAKE_BUILD_TYPE=Release
cmake --build "$scratch/build" --parallel 2
GRADSYNC_TIMEOUT_MS=30000 "$source/scripts/launch.sh" 2 "$scratch/build/cmake_consumer"
