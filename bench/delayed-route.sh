#!/usr/bin/env bash
# Single-stream decode of a 2-shard route whose every connection to a shard (tracker to shards,
# shard to shard, the tracker's replies stream) passes through bench/delay-proxy.py adding
# DELAY_MS to each message: a stand-in for shards on other hosts.
# Usage: [MODEL=name-or-path] [STRATA=path] [SPEC=1] [DRAFT=name-or-path] [KIND=code_edit]
#        bench/delayed-route.sh [delay ms] [threads per shard] [requests]
# With SPEC=1 the tracker speculates (`--speculative ngram`; with DRAFT, from that draft model in
# the tracker's process, `--draft-model`, on as many threads as a shard) and
# bench/spec-bench.py sends the workload set's requests of KIND (code_edit, json, chat or mixed),
# each with `"speculative": false` and without in turn (issue 31); without it the tracker decodes
# one token a step (`--speculative off`).
set -euo pipefail
cd "$(dirname "$0")/.."
delay=${1:-1}
threads=${2:-2}
requests=${3:-5}
if [ -f "${MODEL:-}" ]; then model=$MODEL; else model=$(scripts/fetch-model.sh ${MODEL:-}); fi
if [ -z "${STRATA:-}" ]; then
  cargo build --release --quiet -p strata
  STRATA=target/release/strata
fi
bin=$STRATA
n_layer=$("$bin" model info --model "$model" --json | python3 -c "import json,sys; print(json.load(sys.stdin)[\"n_layers\"])")
half=$(( n_layer / 2 ))
spec=(--speculative off)
if [ "${SPEC:-0}" = 1 ]; then
  spec=(--speculative ngram)
  if [ -n "${DRAFT:-}" ]; then
    if [ -f "$DRAFT" ]; then draft=$DRAFT; else draft=$(scripts/fetch-model.sh "$DRAFT"); fi
    spec=(--draft-model "$draft" --draft-threads "$threads")
  fi
fi
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
head -c 32 /dev/urandom | xxd -p -c 64 > "$dir/token"
$bin shard --model "$model" --layers "0..$half" --listen 127.0.0.1:17301 --cluster-token-file "$dir/token" --threads "$threads" >/dev/null 2>&1 &
$bin shard --model "$model" --layers "$half..$n_layer" --listen 127.0.0.1:17302 --cluster-token-file "$dir/token" --threads "$threads" >/dev/null 2>&1 &
python3 bench/delay-proxy.py 17401 17301 "$delay" &
python3 bench/delay-proxy.py 17402 17302 "$delay" &
sleep 3
$bin tracker --shards 127.0.0.1:17401,127.0.0.1:17402 --listen 127.0.0.1:17400 --cluster-token-file "$dir/token" "${spec[@]}" >/dev/null 2>&1 &
for _ in $(seq 1 600); do curl -sf http://127.0.0.1:17400/health >/dev/null 2>&1 && break; sleep 0.2; done
if [ "${SPEC:-0}" = 1 ]; then
  python3 bench/spec-bench.py http://127.0.0.1:17400 --kind "${KIND:-code_edit}" --requests "$requests" \
    --max-tokens 128 --a '{"speculative": false}' --b '{}'
else
  $bin bench --url http://127.0.0.1:17400 --prompt-tokens 32 --gen-tokens 64 --concurrency 1 --requests "$requests"
fi
curl -s http://127.0.0.1:17400/metrics | grep '^strata_shard_early_steps_total' || true
