#!/usr/bin/env bash
# strata against llama.cpp on the same model, threads and machine, in the same run.
#
# Usage: LLAMA_CPP_DIR=/path/to/llama.cpp/build [MODEL=name-or-path] bench/compare-llamacpp.sh [threads] [repetitions]
# (MODEL: a GGUF path or a name `scripts/fetch-model.sh --list` knows, default smollm2-135m;
# STREAM_REQUESTS, default 10: single-stream requests per server and round; LONG_PROMPTS, e.g.
# 4096,16384, default none: long-context prefill rows, one run of each per side and round;
# ROUTES=0 skips the 2-shard rows (single-stream routes and ggml-rpc), for a comparison of
# kernels alone; STRATA_ISA, e.g. avx2, forces strata's kernel family (its bench and servers;
# not the HTTP client), to set it against a llama.cpp built for that instruction set only)
#
# LLAMA_CPP_DIR is a llama.cpp build (its bin/ holds llama-bench and llama-server); this script
# neither builds nor downloads it. Each round runs llama.cpp then strata back to back; the
# table prints the median over the rounds and the ratio strata / llama.cpp:
#   - pp128, pp512, tg64: llama-bench against `strata bench --model` (one process);
#   - with LONG_PROMPTS, ppN for each N (long prompts: attention takes over from the weights);
#   - aggregate decode at concurrency 1, 4, 8 and 16 (32-token prompts, 64 new tokens):
#     llama-server with 8 slots against `strata serve --shards 1`, both driven by
#     `strata bench --url` over HTTP;
#   - single-stream decode of a 2-shard route (`strata serve --shards 2`) against one process
#     (`strata serve --shards 1`), with every shard given all the threads (a single stream
#     visits the shards in turn, so both can use every core) and with the threads split between
#     the shards: the three servers run together (an idle one sleeps) and take single requests
#     in turn, so each request of a route is compared with the one-process request just before
#     it and a phase of the machine that slows one of them does not skew the ratio;
#   - a 2-shard route against llama.cpp split over two local `ggml-rpc-server` processes
#     (llama-bench --rpc, every layer offloaded to them): pp512 and tg64 against the route's
#     prefill rate and single-stream decode for a 512-token prompt (`strata bench --url`, the
#     prefix cache off: every request computes its whole prompt, as llama-bench does);
#     skipped when the build has no ggml-rpc-server;
#   - peak resident memory of a server with a 4096-token context after one request.
# The table's first row names each side's instruction set (llama.cpp's from its build options,
# strata's kernel family from `strata bench`).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_CPP_DIR:?set LLAMA_CPP_DIR to a llama.cpp build directory (with bin/llama-bench)}"
threads=${1:-2}
reps=${2:-3}
lbench="$LLAMA_CPP_DIR/bin/llama-bench"
lserver="$LLAMA_CPP_DIR/bin/llama-server"
[ -x "$lbench" ] && [ -x "$lserver" ] || { echo "no llama-bench / llama-server in $LLAMA_CPP_DIR/bin" >&2; exit 1; }
MODEL=${MODEL:-smollm2-135m}
if [ -f "$MODEL" ]; then model=$MODEL; else model=$(scripts/fetch-model.sh "$MODEL"); fi
lrpc="$LLAMA_CPP_DIR/bin/ggml-rpc-server"
cargo build --release --quiet -p strata
strata=target/release/strata
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT

source bench/lib.sh

peak_rss_mib() { # $1 = pid
  awk '/VmHWM/ {printf "%.1f", $2 / 1024}' "/proc/$1/status"
}

# The instruction sets each side runs: llama.cpp's from its build options (a native build runs
# what this CPU has), strata's from its own bench output (`isa`).
cpu_isa=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -xE 'avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|avx_vnni' | paste -sd' ' -)
cache="$LLAMA_CPP_DIR/CMakeCache.txt"
if [ -f "$cache" ] && grep -q '^GGML_NATIVE:BOOL=ON' "$cache"; then
  llama_isa="native build: $cpu_isa"
elif [ -f "$cache" ]; then
  llama_isa=$(grep -E '^GGML_(AVX|AVX2|AVX512|AVX512_VNNI|AVX512_BF16|AVX_VNNI|FMA|F16C):BOOL=ON' "$cache" | cut -d: -f1 | sed 's/^GGML_//' | paste -sd' ' -)
  llama_isa="built for: ${llama_isa:-no x86 SIMD options}"
else
  llama_isa="unknown (no CMakeCache.txt in LLAMA_CPP_DIR)"
fi
echo "$llama_isa" > "$out/llama-isa"

