#!/usr/bin/env bash
# Installs the built library into a scratch prefix, then compiles and runs a small program
# against it using only what pkg-config says, exactly as a user outside the project would.
set -euo pipefail
build_dir=$1
source=$2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

meson install -C "$build_dir" --destdir "$scratch/root" --quiet >/dev/null
prefix=$(meson introspect "$build_dir" --buildoptions | python3 -c \
  'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"]=="prefix"))')
root="$scratch/root$prefix"
pc_dir=$(dirname "$(find "$root" -name gradsync.pc | head -n 1)")
[ -f "$root/include/gradsync/registry/parameter_registry.h" ] || { echo "headers not installed"; exit 1; }
[ -f "$root/include/gradsync/config.h" ] || { echo "config.h not installed"; exit 1; }

export PKG_CONFIG_PATH="$pc_dir"
flags=$(pkg-config --define-variable=prefix="$root" --cflags --libs gradsync)
libdir=$(pkg-config --define-variable=prefix="$root" --variable=libdir gradsync)
echo "pkg-config gradsync: $flags"
${CXX:-c++} -std=c++20 "$source" -o "$scratch/consumer" $flags -Wl,-rpath,"$libdir"
"$scratch/consumer" "$scratch"
