#!/usr/bin/env bash
# Installs the built library into a scratch prefix, then compiles and runs a small program
# against it using only what pkg-config says, exactly as a user outside the project would.
set -euo pipefail
source=$2
source "$(dirname "${BASH_SOURCE[0]}")/install_scratch.sh" "$1"
pc_dir=$(dirname "$(find "$root" -name gradsync.pc | head -n 1)")
[ -f "$root/include/gradsync/registry/parameter_registry.h" ] || { echo "headers not installed"; exit 1; }
[ -f "$root/include/gradsync/config.h" ] || { echo "config.h not installed"; exit 1; }

export PKG_CONFIG_PATH="$pc_dir"
flags=$(pkg-config --define-variable=prefix="$root" --cflags --libs gradsync)
libdir=$(pkg-config --define-variable=prefix="$root" --variable=libdir gradsync)
echo "pkg-config gradsync: $flags"
${CXX:-c++} -std=c++20 "$source" -o "$scratch/consumer" $flags -Wl,-rpath,"$libdir"
"$scratch/consumer" "$scratch"
