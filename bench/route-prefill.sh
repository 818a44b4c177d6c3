#!/usr/bin/env bash
# What a second machine buys for one long prompt, on one machine: a 2-shard route whose shards
# are each pinned to their own core (`taskset`, one kernel thread each) against one process
# pinned to one core, both prefilling the same prompt over HTTP (`strata bench --url`, the
# prefix cache off so every request computes its whole prompt), through two trackers on the
# same two shards: one plain (`--no-pipeline-prefill`), where each chunk of the prompt waits for
# the last one's reply, and one with `--pipeline-prefill` (the default), where chunk k + 1 computes on shard 1 while chunk k computes on
# shard 2 (issue 30).
#
# Usage: [MODEL=name-or-path] [STRATA=path] [GEN=tokens] bench/route-prefill.sh [prompt-tokens] [requests]
# (MODEL default qwen2.5-coder-1.5b; prompt-tokens default 4096; requests per server and round,
# default 3; the servers take their requests in turn, so a slow phase of the machine hits both)
# With GEN=N (say `GEN=128 bench/route-prefill.sh 32 5`) each request also generates N tokens
# (the end token ignored) and the script compares single-stream decode instead: one process
# pinned to one core against the route (issue 32's "two shards pinned each to its own core").
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-4096}
reqs=${2:-3}
gen=${GEN:-1}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
if [ -f "$MODEL" ]; then model=$MODEL; else model=$(scripts/fetch-model.sh "$MODEL"); fi
[ "$(nproc)" -ge 2 ] || { echo "needs at least 2 cores" >&2; exit 1; }
if [ -z "${STRATA:-}" ]; then
  cargo build --release --quiet -p strata
  STRATA=target/release/strata
fi
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$out"' EXIT

source bench/lib.sh

n_layer=$("$STRATA" model info --model "$model" --json | python3 -c "import json,sys; print(json.load(sys.stdin)[\"n_layers\"])")
half=$(( n_layer / 2 ))
head -c 32 /dev/urandom | base64 > "$out/token"
ctx=$(( n + 1024 ))

taskset -c 0 "$STRATA" serve --speculative off --model "$model" --shards 1 --threads 1 --ctx "$ctx" --no-prefix-cache \
  --listen 127.0.0.1:18291 >"$out/one.log" 2>&1 &
taskset -c 0 "$STRATA" shard --model "$model" --layers "0..$half" --threads 1 --ctx "$ctx" --no-prefix-cache \
  --cluster-token-file "$out/token" --listen 127.0.0.1:18293 >"$out/s1.log" 2>&1 &
taskset -c 1 "$STRATA" shard --model "$model" --layers "$half..$n_layer" --threads 1 --ctx "$ctx" --no-prefix-cache \
  --cluster-token-file "$out/token" --listen 127.0.0.1:18294 >"$out/s2.log" 2>&1 &
"$STRATA" tracker --speculative off --shards 127.0.0.1:18293,127.0.0.1:18294 --cluster-token-file "$out/token" \
  --no-pipeline-prefill --listen 127.0.0.1:18292 >"$out/tracker.log" 2>&1 &
"$STRATA" tracker --speculative off --shards 127.0.0.1:18293,127.0.0.1:18294 --cluster-token-file "$out/token" \
  --pipeline-prefill --listen 127.0.0.1:18295 >"$out/tracker-pipelined.log" 2>&1 &
wait_http 18291; wait_http 18292; wait_http 18295

for i in $(seq 1 "$reqs"); do
  for s in one:18291 route:18292 pipelined:18295; do
    IFS=: read -r name port <<< "$s"
    "$STRATA" bench --url "http://127.0.0.1:$port" --prompt-tokens "$n" --gen-tokens "$gen" --requests 1 --json \
      > "$out/$name-$i.json" 2>/dev/null
  done
done

python3 - "$out" "$reqs" "$n" "$(basename "$model")" "$gen" <<'PY'
import json, statistics, sys
out, reqs, n, model, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
key, what = ("decode_tps_per_stream_p50", "decode") if gen > 1 else ("prefill_tps_p50", "prefill")
rate = lambda name, i: json.load(open(f"{out}/{name}-{i}.json"))["runs"][0][key]
one = [rate("one", i) for i in range(1, reqs + 1)]
route = [rate("route", i) for i in range(1, reqs + 1)]
piped = [rate("pipelined", i) for i in range(1, reqs + 1)]
med = statistics.median
print(f"model: {model}; a {n}-token prompt, {gen} generated, {reqs} requests each, taken in turn; {what} tokens/s")
print(f"one process pinned to one core: {med(one):.1f} t/s ({', '.join(f'{x:.1f}' for x in one)})")
print(f"2-shard route, one core each:   {med(route):.1f} t/s ({', '.join(f'{x:.1f}' for x in route)})")
print(f"same route, --pipeline-prefill: {med(piped):.1f} t/s ({', '.join(f'{x:.1f}' for x in piped)})")
print(f"route / one process: {med(route) / med(one):.2f}x; pipelined / one process: {med(piped) / med(one):.2f}x; pipelined / route: {med(piped) / med(route):.2f}x")
PY
