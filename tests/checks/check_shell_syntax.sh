#!/usr/bin/env bash
# Every shell script of the repository parses (bash -n): scripts/, benchmarks/, tests/, .ci/run.
# The scripts that run only elsewhere (gpu_check.sh on a device machine, simulate_nodes.sh as
# root) are otherwise never executed here, and a stray quote would first show on the machine
# that costs the most to reach. The check first proves itself on a planted unterminated quote.
#
#   tests/checks/check_shell_syntax.sh ROOT
set -uo pipefail
root=${1:?usage: check_shell_syntax.sh ROOT}
cd "$root" || exit 2

planted=$(mktemp)
trap 'rm -f "$planted"' EXIT
printf 'echo "fine"\nrun x --filter='"'"'*cuda*\necho done\n' > "$planted"
if bash -n "$planted" 2>/dev/null; then
  echo "check_shell_syntax: bash -n accepted a planted unterminated quote; the check proves nothing" >&2
  exit 1
fi

failed=0
checked=0
while IFS= read -r -d '' script; do
  checked=$((checked + 1))
  if ! message=$(bash -n "$script" 2>&1); then
    echo "FAIL $script: $message"
    failed=1
  fi
done < <(find scripts benchmarks tests examples .ci -type f \( -name '*.sh' -o -path '.ci/run' \) -print0 2>/dev/null)
echo "check_shell_syntax: $checked scripts parsed, $([[ $failed == 0 ]] && echo none failed || echo some failed)"
exit $failed
