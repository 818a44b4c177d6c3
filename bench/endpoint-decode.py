#!/usr/bin/env python3
"""Decode speed of one stream through each API (chat completions, the Responses API, the
Messages API) on the same conversation, so the same tokens: tokens after the first over the
time between the first and the last, alternating the endpoints for ROUNDS rounds; medians and
each endpoint's ratio to chat completions.

    bench/endpoint-decode.py --url http://127.0.0.1:8080 [--rounds 3] [--max-tokens 128]
"""

import argparse
import json
import statistics
import time
import urllib.request

PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm."


def stream(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            d = line[5:].strip()
            if d == "[DONE]":
                break
            v = json.loads(d)
            t = v.get("type")
            text = None
            if t == "response.output_text.delta":
                text = v["delta"]
            elif t == "content_block_delta":
                text = v["delta"].get("text")
            elif t is None and v.get("choices"):
                text = v["choices"][0]["delta"].get("content")
            if text:
                stamps.append(time.time())
    return stamps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    url = a.url.rstrip("/")
    n = a.max_tokens
    msgs = [{"role": "user", "content": PROMPT}]
    apis = {
        "chat": ("/v1/chat/completions", {"messages": msgs, "max_tokens": n, "temperature": 0, "stream": True}),
        "responses": ("/v1/responses", {"input": PROMPT, "max_output_tokens": n, "temperature": 0, "stream": True, "store": False}),
        "messages": ("/v1/messages", {"messages": msgs, "max_tokens": n, "temperature": 0, "stream": True}),
    }
    rates = {k: [] for k in apis}
    for r in range(a.rounds):
        for k, (path, body) in apis.items():
            s = stream(url, path, body)
            rate = (len(s) - 1) / (s[-1] - s[0])
            rates[k].append(rate)
            print(f"round {r + 1} {k:9} {len(s)} deltas, {rate:.2f} t/s", flush=True)
    base = statistics.median(rates["chat"])
    for k, v in rates.items():
        m = statistics.median(v)
        print(f"{k:9} median {m:.2f} t/s  ({m / base:.3f}x chat completions)")


if __name__ == "__main__":
    main()