conc=1,4,8,16
stream_requests=${STREAM_REQUESTS:-10}
for r in $(seq 1 "$reps"); do
  echo "round $r of $reps" >&2
  "$lbench" -m "$model" -t "$threads" -p 128,512 -n 64 -r 3 -o json > "$out/llama-bench-$r.json" 2>/dev/null
  "$strata" bench --model "$model" --threads "$threads" --prompt-tokens 128,512 --gen-tokens 64 --repetitions 3 --json > "$out/strata-bench-$r.json"
  if [ -n "${LONG_PROMPTS:-}" ]; then
    "$lbench" -m "$model" -t "$threads" -p "$LONG_PROMPTS" -n 0 -r 1 -o json > "$out/llama-long-$r.json" 2>/dev/null
    "$strata" bench --model "$model" --threads "$threads" --prompt-tokens "$LONG_PROMPTS" --gen-tokens 0 --repetitions 1 --json > "$out/strata-long-$r.json"
  fi

  "$lserver" -m "$model" -t "$threads" -c 8192 -np 8 --port 18190 --metrics >/dev/null 2>&1 &
  pid=$!; wait_http 18190
  env -u STRATA_ISA "$strata" bench --url http://127.0.0.1:18190 --prompt-tokens 32 --gen-tokens 64 --concurrency "$conc" --requests 2 --json > "$out/llama-server-$r.json"
  kill $pid; wait $pid 2>/dev/null || true

  "$strata" serve --speculative off --model "$model" --shards 1 --threads "$threads" --listen 127.0.0.1:18191 >/dev/null 2>&1 &
  pid=$!; wait_http 18191
  env -u STRATA_ISA "$strata" bench --url http://127.0.0.1:18191 --prompt-tokens 32 --gen-tokens 64 --concurrency "$conc" --requests 2 --json > "$out/strata-serve-$r.json"
  kill $pid; wait $pid 2>/dev/null || true

  [ "${ROUTES:-1}" = 0 ] && continue
  per=$(( threads / 2 )); [ "$per" -ge 1 ] || per=1
  pids=()
  for variant in "one:1:$threads:18195" "all:2:$threads:18196" "split:2:$per:18197"; do
    IFS=: read -r name shards t port <<< "$variant"
    "$strata" serve --speculative off --model "$model" --shards "$shards" --threads "$t" --listen "127.0.0.1:$port" >/dev/null 2>&1 &
    pids+=($!)
  done
  for port in 18195 18196 18197; do wait_http $port; done
  for i in $(seq 1 "$stream_requests"); do
    for variant in one:18195 all:18196 split:18197; do
      IFS=: read -r name port <<< "$variant"
      env -u STRATA_ISA "$strata" bench --url "http://127.0.0.1:$port" --prompt-tokens 32 --gen-tokens 64 --concurrency 1 --requests 1 --json > "$out/strata-stream-$name-$r-$i.json"
    done
  done
  kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null || true

  if [ -x "$lrpc" ]; then
    "$lrpc" -H 127.0.0.1 -p 18198 -t "$threads" >/dev/null 2>&1 & r1=$!
    "$lrpc" -H 127.0.0.1 -p 18199 -t "$threads" >/dev/null 2>&1 & r2=$!
    sleep 1
    "$lbench" -m "$model" -t "$threads" --rpc 127.0.0.1:18198,127.0.0.1:18199 -ngl 99 -p 512 -n 64 -r 3 -o json > "$out/llama-rpc-$r.json" 2>/dev/null
    kill $r1 $r2; wait $r1 $r2 2>/dev/null || true
    "$strata" serve --speculative off --model "$model" --shards 2 --threads "$threads" --no-prefix-cache --listen 127.0.0.1:18192 >/dev/null 2>&1 &
    pid=$!; wait_http 18192
    env -u STRATA_ISA "$strata" bench --url http://127.0.0.1:18192 --prompt-tokens 512 --gen-tokens 64 --concurrency 1 --requests 3 --json > "$out/strata-route-$r.json"
    kill $pid; wait $pid 2>/dev/null || true
  fi
done

# Peak RSS with a 4096-token context, after one 512-token prompt and 64 new tokens.
prompt=$(python3 -c "print('The quick brown fox jumps over the lazy dog. ' * 50)")
ask() { # $1 = port
  curl -sf "http://127.0.0.1:$1/v1/completions" -H 'content-type: application/json' \
    -d "$(python3 -c 'import json,sys; print(json.dumps({"prompt": sys.argv[1], "max_tokens": 64, "temperature": 0}))' "$prompt")" >/dev/null
}
"$lserver" -m "$model" -t "$threads" -c 4096 -np 1 --port 18193 >/dev/null 2>&1 &
pid=$!; wait_http 18193; ask 18193; echo "$(peak_rss_mib $pid)" > "$out/llama-rss"; kill $pid; wait $pid 2>/dev/null || true
"$strata" serve --speculative off --model "$model" --shards 1 --threads "$threads" --ctx 4096 --listen 127.0.0.1:18194 >/dev/null 2>&1 &
pid=$!; wait_http 18194; ask 18194; echo "$(peak_rss_mib $pid)" > "$out/strata-rss"; kill $pid; wait $pid 2>/dev/null || true

python3 - "$out" "$reps" "$conc" "$stream_requests" "$model" "${LONG_PROMPTS:-}" <<'PY'
import json, statistics, sys
out, reps, conc, n_stream = sys.argv[1], int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",")], int(sys.argv[4])
long_prompts = [int(n) for n in sys.argv[6].split(",") if n]
load = lambda name, r: json.load(open(f"{out}/{name}-{r}.json"))
rounds = range(1, reps + 1)
def llama_test(r, name):
    for t in load("llama-bench", r):
        n_p, n_g = t["n_prompt"], t["n_gen"]
        if (name.startswith("pp") and n_g == 0 and f"pp{n_p}" == name) or (name.startswith("tg") and n_p == 0 and f"tg{n_g}" == name):
            return t["avg_ts"]
