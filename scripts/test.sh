#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs every suite.
#   scripts/test.sh                 all suites
#   scripts/test.sh --suite unit    one suite (unit, gpu, consumer, interop, ...)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
[[ -x /usr/local/cuda/bin/nvcc ]] && export PATH="/usr/local/cuda/bin:$PATH"
status=0
meson test -C build --print-errorlogs "$@" || status=$?
# One closing line a person (and CI) can read at a glance.
python3 - build/meson-logs/testlog.json <<'PY'
import json, sys
counts = {"OK": 0, "FAIL": 0, "SKIP": 0, "TIMEOUT": 0, "ERROR": 0}
for line in open(sys.argv[1]):
    result = json.loads(line).get("result")
    counts[result] = counts.get(result, 0) + 1
failed = counts["FAIL"] + counts["TIMEOUT"] + counts["ERROR"]
print(f"{counts['OK']} passed, {failed} failed, {counts['SKIP']} skipped")
PY
exit $status
