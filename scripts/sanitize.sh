#!/usr/bin/env bash
# The sanitizer runs: the library and the tests built with AddressSanitizer + UndefinedBehavior-
# Sanitizer (build-asan/) or ThreadSanitizer (build-tsan/), then run.
#
#   scripts/sanitize.sh asan            unit + multirank suites under ASan+UBSan (what CI runs)
#   scripts/sanitize.sh tsan            the threaded tests under TSan (what CI runs: test_gloo, test_store,
#                                       test_failures, test_dist, test_parallel; about 6 minutes)
#   scripts/sanitize.sh tsan --all      every multirank test under TSan (longer; by hand)
#   scripts/sanitize.sh asan -- NAME..  just these meson tests
#
# Any report fails the run (halt_on_error / exitcode). Third-party code that is not built with
# the sanitizer is suppressed in tests/sanitizers/*.supp, each entry with its reason.
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
kind=${1:?usage: scripts/sanitize.sh asan|tsan [--all] [-- TEST...]}
shift
scripts/setup.sh >/dev/null  # the packages (and the main build, which the sanitizers do not need)

supp=$PWD/tests/sanitizers
case $kind in
  asan)
    dir=build-asan
    sanitize=address,undefined
    # LeakSanitizer: Open MPI and Gloo keep process-lifetime allocations (see lsan.supp).
    export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:abort_on_error=0:exitcode=23:strict_string_checks=1:detect_stack_use_after_return=1"
    export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0:fast_unwind_on_malloc=0"
    export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp"
    ;;
  tsan)
    dir=build-tsan
    sanitize=thread
    export TSAN_OPTIONS="halt_on_error=1:exitcode=66:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
    ;;
  *) echo "unknown sanitizer '$kind' (asan or tsan)"; exit 2 ;;
esac

if [[ ! -f $dir/build.ninja ]]; then
  echo "== configuring $dir ($sanitize)"
  # No CUDA (the sanitizers do not see into the GPU, and nvcc would double the build), no
  # benchmarks or examples: the library and its tests. b_lundef=false: the sanitizer runtimes
  # resolve at load time.
  meson setup "$dir" -Db_sanitize=$sanitize -Db_lundef=false -Dbuildtype=debugoptimized -Dcuda=disabled \
    -Dbenchmarks=false -Dexamples=false >/dev/null
fi
tests=()
all=false
while (($#)); do
  case $1 in
    --all) all=true ;;
    --) shift; tests=("$@"); break ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
# The threaded tests TSan runs by default (below).
tsan_tests=(gloo failures dist parallel join zero zero_model hsdp local_sgd diloco fault_tolerance staging devices store
            reproducible split hierarchical powersgd)
selected=("${tests[@]}")
[[ $kind == tsan && ${#tests[@]} -eq 0 ]] && ! $all && selected=("${tsan_tests[@]}")

# The programs the selected tests run, when each is a program of this build (a gtest binary):
# a run of a few tests builds those alone, not every test of the tree (the TSan run of
# scripts/test.sh uses 18 of them). Otherwise, or for whole suites, everything.
targets_of() {
  meson introspect "$dir" --tests | python3 -c '
import json, os, sys
build, names = os.path.realpath(sys.argv[1]), set(sys.argv[2:])
programs = set()
for test in json.load(sys.stdin):
    if test["name"] in names:
        program = os.path.realpath(test["cmd"][0])
        if not program.startswith(build + os.sep):
            sys.exit(0)  # a script: it may run anything, build it all
        programs.add(os.path.relpath(program, build))
print(" ".join(sorted(programs)))' "$dir" "$@"
}
targets=()
((${#selected[@]})) && read -r -a targets <<<"$(targets_of "${selected[@]}")"
echo "== building $dir ($(nproc) cores${targets:+, ${#targets[@]} test programs})"
ninja -C "$dir" "${targets[@]}" >"$dir/build.log" 2>&1 ||
  { tail -40 "$dir/build.log"; echo "== the $kind build failed"; exit 1; }

# Longer timeouts: the instrumented code runs 2-15x slower.
if ((${#tests[@]})); then
  meson test -C "$dir" --no-rebuild --print-errorlogs --timeout-multiplier 3 "${tests[@]}"
elif [[ $kind == asan ]]; then
  # Every unit and multirank test, less two sweeps' repeats (to keep scripts/test.sh inside CI's
  # time): ZeRO's 3-rank instances keep Adam (the uneven pieces every optimizer shares), and the
  # reproducible folds run on 2-4 ranks (5 adds one rank to the odd world 3 covers).
  # (Through GTEST_FILTER: the gtest programs read it, the suites' scripts do not.)
  GTEST_FILTER="-Cases/ZeroMatches.*/3_ranks_*_sgd_*:Cases/ZeroMatches.*/3_ranks_*_adamw_*:WorldsAndAlgorithms/Reproducible.*/5_ranks*" \
    meson test -C "$dir" --no-rebuild --print-errorlogs --timeout-multiplier 3 --suite unit --suite multirank
elif $all; then
  meson test -C "$dir" --no-rebuild --print-errorlogs --timeout-multiplier 4 --suite multirank
else
  # The big sweeps of test_gloo (world 8, worlds 3-4 with 1M elements) take minutes under TSan
  # and add no thread interleaving the world-2 sweep lacks: --all runs them. Of Join's and
  # ZeRO's sweeps, the 3-rank instances with Adam run here (every strategy and option); the
  # other worlds and optimizers add no interleaving.
  sweeps="Cases/UnevenDataParallel.*/2_ranks*:Cases/UnevenDataParallel.*/4_ranks*:Cases/UnevenDataParallel.*_sgd_*"
  sweeps+=":Cases/ZeroJoin.*/2_ranks*:Cases/ZeroJoin.*/4_ranks*"
  sweeps+=":Cases/ZeroMatches.*/2_ranks*:Cases/ZeroMatches.*/4_ranks*:Cases/ZeroMatches.*_sgd_*:Cases/ZeroMatches.*_adamw_*"
  sweeps+=":Cases/ZeroHorovod.*/2_ranks*:Cases/ZeroHorovod.*/4_ranks*"
  # Of the hierarchy's sweeps (up to 6 ranks, 1 Mi elements, every dtype; 20+ minutes under TSan),
  # the 2 x 2 case, the front ends and the settings check run here: the others repeat their
  # threads on more ranks or another mode.
  sweeps+=":Hierarchical.EveryLayoutReducesCorrectly:Hierarchical.FlatAddsInAnotherOrderSoTheCheckCanTell"
  sweeps+=":Hierarchical.AutomaticModeAboveItsThreshold"
  # The reproducible folds on 4 and 5 ranks (150 s under TSan) repeat the 2- and 3-rank ones'
  # worlds with more thread pairs; 2 and 3 ranks run here.
  sweeps+=":WorldsAndAlgorithms/Reproducible.*/4_ranks*:WorldsAndAlgorithms/Reproducible.*/5_ranks*"
  meson test -C "$dir" --no-rebuild --print-errorlogs --timeout-multiplier 4 "${tsan_tests[@]}" \
    --test-args="--gtest_filter=-GlooWorld8.*:WorldSizes/GlooWorld.EveryCollectiveEveryDType/2:WorldSizes/GlooWorld.EveryCollectiveEveryDType/3:WorldSizes/GlooWorld.EveryCollectiveEveryDType/4:$sweeps"
fi
