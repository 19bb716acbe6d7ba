#!/usr/bin/env bash
# The API reference: Doxygen over the public headers (include/gradsync/, docs/api/Doxyfile) into
# build/docs/html/ (open build/docs/html/index.html). Installs Doxygen from Debian when missing.
# Every public class, function and member must be documented: any warning (an undocumented
# one, a broken doc command) is printed and the script exits 1 (the checks suite runs it).
#   scripts/docs.sh            build the reference
#   scripts/docs.sh OUT        build it into OUT instead of build/docs
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/install_packages.sh
install_packages doxygen
out=${1:-build/docs}
rm -rf "$out/html"
mkdir -p "$out"
export GRADSYNC_DOCS_OUT=$out
doxygen docs/api/Doxyfile
if [[ -s $out/warnings.txt ]]; then
  sed "s|^$PWD/||" "$out/warnings.txt"
  echo "docs.sh: $(wc -l < "$out/warnings.txt") warning(s): every public class, function and member needs its comment" >&2
  exit 1
fi
echo "docs.sh: the API reference is in $out/html/index.html (every public declaration documented)"
