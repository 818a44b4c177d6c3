#!/usr/bin/env python3
"""Decode speed with a JSON schema active against unconstrained, at 1 and 16 concurrent
streams, on one `strata serve` (rounds interleaved, so both see the same machine).

    cargo build --release -p strata
    python3 bench/schema-decode.py [MODEL] [ROUNDS]

Prints tokens/s per round and the median ratio. The schema admits one document of exactly
200 digits (a 200-item array), so every constrained answer is as long as the unconstrained one
(`ignore_eos`, the same `max_tokens`).
"""
import concurrent.futures as futures
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("STRATA_BIN", os.path.join(ROOT, "target", "release", "strata"))
MODEL = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b"
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
N = 200
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": N, "maxItems": N}


def post(addr, body):
    req = urllib.request.Request(f"http://{addr}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def run(addr, streams, constrained, max_tokens):
    body = {"prompt": "Write two hundred digits as a JSON array:", "max_tokens": max_tokens, "temperature": 0}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "digits", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    t = time.time()
    with futures.ThreadPoolExecutor(streams) as pool:
        outs = list(pool.map(lambda _: post(addr, body), range(streams)))
    took = time.time() - t
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    return tokens / took, tokens // streams


def main():
    proc = subprocess.Popen([BIN, "serve", "--model", MODEL, "--shards", "1", "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        addr = None
        while addr is None:
            line = proc.stdout.readline()
            if not line:
                sys.exit("serve exited")
            if "strata tracker listening on " in line:
                addr = line.split("listening on ")[1].split()[0].removeprefix("http://")
        # The length of the constrained answer sets max_tokens for both.
        _, length = run(addr, 1, True, 1024)
        for streams in (1, 16):
            ratios = []
            for r in range(ROUNDS):
                free, _ = run(addr, streams, False, length)
                held, n = run(addr, streams, True, length)
                ratios.append(held / free)
                print(f"{streams:2} streams round {r + 1}: unconstrained {free:7.1f} tok/s, schema {held:7.1f} tok/s "
                      f"({n} tokens each): {held / free:.3f}x", flush=True)
            print(f"{streams:2} streams: median {statistics.median(ratios):.3f}x", flush=True)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
