#!/usr/bin/env bash
# Single-stream decode of a 2-shard route whose every connection to a shard (tracker to shards,
# shard to shard, the tracker's replies stream) passes through bench/delay-proxy.py adding
# DELAY_MS to each message: a stand-in for shards on other hosts.
# Usage: bench/delayed-route.sh [delay ms] [threads per shard] [requests]
set -euo pipefail
cd "$(dirname "$0")/.."
delay=${1:-1}
threads=${2:-2}
requests=${3:-5}
model=$(scripts/fetch-model.sh)
cargo build --release --quiet -p strata
bin=target/release/strata
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
head -c 32 /dev/urandom | xxd -p -c 64 > "$dir/token"
$bin shard --model "$model" --layers 0..15 --listen 127.0.0.1:17301 --cluster-token-file "$dir/token" --threads "$threads" >/dev/null 2>&1 &
$bin shard --model "$model" --layers 15..30 --listen 127.0.0.1:17302 --cluster-token-file "$dir/token" --threads "$threads" >/dev/null 2>&1 &
python3 bench/delay-proxy.py 17401 17301 "$delay" &
python3 bench/delay-proxy.py 17402 17302 "$delay" &
sleep 3
$bin tracker --shards 127.0.0.1:17401,127.0.0.1:17402 --listen 127.0.0.1:17400 --cluster-token-file "$dir/token" >/dev/null 2>&1 &
for _ in $(seq 1 300); do curl -sf http://127.0.0.1:17400/health >/dev/null 2>&1 && break; sleep 0.2; done
$bin bench --url http://127.0.0.1:17400 --prompt-tokens 32 --gen-tokens 64 --concurrency 1 --requests "$requests"
curl -s http://127.0.0.1:17400/metrics | grep '^strata_shard_early_steps_total' || true
