#!/usr/bin/env bash
# Speculative decoding, single stream, on the workload set (bench/spec-workload.json): strata
# with `--speculative ngram` and, when a draft model is given, with `--draft-model` (in the
# tracker's process) and with `strata drafter` (a process of its own: shard, drafter and tracker
# processes, `--drafter`), each against itself without (the same server, requests alternating with `"speculative": false`), and
# llama-server with its own n-gram speculation (`--spec-type ngram-simple`) and `--model-draft`,
# against llama-server without, on the same cores, in the same run. Greedy requests; every
# variant's texts are compared.
#
# The draft tables end with the kinds together ("all": every decoded token over all the decoding
# time, the mixed workload's rate).
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
  echo "strata: shard, drafter --model $(basename "$draft") and tracker --drafter, 3 processes" >&2
  n_layers=$("$STRATA" model info --model "$model" --json | python3 -c "import json,sys; print(json.load(sys.stdin)['n_layers'])")
  head -c 32 /dev/urandom | xxd -p -c 64 > "$out/token"
  "$STRATA" shard --model "$model" --layers "0..$n_layers" --threads "$threads" --listen 127.0.0.1:18316 \
    --cluster-token-file "$out/token" >"$out/strata-shard.log" 2>&1 &
  shard_pid=$!
  "$STRATA" drafter --model "$draft" --threads "$threads" --listen 127.0.0.1:18317 \
    --cluster-token-file "$out/token" >"$out/strata-drafter.log" 2>&1 &
  drafter_pid=$!
  "$STRATA" tracker --shards 127.0.0.1:18316 --drafter 127.0.0.1:18317 --draft-max 8 \
    --startup-wait-ms 120000 --listen 127.0.0.1:18318 --cluster-token-file "$out/token" \
    >"$out/strata-tracker.log" 2>&1 &
  pid=$!
  wait_http 18318
  run strata-drafter http://127.0.0.1:18318 --a '{"speculative": false}' --b '{}'
  stop $pid; stop $drafter_pid; stop $shard_pid
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
def total(label, variant="a"):
    # Every kind's decoded tokens over all their decoding time: the mixed workload's rate.
    n = t = 0.0
    for k in kinds:
        r = load(label, k)
        if not r:
            return float("nan")
        for tokens, rate in zip(r[variant]["tokens"], r[variant]["decode_tps"]):
            if rate > 0:
                n += tokens - 1
                t += (tokens - 1) / rate
    return n / t if t else float("nan")
print(f"model {model}; {reqs} requests per kind, {mx} tokens each, greedy, single stream; decode tokens/s (median of the requests)")
print("| kind | strata plain | strata ngram | ngram / plain | same text | llama-server plain | llama-server ngram | llama-server draft | strata ngram / llama-server ngram |")
print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
for k in kinds:
    s = load("strata", k)
    lp, ln, ld = load("llama-plain", k), load("llama-ngram", k), load("llama-draft", k)
    a, b = s["a"]["decode_tps_p50"], s["b"]["decode_tps_p50"]
    v = lambda r: r["a"]["decode_tps_p50"] if r else float("nan")
    print(f"| {k} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {s['same_text']} | {v(lp):.2f} | {v(ln):.2f} | {v(ld):.2f} | {b / v(ln):.2f}x |")
for label, what in [("strata-draft", "--draft-model, in the tracker's process"), ("strata-drafter", "strata drafter, a process of its own")]:
    if not any(load(label, k) for k in kinds):
        continue
    print(f"\nwith a draft model (strata: {what}; llama-server --model-draft; the same file)")
    print("| kind | strata plain | strata draft | draft / plain | same text | llama-server plain | llama-server draft | llama-server draft / plain | strata draft / llama-server draft |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for k in kinds:
        s, lp, ld = load(label, k), load("llama-plain", k), load("llama-draft", k)
        if s:
            a, b = s["a"]["decode_tps_p50"], s["b"]["decode_tps_p50"]
            print(f"| {k} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {s['same_text']} | {v(lp):.2f} | {v(ld):.2f} | {v(ld) / v(lp):.2f}x | {b / v(ld):.2f}x |")
    a, b, lp, ld = total(label), total(label, "b"), total("llama-plain"), total("llama-draft")
    same = all(load(label, k)["same_text"] for k in kinds)
    print(f"| all | {a:.2f} | {b:.2f} | {b / a:.2f}x | {same} | {lp:.2f} | {ld:.2f} | {ld / lp:.2f}x | {b / ld:.2f}x |")
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
