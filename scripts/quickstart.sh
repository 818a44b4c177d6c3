#!/usr/bin/env bash
# Fetches the model (cached), builds strata in release mode and answers a real question.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(scripts/fetch-model.sh)
cargo build --release --quiet -p strata
exec target/release/strata generate --model "$model" --chat \
  --prompt "${1:-What is the capital of France? Answer in one sentence.}" --max-tokens 64
