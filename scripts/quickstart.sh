#!/usr/bin/env bash
# Fetches the model (cached, checksummed), builds strata, starts a local 2-shard cluster
# (two shard processes and a tracker), asks it a real question through the OpenAI-compatible
# API, prints the answer and stops the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(scripts/fetch-model.sh)
cargo build --release --quiet -p strata
port=${STRATA_PORT:-8080}
question=${1:-What is the capital of France? Answer in one sentence.}

target/release/strata serve --model "$model" --shards 2 --listen "127.0.0.1:$port" &
serve_pid=$!
trap 'kill $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null' EXIT

for _ in $(seq 1 240); do
  if python3 - "$port" <<'PY' 2>/dev/null; then break; fi
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
PY
  sleep 0.5
done

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
