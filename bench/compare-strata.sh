#!/usr/bin/env bash
# Two strata binaries against each other on the same model, threads and machine, in the same
# run: did a change make strata slower? (For instance an older commit's release binary against
# this tree's: `git worktree add /tmp/base OLD && cargo build --release --manifest-path
# /tmp/base/Cargo.toml --target-dir /tmp/base-target -p strata`.)
#
# Usage: [MODEL=name-or-path] [STRATA_ISA=avx2] bench/compare-strata.sh BASE NEW [threads] [rounds]
# (MODEL default qwen2.5-coder-1.5b; STRATA_ISA forces a kernel family on a side whose bench and
# serve read it, which binaries older than the flag do not: the table's `kernels` row says what
# each side ran.)
#
# Each round runs BASE then NEW back to back, and the table prints the median over the rounds
# and the ratio NEW / BASE:
#   - pp512 and tg64 of `strata bench --model` (one process, 3 repetitions each);
#   - aggregate decode at 16 concurrent sessions (32-token prompts, 64 new tokens, 2 requests
#     per client) of `strata serve --shards 1`, driven by NEW's `strata bench --url` for both
#     sides, so that only the server differs.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: bench/compare-strata.sh BASE NEW [threads] [rounds]}
new=${2:?usage: bench/compare-strata.sh BASE NEW [threads] [rounds]}
threads=${3:-2}
rounds=${4:-3}
for b in "$base" "$new"; do [ -x "$b" ] || { echo "$b is not an executable" >&2; exit 1; }; done
MODEL=${MODEL:-qwen2.5-coder-1.5b}
if [ -f "$MODEL" ]; then model=$MODEL; else model=$(scripts/fetch-model.sh "$MODEL"); fi
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT

source bench/lib.sh

for r in $(seq 1 "$rounds"); do
  echo "round $r of $rounds" >&2
  for side in base new; do
    bin=$base; [ "$side" = new ] && bin=$new
    "$bin" bench --model "$model" --threads "$threads" --prompt-tokens 512 --gen-tokens 64 --repetitions 3 --json > "$out/$side-bench-$r.json"
    # Plain decoding on both sides (a binary from before speculation has no such flag).
    plain=()
    "$bin" serve --help 2>/dev/null | grep -q -- '--speculative' && plain=(--speculative off)
    "$bin" serve "${plain[@]}" --model "$model" --shards 1 --threads "$threads" --listen 127.0.0.1:18291 >/dev/null 2>&1 &
    pid=$!; wait_http 18291
    env -u STRATA_ISA "$new" bench --url http://127.0.0.1:18291 --prompt-tokens 32 --gen-tokens 64 --concurrency 16 --requests 2 --json > "$out/$side-serve-$r.json"
    kill $pid; wait $pid 2>/dev/null || true
  done
done

python3 - "$out" "$rounds" "$model" "$base" "$new" <<'PY'
import json, os, statistics, sys
out, rounds, model, base, new = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
load = lambda name: json.load(open(f"{out}/{name}.json"))
def bench(side, r, test):
    return next(t["avg_ts"] for t in load(f"{side}-bench-{r}")["tests"] if t["test"] == test)
def serve(side, r):
    return load(f"{side}-serve-{r}")["runs"][0]["aggregate_tps"]
med = statistics.median
isa = lambda side: ", ".join(sorted({load(f"{side}-bench-{r}")["isa"] for r in range(1, rounds + 1)}))
print(f"model: {os.path.basename(model)}; base: {base}; new: {new}")
print("| test | base | new | new / base |")
print("| --- | ---: | ---: | ---: |")
print(f"| kernels | {isa('base')} | {isa('new')} | |")
rows = [(f"{t} t/s (strata bench)", lambda s, r, t=t: bench(s, r, t)) for t in ["pp512", "tg64"]]
rows.append(("aggregate decode t/s, 16 concurrent (strata serve)", serve))
each = lambda f, side: [f(side, r) for r in range(1, rounds + 1)]
for name, f in rows:
    b, n = med(each(f, "base")), med(each(f, "new"))
    print(f"| {name} | {b:.2f} | {n:.2f} | {n / b:.3f} |")
print(f"(medians of {rounds} rounds; each round runs base then new)")
for name, f in rows:
    show = lambda side: ", ".join(f"{x:.2f}" for x in each(f, side))
    print(f"{name}: base {show('base')}; new {show('new')}")
PY
