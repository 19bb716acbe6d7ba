#!/usr/bin/env bash
# The GPT run of docs/examples.md, as written there: its command block is read from the page and
# run line by line in the source root, the only change being flags appended to gpt_ddp's line
# that make the model and the run small (a later flag wins), so that a wrong path, a folder
# nobody makes or a missing tool fails here and not for a reader. Skips (77), saying why, when
# Debian's archive cannot be reached for the corpus.
#   documented_gpt.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
cd "$source"
[[ $(readlink -f "$build") == $(readlink -f build) ]] || { echo "skipped: the page's commands name build/, this build is $build"; exit 77; }
# The block after "**A training run**", its continuation lines joined.
commands=$(awk '/^\*\*A training run\*\*/ {found = 1} found && /^```sh/ {inside = 1; next} inside && /^```/ {exit}
                inside {print}' docs/examples.md | sed -e ':a' -e '/\\$/N; s/\\\n//; ta')
[[ -n $commands ]] || { echo "docs/examples.md has no command block after **A training run**"; exit 1; }
small=(--layers 1 --heads 2 --embd 16 --block 32 --batch 2 --steps 4 --warmup 1 --sample 20)
trap 'rm -rf runs/doc gpt_kjv.png' EXIT
while IFS= read -r line; do
  [[ -z $line ]] && continue
  echo "\$ $line"
  if [[ $line == *gpt_ddp* ]]; then
    eval "$line ${small[*]}" | tee /tmp/documented_gpt.$$
  elif [[ $line == scripts/prepare_char_corpus.sh* ]]; then
    eval "$line" || { echo "skipped: the corpus could not be fetched from Debian's archive"; exit 77; }
  else
    eval "$line"
  fi
done <<< "$commands"
grep -q "^validation loss [0-9.]*$" /tmp/documented_gpt.$$
grep -q "^sample:$" /tmp/documented_gpt.$$
rm -f /tmp/documented_gpt.$$
[[ $(grep -c '"loss"' runs/doc/metrics.jsonl) == 4 ]]
[[ -s gpt_kjv.png ]]
echo "docs/examples.md's GPT run works as written (corpus, 2 ranks, metrics in runs/doc, the plot)"
