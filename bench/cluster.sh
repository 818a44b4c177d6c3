#!/usr/bin/env bash
# Single-stream and concurrent decode of a 2-shard route against the same build in one process
# (`serve --shards 1`, the embedded route), measured in the same run, over the HTTP API.
# Usage: bench/cluster.sh [threads in all] [gen tokens] [concurrency list]
# Both configurations use the same cores: one process gets all threads, each of the two shards
# half of them (at least one).
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
gen=${2:-64}
conc=${3:-1}
model=$(scripts/fetch-model.sh)
cargo build --release --quiet -p strata
bin=target/release/strata

run() { # $1 = shards, $2 = port
  local per=$(( threads / $1 )); [ "$per" -ge 1 ] || per=1
  $bin serve --model "$model" --shards "$1" --threads "$per" --listen "127.0.0.1:$2" >/dev/null 2>/tmp/strata-bench-serve.log &
  local pid=$!
  for _ in $(seq 1 240); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$2/health', timeout=1)" 2>/dev/null && break
    sleep 0.5
  done
  echo "== serve --shards $1 (threads $per per shard)"
  $bin bench --url "http://127.0.0.1:$2" --gen-tokens "$gen" --prompt-tokens 32 --concurrency "$conc" --requests 3 --json > "/tmp/strata-bench-$1.json"
  $bin bench --url "http://127.0.0.1:$2" --gen-tokens "$gen" --prompt-tokens 32 --concurrency "$conc" --requests 3
  kill $pid; wait $pid 2>/dev/null || true
}

run 1 18181
run 2 18182
python3 - <<'PY'
import json
one = json.load(open("/tmp/strata-bench-1.json"))["runs"][0]
two = json.load(open("/tmp/strata-bench-2.json"))["runs"][0]
r = two["decode_tps_per_stream_p50"] / one["decode_tps_per_stream_p50"]
print(f"\nsingle-stream decode: one process {one['decode_tps_per_stream_p50']:.1f} t/s, 2-shard route {two['decode_tps_per_stream_p50']:.1f} t/s, ratio {r:.2f}")
print(f"ttft p50: one process {one['ttft_ms_p50']:.1f} ms, 2-shard route {two['ttft_ms_p50']:.1f} ms")
PY
