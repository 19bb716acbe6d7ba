#!/usr/bin/env bash
# Builds tests/fuzz/store_parser_fuzz.cpp with libFuzzer (clang, with ASan and UBSan) and fuzzes
# the store's request parser for a bounded time from seeds of valid requests. Skips (exit 77,
# meson's "skipped") when this machine has no clang with libFuzzer.
#   tests/fuzz/run_store_parser_fuzz.sh SOURCE_ROOT BUILD_DIR [SECONDS]
set -euo pipefail
root=$1
build=$2
seconds=${3:-20}
clang=$(command -v clang++ || true)
if [[ -z "$clang" ]]; then
  echo "skipped: no clang++ on this machine (scripts/setup.sh installs it)"
  exit 77
fi
mkdir -p "$build/fuzz/seeds"
binary=$build/fuzz/store_parser_fuzz
if ! "$clang" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -I"$root/src" \
    "$root/tests/fuzz/store_parser_fuzz.cpp" "$root/src/comm/store/protocol.cpp" -o "$binary" 2>"$build/fuzz/build.log"; then
  if grep -q "libclang_rt.fuzzer\|fsanitize=fuzzer" "$build/fuzz/build.log"; then
    echo "skipped: clang++ here has no libFuzzer runtime (libclang-rt-dev)"
    exit 77
  fi
  cat "$build/fuzz/build.log"
  exit 1
fi
# Seeds: a hello, a set, a get, a delete, as the clients send them.
printf 'H\x10\x00\x00\x00\x05\x00\x00\x00gradsync-store/2token' > "$build/fuzz/seeds/hello"
printf 'S\x06\x00\x00\x00\x03\x00\x00\x00rank/3abc' > "$build/fuzz/seeds/set"
printf 'G\x06\x00\x00\x00\x00\x00\x00\x00dup0/1' > "$build/fuzz/seeds/get"
printf 'D\x06\x00\x00\x00\x00\x00\x00\x00ft/q3/' > "$build/fuzz/seeds/delete"
mkdir -p "$build/fuzz/corpus"
exec "$binary" -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 "$build/fuzz/corpus" "$build/fuzz/seeds"
