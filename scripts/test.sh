#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs every suite, then the same
# unit and multirank suites under ASan+UBSan and the communication tests under TSan
# (scripts/sanitize.sh; separate builds in build-asan/ and build-tsan/).
#   scripts/test.sh                 everything (what CI runs)
#   scripts/test.sh --suite unit    one suite of the main build (unit, multirank, gpu, consumer,
#                                   interop, examples), no sanitizers
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# With the reference library (Debian's PyTorch, PyPI's safetensors) the interop test reads our
# files with it; without network it cannot be installed, and that test skips and says why.
scripts/setup.sh --with-reference ||
  { echo "== the reference library could not be installed; the interop test will skip"; scripts/setup.sh; }
# The real torchrun and torch's own TCPStore for the torchrun test: a cached venv with torch from
# PyPI (scripts/torch_env.sh: about 2 GB, once); without it that test skips and says why.
scripts/torch_env.sh >/dev/null || echo "== PyTorch could not be installed from PyPI; the torchrun test will skip"
[[ -x /usr/local/cuda/bin/nvcc ]] && export PATH="/usr/local/cuda/bin:$PATH"
status=0
meson test -C build --print-errorlogs "$@" || status=$?
logs=(build/meson-logs/testlog.json)
if (($# == 0)); then
  echo "== sanitizers: ASan+UBSan (unit, multirank)"
  scripts/sanitize.sh asan || status=$?
  logs+=(build-asan/meson-logs/testlog.json)
  echo "== sanitizers: TSan (communication tests)"
  scripts/sanitize.sh tsan || status=$?
  logs+=(build-tsan/meson-logs/testlog.json)
fi
# One closing line a person (and CI) can read at a glance, over every run above.
python3 - "${logs[@]}" <<'PY'
import json, os, sys
counts = {"OK": 0, "FAIL": 0, "SKIP": 0, "TIMEOUT": 0, "ERROR": 0}
for path in sys.argv[1:]:
    if not os.path.exists(path):
        counts["ERROR"] += 1
        continue
    for line in open(path):
        result = json.loads(line).get("result")
        counts[result] = counts.get(result, 0) + 1
failed = counts["FAIL"] + counts["TIMEOUT"] + counts["ERROR"]
print(f"{counts['OK']} passed, {failed} failed, {counts['SKIP']} skipped")
PY
exit $status
