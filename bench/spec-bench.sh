#!/usr/bin/env bash
# Speculative decoding, single stream, on the workload set (bench/spec-workload.json): strata
# with `--speculative ngram` and, when a draft model is given, with `--draft-model`, each against
# itself without (the same server, requests alternating with `"speculative": false`), and
# llama-server with its own n-gram speculation (`--spec-type ngram-simple`) and `--model-draft`,
# against llama-server without, on the same cores, in the same run. Greedy requests; every
# variant's texts are compared.
#
# Then, on the same strata server, STREAMS concurrent streams (each request sent STREAMS times at
# once, with and without speculation in turn): the aggregate rate, which speculation must not
# lower.
#
# Usage: LLAMA_CPP_DIR=$(../shared/tools/build-llamacpp.sh) [MODEL=name-or-path]
#        [DRAFT=name-or-path] [STRATA=path] [STREAMS=16] bench/spec-bench.sh [requests] [max-tokens]
# (MODEL default qwen2.5-coder-1.5b; DRAFT default qwen2.5-coder-0.5b, "none" to skip;
# STREAMS 0 skips the concurrent rows; requests per kind, default 4; max-tokens default 128)
set -euo pipefail
cd "$(dirname "$0")/.."
reqs=${1:-4}
max=${2:-128}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
DRAFT=${DRAFT:-qwen2.5-coder-0.5b}
: "${LLAMA_CPP_DIR:?set LLAMA_CPP_DIR to a llama.cpp build (../shared/tools/build-llamacpp.sh)}"
resolve() { if [ -f "$1" ]; then echo "$1"; else scripts/fetch-model.sh "$1"; fi; }
model=$(resolve "$MODEL")
draft=""
[ "$DRAFT" = none ] || draft=$(resolve "$DRAFT")
if [ -z "${STRATA:-}" ]; then
  cargo build --release --quiet -p strata
  STRATA=target/release/strata
fi
threads=$(nproc)
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$out"' EXIT

source bench/lib.sh
stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }
kinds="code_edit json chat"
run() { # $1 = label, $2 = url, rest = spec-bench.py flags
  local label=$1 url=$2; shift 2
  for k in $kinds; do
    python3 bench/spec-bench.py "$url" --kind "$k" --requests "$reqs" --max-tokens "$max" "$@" > "$out/$label-$k.json"
  done
}

echo "strata: $STRATA serve --speculative ngram ($threads threads)" >&2
"$STRATA" serve --model "$model" --shards 1 --threads "$threads" --speculative ngram --draft-max 8 \
  --listen 127.0.0.1:18311 >"$out/strata.log" 2>&1 &
pid=$!
wait_http 18311
run strata http://127.0.0.1:18311 --a '{"speculative": false}' --b '{}'
STREAMS=${STREAMS:-16}
if [ "$STREAMS" -gt 0 ]; then
  echo "strata: $STREAMS concurrent streams" >&2
  run "strata-x$STREAMS" http://127.0.0.1:18311 --a '{"speculative": false}' --b '{}' --concurrency "$STREAMS"
fi
stop $pid
if [ -n "$draft" ]; then
  echo "strata: $STRATA serve --draft-model $(basename "$draft")" >&2
  "$STRATA" serve --model "$model" --shards 1 --threads "$threads" --draft-model "$draft" \
    --draft-threads "$threads" --draft-max 8 --listen 127.0.0.1:18315 >"$out/strata-draft.log" 2>&1 &
  pid=$!
  wait_http 18315
  run strata-draft http://127.0.0.1:18315 --a '{"speculative": false}' --b '{}'
  stop $pid
fi

ls=$LLAMA_CPP_DIR/bin/llama-server
common=(-m "$model" -t "$threads" -c 8192 --host 127.0.0.1 -np 1)
echo "llama-server: plain, then --spec-type ngram-simple" >&2
"$ls" "${common[@]}" --port 18312 >"$out/ls-plain.log" 2>&1 &
pid=$!
wait_http 18312
run llama-plain http://127.0.0.1:18312
stop $pid
"$ls" "${common[@]}" --port 18313 --spec-type ngram-simple --spec-draft-n-max 8 >"$out/ls-ngram.log" 2>&1 &
pid=$!
wait_http 18313
run llama-ngram http://127.0.0.1:18313
stop $pid
if [ -n "$draft" ]; then
  echo "llama-server: --model-draft $(basename "$draft")" >&2
  "$ls" "${common[@]}" --port 18314 --model-draft "$draft" --spec-draft-n-max 8 >"$out/ls-draft.log" 2>&1 &
  pid=$!
  wait_http 18314
  run llama-draft http://127.0.0.1:18314
  stop $pid
fi

python3 - "$out" "$(basename "$model")" "$reqs" "$max" "$kinds" "$STREAMS" <<'PY'
import json, os, sys
out, model, reqs, mx, kinds, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5].split(), int(sys.argv[6])
def load(label, k):
    p = f"{out}/{label}-{k}.json"
    return json.load(open(p)) if os.path.exists(p) else None
print(f"model {model}; {reqs} requests per kind, {mx} tokens each, greedy, single stream; decode tokens/s (median of the requests)")
print("| kind | strata plain | strata ngram | ngram / plain | same text | llama-server plain | llama-server ngram | llama-server draft | strata ngram / llama-server ngram |")
print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
for k in kinds:
    s = load("strata", k)
    lp, ln, ld = load("llama-plain", k), load("llama-ngram", k), load("llama-draft", k)
    a, b = s["a"]["decode_tps_p50"], s["b"]["decode_tps_p50"]
    v = lambda r: r["a"]["decode_tps_p50"] if r else float("nan")
    print(f"| {k} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {s['same_text']} | {v(lp):.2f} | {v(ln):.2f} | {v(ld):.2f} | {b / v(ln):.2f}x |")
if any(load("strata-draft", k) for k in kinds):
    print("\nwith a draft model (strata --draft-model, llama-server --model-draft, the same file)")
    print("| kind | strata plain | strata draft | draft / plain | same text | llama-server plain | llama-server draft | llama-server draft / plain | strata draft / llama-server draft |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for k in kinds:
        s, lp, ld = load("strata-draft", k), load("llama-plain", k), load("llama-draft", k)
        if s:
            a, b = s["a"]["decode_tps_p50"], s["b"]["decode_tps_p50"]
            print(f"| {k} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {s['same_text']} | {v(lp):.2f} | {v(ld):.2f} | {v(ld) / v(lp):.2f}x | {b / v(ld):.2f}x |")
if n > 0:
    print(f"\nstrata, {n} concurrent streams: aggregate tokens/s (median of the requests)")
    print("| kind | plain | speculation | ratio | same text |")
    print("| --- | ---: | ---: | ---: | --- |")
    for k in kinds:
        s = load(f"strata-x{n}", k)
        if s:
            a, b = s["a"]["aggregate_tps_p50"], s["b"]["aggregate_tps_p50"]
            print(f"| {k} | {a:.1f} | {b:.1f} | {b / a:.3f}x | {s['same_text']} |")
PY