def strata_test(r, name):
    return next(t["avg_ts"] for t in load("strata-bench", r)["tests"] if t["test"] == name)
def agg(name, r, c):
    return next(x["aggregate_tps"] for x in load(name, r)["runs"] if x["concurrency"] == c)
def per_stream(name, r, i):
    return load(f"strata-stream-{name}-{r}", i)["runs"][0]["decode_tps_per_stream_p50"]
med = statistics.median
rows = []
for name in ["pp128", "pp512", "tg64"]:
    l = med(llama_test(r, name) for r in rounds)
    s = med(strata_test(r, name) for r in rounds)
    rows.append((f"{name} (llama-bench vs strata bench)", l, s))
for n in long_prompts:
    l = med(next(t["avg_ts"] for t in load("llama-long", r) if t["n_prompt"] == n) for r in rounds)
    s = med(next(t["avg_ts"] for t in load("strata-long", r)["tests"] if t["test"] == f"pp{n}") for r in rounds)
    rows.append((f"pp{n} (llama-bench vs strata bench, one run each per round)", l, s))
for c in conc:
    l = med(agg("llama-server", r, c) for r in rounds)
    s = med(agg("strata-serve", r, c) for r in rounds)
    rows.append((f"aggregate decode t/s, {c} concurrent (llama-server 8 slots vs strata serve)", l, s))
import os
if not os.path.exists(f"{out}/strata-stream-one-1-1.json"):
    print("(ROUTES=0: the 2-shard rows are skipped)")
elif os.path.exists(f"{out}/llama-rpc-1.json"):
    route = lambda r, key: load("strata-route", r)["runs"][0][key]
    for name, key in [("pp512", "prefill_tps_p50"), ("tg64", "decode_tps_per_stream_p50")]:
        l = med(next(t["avg_ts"] for t in load("llama-rpc", r) if f"{'pp' if t['n_gen'] == 0 else 'tg'}{t['n_prompt'] or t['n_gen']}" == name) for r in rounds)
        s = med(route(r, key) for r in rounds)
        rows.append((f"{name}, two local ggml-rpc-servers vs a 2-shard route (512-token prompt)", l, s))
else:
    print("(no ggml-rpc-server in LLAMA_CPP_DIR: the RPC rows are skipped)")
print(f"model: {os.path.basename(sys.argv[5])}")
print(f"| test | llama.cpp | strata | strata / llama.cpp |")
print(f"| --- | ---: | ---: | ---: |")
llama_isa = open(f"{out}/llama-isa").read().strip()
strata_isa = ", ".join(sorted({load("strata-bench", r)["isa"] for r in rounds}))
print(f"| instruction set | {llama_isa} | {strata_isa} kernels | |")
for name, l, s in rows:
    print(f"| {name} | {l:.1f} | {s:.1f} | {s / l:.2f} |")
# Single-stream decode: every request of a route against the one-process request just before it.
routes = os.path.exists(f"{out}/strata-stream-one-1-1.json")
if routes:
    stream = lambda name: [[per_stream(name, r, i) for i in range(1, n_stream + 1)] for r in rounds]
    one, full, split = stream("one"), stream("all"), stream("split")
    flat = lambda xs: [x for rnd in xs for x in rnd]
    pairs = lambda xs: [x / o for rx, ro in zip(xs, one) for x, o in zip(rx, ro)]
    def spread(rs):
        q = statistics.quantiles(rs, n=4)
        return f"{med(rs):.2f} (quartiles {q[0]:.2f}-{q[2]:.2f})"
    print(f"\nsingle-stream decode, {reps} x {n_stream} requests each taken in turn (per-request medians): one process {med(flat(one)):.1f} t/s; 2-shard route, every shard all threads {med(flat(full)):.1f} t/s, threads split {med(flat(split)):.1f} t/s")
    print(f"2-shard route / one process, median of the {reps * n_stream} request pairs: every shard all threads {spread(pairs(full))}, threads split {spread(pairs(split))}")
    print(f"  per round (median of its pairs), every shard all threads: {', '.join(f'{med([x / o for x, o in zip(rx, ro)]):.2f}' for rx, ro in zip(full, one))}")
c1 = med(agg("strata-serve", r, conc[0]) for r in rounds)
cn = med(agg("strata-serve", r, conc[-1]) for r in rounds)
print(f"strata serve aggregate, {conc[-1]} concurrent / 1: {cn:.1f} / {c1:.1f} = {cn / c1:.2f}x")
lr, sr = float(open(f"{out}/llama-rss").read()), float(open(f"{out}/strata-rss").read())
print(f"peak RSS with a 4096-token context after one request: llama-server {lr:.1f} MiB, strata serve {sr:.1f} MiB, ratio {sr / lr:.2f}")
print(f"({reps} rounds, medians; each round runs llama.cpp then strata back to back)")
PY
