#!/usr/bin/env bash
# Fetches the model (cached, checksummed), builds strata, starts a local 2-shard cluster
# (two shard processes and a tracker), asks it a real question through the OpenAI-compatible
# API, prints the answer and stops the cluster, then says how to run one yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf 'quickstart: %s\n' "$*" >&2; }

say "fetching the model (cached after the first time)"
model=$(scripts/fetch-model.sh)
say "model: $model"
say "building strata in release mode (a few minutes the first time; cargo's progress follows)"
cargo build --release -p strata
port=${STRATA_PORT:-8080}
question=${1:-What is the capital of France? Answer in one sentence.}

say "starting a local cluster: 2 shard processes and a tracker on 127.0.0.1:$port"
target/release/strata serve --model "$model" --shards 2 --listen "127.0.0.1:$port" &
serve_pid=$!
trap 'kill $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null' EXIT

for _ in $(seq 1 240); do
  if python3 - "$port" <<'PY' 2>/dev/null; then break; fi
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
PY
  if ! kill -0 "$serve_pid" 2>/dev/null; then
    say "strata serve exited before it was ready (is port $port taken? set STRATA_PORT)"
    exit 1
  fi
  sleep 0.5
done

say "asking it a question over the API"
python3 - "$port" "$question" <<'PY'
import json, sys, urllib.request
port, question = sys.argv[1], sys.argv[2]
body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": 64, "temperature": 0}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"content-type": "application/json"})
reply = json.load(urllib.request.urlopen(req, timeout=120))
print(f"Q: {question}")
print(f"A: {reply['choices'][0]['message']['content']}")
print(f"[{reply['usage']['prompt_tokens']} prompt tokens, {reply['usage']['completion_tokens']} generated, model {reply['model']}]")
PY

cat >&2 <<EOF

quickstart: that cluster stops now. To run one yourself:
  target/release/strata serve --model $model --shards 2 --listen 127.0.0.1:$port
then, from another terminal:
  curl -s 127.0.0.1:$port/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":32,"temperature":0}'
  curl -s 127.0.0.1:$port/health; curl -s 127.0.0.1:$port/metrics
  target/release/strata bench --url http://127.0.0.1:$port --concurrency 1,4 --gen-tokens 64
Every command explains its flags: target/release/strata serve --help (STRATA_LOG=info logs each request).
EOF
