#!/usr/bin/env bash
# Prepares a character-level corpus for examples/gpt_ddp from a public-domain text: the King
# James Bible (1611; public domain), as Debian packages it (bible-kjv-text, decoded by the
# package's own `bible` program). Both packages are fetched with `apt-get download` (no
# installation, no root) into the output folder, the text is dumped one verse per line without
# chapter headings or verse numbers, and encoded as nanoGPT's shakespeare_char prepare.py does:
# the vocabulary is the sorted set of characters, token i is the i-th of them; the first 90% of
# the text is train.bin, the rest val.bin (uint16 token ids), vocab.txt holds the characters in
# token order (gpt_ddp --vocab), meta.json the sizes.
#
#   scripts/prepare_char_corpus.sh [OUT]       OUT defaults to runs/kjv_char
#
# Then, e.g.:  scripts/launch.sh 2 build/examples/gpt_ddp --data runs/kjv_char/train.bin \
#                --val runs/kjv_char/val.bin --vocab runs/kjv_char/vocab.txt --vocab-size $(V)
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-runs/kjv_char}
mkdir -p "$out/packages"

if ! ls "$out"/packages/bible-kjv_*.deb >/dev/null 2>&1 || ! ls "$out"/packages/bible-kjv-text_*.deb >/dev/null 2>&1; then
  (cd "$out/packages" && apt-get download bible-kjv bible-kjv-text) || {
    echo "prepare_char_corpus: apt-get download bible-kjv bible-kjv-text failed (run 'apt-get update' once?)" >&2
    exit 1
  }
fi
unpacked="$out/packages/unpacked"
rm -rf "$unpacked"
for package in "$out"/packages/*.deb; do dpkg-deb -x "$package" "$unpacked"; done

# "  12 And God said, ..." -> "And God said, ..."; the book and chapter headings go.
"$unpacked/usr/bin/bible" -p "$unpacked/usr/lib" -l1000000 Gen1:1-Rev22:21 |
  sed -n 's/^ *[0-9][0-9]* //p' > "$out/input.txt"

python3 - "$out" <<'PY'
import json, sys
from array import array
out = sys.argv[1]
text = open(f"{out}/input.txt", encoding="utf-8").read()
chars = sorted(set(text))
assert all(ord(c) < 256 for c in chars), "the vocabulary file stores one byte per token"
index = {c: i for i, c in enumerate(chars)}
tokens = array("H", (index[c] for c in text))
split = int(len(tokens) * 0.9)
with open(f"{out}/train.bin", "wb") as f:
    tokens[:split].tofile(f)
with open(f"{out}/val.bin", "wb") as f:
    tokens[split:].tofile(f)
with open(f"{out}/vocab.txt", "wb") as f:
    f.write(bytes(ord(c) for c in chars))
meta = {"source": "King James Bible (public domain), Debian bible-kjv-text", "vocab_size": len(chars),
        "characters": len(text), "train_tokens": split, "val_tokens": len(tokens) - split}
json.dump(meta, open(f"{out}/meta.json", "w"), indent=1)
print(f"prepare_char_corpus: {len(text)} characters, vocabulary {len(chars)}; "
      f"{split} train and {len(tokens) - split} validation tokens in {out}/")
PY
