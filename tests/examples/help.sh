#!/usr/bin/env bash
# Every program and script answers --help (exit 0, some text) and names an unknown flag in its
# error (non-zero exit) instead of running; the trainers refuse counts that make no sense and name
# the flag an unknown one was likely meant to be:
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
# Counts that make no sense are refused naming the flag (they trained nothing and exited 0), and an
# unknown flag near a known one is named with it.
refuses() {  # refuses PROGRAM TEXT ARGS...
  local program=$1 text=$2 out
  shift 2
  if out=$("$program" "$@" 2>&1) || ! grep -q -- "$text" <<<"$out"; then
    echo "FAIL $(basename "$program") $*: expected an error with '$text', got: $out"; status=1
  fi
}
for program in "$@"; do
  case $(basename "$program") in
    digits_ddp)
      refuses "$program" "flag --epochs counts something: at least 1, got -3" --epochs -3
      refuses "$program" "flag --batch counts something: at least 1, got 0" --batch 0
      refuses "$program" "--epoch (did you mean --epochs?)" --epoch 3 ;;
    gpt_ddp)
      refuses "$program" "flag --steps counts something: at least 1, got -5" --steps -5
      refuses "$program" "--step (did you mean --steps?)" --step 5 ;;
  esac
done
for script in "$source"/scripts/{docs,gpu_check,launch,make_gpu_bundle,plot_metrics,run,sanitize,setup,test}.sh \
              "$source"/benchmarks/compare_{collectives,ddp,zero}.sh; do
  check "$(basename "$script")" bash "$script"
done
((status == 0)) && echo "every program and script answers --help"
exit $status
