#!/usr/bin/env bash
# Every program and script answers --help (exit 0, some text) and names an unknown flag in its
# error (non-zero exit) instead of running:
#   help.sh SOURCE_DIR PROGRAM...
set -uo pipefail
source=$1
shift
status=0
check() {
  local name=$1
  shift
  local out
  if ! out=$("$@" --help 2>&1) || [[ -z $out ]]; then
    echo "FAIL $name: --help did not exit 0 with a usage text"; status=1
  fi
}
for program in "$@"; do
  check "$(basename "$program")" "$program"
  out=$("$program" --no-such-flag 2>&1) && { echo "FAIL $(basename "$program"): an unknown flag ran"; status=1; }
  grep -q -- "--no-such-flag" <<<"$out" || { echo "FAIL $(basename "$program"): the error does not name the flag: $out"; status=1; }
done
for script in "$source"/scripts/{docs,gpu_check,launch,make_gpu_bundle,plot_metrics,run,sanitize,setup,test}.sh \
              "$source"/benchmarks/compare_{collectives,ddp,zero}.sh; do
  check "$(basename "$script")" bash "$script"
done
((status == 0)) && echo "every program and script answers --help"
exit $status
