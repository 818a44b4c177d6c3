#!/usr/bin/env bash
# A model over three "hosts" (network namespaces on a private bridge, each link limited to
# MBIT megabits per second each way with `tc tbf`, and every message to a shard delayed DELAY_MS
# by bench/delay-proxy.py in that shard's namespace, so tracker-to-shard, shard-to-shard and the
# replies all pay it), for issue 32's benchmark:
#
#   - strata: three shards (`--threads 1`, ranges cut in three), registered on an etcd on the
#     bridge; `strata plan` prints its predicted time per token for the route (before any step,
#     and again after, from the shards' own measured times per token); then a tracker
#     per seam encoding (f32, f16, q8_0) measures single-stream decode (`strata bench --url`) and
#     the seam bytes per token (the first shard's `strata_shard_seam_bytes_out_total` over the
#     positions it computed).
#   - llama.cpp (when LLAMA_CPP_DIR is set): `ggml-rpc-server -t 1` in the same namespaces behind
#     the same proxies, and `llama-bench --rpc` on the bridge offloading every layer to them.
#
# Needs root. Usage: [MODEL=name-or-path] [STRATA=path] [LLAMA_CPP_DIR=dir] [ETCD_BIN=path]
#   bench/namespace-route.sh [delay ms, default 2] [mbit, default 1000] [requests, default 3] [tokens, default 64]
set -euo pipefail
cd "$(dirname "$0")/.."
delay=${1:-2}
mbit=${2:-1000}
reqs=${3:-3}
gen=${4:-64}
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)" >&2; exit 1; }
MODEL=${MODEL:-qwen2.5-coder-1.5b}
if [ -f "$MODEL" ]; then model=$MODEL; else model=$(scripts/fetch-model.sh "$MODEL"); fi
if [ -z "${STRATA:-}" ]; then
  cargo build --release --quiet -p strata
  STRATA=target/release/strata
fi
STRATA=$(realpath "$STRATA")
etcd=${ETCD_BIN:-$(command -v etcd || true)}
[ -x "$etcd" ] || { echo "no etcd (set ETCD_BIN)" >&2; exit 1; }

n=""
out=$(mktemp -d)
cleanup() {
  [ -n "$n" ] || { rm -rf "$out"; return; }
  kill $(jobs -p) 2>/dev/null || true
  for h in 1 2 3; do ip netns pids "snb$n-$h" 2>/dev/null | xargs -r kill 2>/dev/null || true; done
  wait 2>/dev/null || true
  for h in 1 2 3; do ip netns del "snb$n-$h" 2>/dev/null || true; ip link del "snb${n}v$h" 2>/dev/null || true; done
  ip link del "snb$n" 2>/dev/null || true
  rm -rf "$out"
}
trap cleanup EXIT
# A bridge number no other run holds: its name is the lock.
for i in $(seq 100 199); do
  if ip link add "snb$i" type bridge 2>/dev/null; then n=$i; break; fi
done
[ -n "$n" ] || { echo "no free bridge snb100..snb199" >&2; exit 1; }
net=10.78.$n
ip addr add "$net.254/24" dev "snb$n"
ip link set "snb$n" up
tbf() { tc qdisc replace dev "$1" root tbf rate "${mbit}mbit" burst 64kb latency 200ms; }
for h in 1 2 3; do
  ns=snb$n-$h
  ip netns add "$ns"
  ip link add "snb${n}v$h" type veth peer name "snb${n}p$h"
  ip link set "snb${n}p$h" netns "$ns"
  ip link set "snb${n}v$h" master "snb$n" up
  ip netns exec "$ns" ip addr add "$net.$h/24" dev "snb${n}p$h"
  ip netns exec "$ns" ip link set "snb${n}p$h" up
  ip netns exec "$ns" ip link set lo up
  tbf "snb${n}v$h"
  ip netns exec "$ns" tc qdisc replace dev "snb${n}p$h" root tbf rate "${mbit}mbit" burst 64kb latency 200ms
done
inns() { local h=$1; shift; ip netns exec "snb$n-$h" "$@"; }

source bench/lib.sh
wait_port() { # $1 = namespace number, $2 = port on its loopback
  for _ in $(seq 1 600); do
    inns "$1" bash -c "exec 3<>/dev/tcp/127.0.0.1/$2" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "nothing listens on host $1 port $2" >&2; return 1
}

n_layer=$("$STRATA" model info --model "$model" --json | python3 -c "import json,sys; print(json.load(sys.stdin)[\"n_layers\"])")
a=$(( (n_layer + 2) / 3 )); b=$(( a + (n_layer - a) / 2 ))
ranges=("0..$a" "$a..$b" "$b..$n_layer")
echo "model $(basename "$model"), $n_layer layers as ${ranges[*]}; links ${mbit} Mbit/s, ${delay} ms a message; $(nproc) cores"

"$etcd" --data-dir "$out/etcd" --listen-client-urls "http://$net.254:2379" --advertise-client-urls "http://$net.254:2379" \
  --listen-peer-urls "http://127.0.0.1:0" >"$out/etcd.log" 2>&1 &
