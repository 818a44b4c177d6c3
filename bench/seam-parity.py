#!/usr/bin/env python3
"""How much a lossy seam changes the output: greedy completions through a 2-shard route
(`strata serve --shards 2`) with `--seam f32`, `f16` and `q8_0`, the same 8 prompts of 64
tokens each; prints per encoding how many outputs equal the f32 route's and after how many
tokens each one parts from it.

Usage: bench/seam-parity.py STRATA_BINARY MODEL_PATH
"""
import json
import socket
import subprocess
import sys
import time
import urllib.request

PROMPTS = [
    "def quicksort(arr):\n    \"\"\"Sort a list.\"\"\"\n",
    "The capital of France is",
    "Once upon a time, in a small village,",
    "// A C function that reverses a string in place\nvoid reverse(char *s) {",
    "Explain the difference between TCP and UDP in three sentences.",
    "import numpy as np\n\ndef softmax(x):",
    "List the planets of the solar system in order:",
    "SELECT name, count(*) FROM orders",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def completions(strata, model, seam):
    port = free_port()
    proc = subprocess.Popen([strata, "serve", "--model", model, "--shards", "2", "--threads", "1",
                             "--seam", seam, "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        out = []
        for prompt in PROMPTS:
            body = json.dumps({"prompt": prompt, "max_tokens": 64, "temperature": 0,
                               "return_token_ids": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                out.append(json.load(r)["choices"][0]["token_ids"])
        return out
    finally:
        proc.terminate()
        proc.wait()


def main():
    strata, model = sys.argv[1], sys.argv[2]
    exact = completions(strata, model, "f32")
    for seam in ["f16", "q8_0"]:
        got = completions(strata, model, seam)
        parts = []
        for a, b in zip(exact, got):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            parts.append(n)
        same = sum(a == b for a, b in zip(exact, got))
        print(f"{model.split('/')[-1]} seam {seam}: {same}/{len(PROMPTS)} outputs identical to f32; "
              f"tokens before the first difference: {parts}")


if __name__ == "__main__":
    main()