registry=http://$net.254:2379
head -c 32 /dev/urandom | base64 > "$out/token"
shards=()
for h in 1 2 3; do
  inns "$h" python3 bench/delay-proxy.py "$net.$h:7001" 127.0.0.1:7000 "$delay" &
  inns "$h" "$STRATA" shard --model "$model" --layers "${ranges[$((h - 1))]}" --threads 1 --no-prefix-cache \
    --listen 127.0.0.1:7000 --advertise "$net.$h:7001" --registry "$registry" \
    --cluster-token-file "$out/token" >"$out/shard$h.log" 2>&1 &
  shards+=($!)
done
for h in 1 2 3; do wait_port "$h" 7000; done
# Loaded and announced: plan shows the route.
for _ in $(seq 1 300); do
  "$STRATA" plan --registry "$registry" --model "$model" --read-gbps 1 2>/dev/null | grep -q '^  route 1:' && break
  sleep 0.5
done
"$STRATA" plan --registry "$registry" --model "$model" | tee "$out/plan.txt"

seam_bytes() { # $1 = tracker url: the first shard's seam bytes out and positions computed
  curl -s "$1/metrics" | python3 -c "
import sys
first = '$net.1:7001'
b = t = 0.0
for line in sys.stdin:
    if first not in line or line.startswith('#'):
        continue
    name = line.split('{')[0]
    v = float(line.rsplit(' ', 1)[1])
    if name == 'strata_shard_seam_bytes_out_total': b += v
    if name in ('strata_shard_prefill_tokens_total', 'strata_shard_decode_tokens_total'): t += v
print(b, t)"
}

port=18500
for seam in f32 f16 q8_0; do
  port=$((port + 1))
  "$STRATA" tracker --speculative off --registry "$registry" --cluster-token-file "$out/token" --seam "$seam" \
    --listen "127.0.0.1:$port" >"$out/tracker-$seam.log" 2>&1 &
  tracker=$!
  wait_http "http://127.0.0.1:$port"
  read -r b0 t0 < <(seam_bytes "http://127.0.0.1:$port")
  "$STRATA" bench --url "http://127.0.0.1:$port" --prompt-tokens 32 --gen-tokens "$gen" --requests "$reqs" --json \
    > "$out/strata-$seam.json" 2>"$out/bench-$seam.log"
  read -r b1 t1 < <(seam_bytes "http://127.0.0.1:$port")
  python3 - "$out/strata-$seam.json" "$seam" "$b0" "$t0" "$b1" "$t1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
b0, t0, b1, t1 = map(float, sys.argv[3:7])
per = (b1 - b0) / (t1 - t0) if t1 > t0 else float("nan")
print(f"strata, seam {sys.argv[2]}: decode {r['decode_tps_per_stream_p50']:.2f} tokens/s, "
      f"{1000 / r['decode_tps_per_stream_p50']:.1f} ms a token (inter-token p50 {r['itl_ms_p50']:.1f} ms), "
      f"seam {per:.0f} bytes a token")
PY
  curl -s "http://127.0.0.1:$port/health" | python3 -c "
import json, sys
for m in json.load(sys.stdin)['models']:
    for r in m['routes']:
        ms = lambda k: 'none' if r.get(k) is None else f'{r[k] * 1000:.1f} ms'
        print(f\"  /health: measured {ms('token_seconds')} a token, predicted {ms('predicted_token_seconds')} \"
              f\"(compute {ms('compute_seconds')}, messaging {ms('messaging_seconds')})\")"
  kill "$tracker"; wait "$tracker" 2>/dev/null || true
done

echo "strata plan again, now that the shards have measured their time per token:"
"$STRATA" plan --registry "$registry" --model "$model" | grep '^  route ' || true

if [ -n "${LLAMA_CPP_DIR:-}" ]; then
  # Our shards only (`ip netns exec` changes the network, not what pkill sees), gone before
  # the RPC servers take their ports.
  kill "${shards[@]}" 2>/dev/null || true
  wait "${shards[@]}" 2>/dev/null || true
  rpc=()
  for h in 1 2 3; do
    inns "$h" "$LLAMA_CPP_DIR/bin/ggml-rpc-server" -H 127.0.0.1 -p 7000 -t 1 >"$out/rpc$h.log" 2>&1 &
    rpc+=("$net.$h:7001")
  done
  for h in 1 2 3; do wait_port "$h" 7000; done
  list=$(IFS=,; echo "${rpc[*]}")
  "$LLAMA_CPP_DIR/bin/llama-bench" -m "$model" --rpc "$list" -ngl 99 -t 1 -p 0 -n "$gen" -r "$reqs" -o json \
    > "$out/llama.json" 2>"$out/llama.log" || { tail -20 "$out/llama.log"; exit 1; }
  python3 - "$out/llama.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
tps = r["avg_ts"]
print(f"llama.cpp ggml-rpc (3 servers, -t 1 each): decode {tps:.2f} tokens/s, {1000 / tps:.1f} ms a token "
      f"(runs: {', '.join(f'{x:.2f}' for x in r['samples_ts'])})")
PY
fi
