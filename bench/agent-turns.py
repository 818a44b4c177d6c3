#!/usr/bin/env python3
"""Agent conversations over replica routes: does each turn find its prefix cached?

Starts R whole-model shards (one route each) and a tracker over them, runs N conversations at
once of T turns each (a long system prompt, then a user message and the model's answer per
turn, streamed), and prints per turn the time to first token and the share of the prompt
taken from the prefix cache (`usage.prompt_tokens_details.cached_tokens`). It does so twice,
on fresh shards each time: with `--route-by cache` (the default) and with `--route-by load`.

Usage: bench/agent-turns.py [--model NAME|PATH] [--replicas 2] [--conversations 1]
       [--turns 6] [--system-words 1500] [--threads 1] [--strata PATH]
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_path(name):
    if os.path.isfile(name):
        return name
    return subprocess.check_output([os.path.join(ROOT, "scripts", "fetch-model.sh"), name], text=True).strip()


def start(argv, marker):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in p.stdout:
        if marker in line:
            addr = line.split(marker)[1].split()[0].removeprefix("http://")
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p, addr
    sys.exit(f"{argv[1]} did not start")


def stream_turn(addr, messages, max_tokens):
    """Streams one chat turn: (seconds to the first token, answer text, usage)."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    t0 = time.time()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
    f = s.makefile("rb")
    ttft, text, usage = None, "", None
    for raw in f:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        for c in ev.get("choices", []):
            piece = c.get("delta", {}).get("content")
            if piece:
                if ttft is None:
                    ttft = time.time() - t0
                text += piece
        if ev.get("usage"):
            usage = ev["usage"]
    s.close()
    return ttft if ttft is not None else time.time() - t0, text, usage


def run(args, route_by):
    token = tempfile.NamedTemporaryFile("w", delete=False)
    token.write("bench-cluster-token-0123456789\n")
    token.close()
    model = model_path(args.model)
    shards = [start([args.strata, "shard", "--model", model, "--layers", f"0..{args.layers}",
                     "--listen", "127.0.0.1:0", "--cluster-token-file", token.name,
                     "--threads", str(args.threads)], "listening on ")
              for _ in range(args.replicas)]
    routes = []
    for i, (_, a) in enumerate(shards):
        routes += ["--route", f"r{i}={a}"]
    tracker, addr = start([args.strata, "tracker", "--listen", "127.0.0.1:0",
                           "--cluster-token-file", token.name, "--route-by", route_by] + routes,
                          "listening on ")
    filler = " ".join(f"rule {i}: keep the change small and tested." for i in range(args.system_words // 8))
    rows = []
    lock = threading.Lock()

    def conversation(c):
        messages = [{"role": "system", "content": f"You are the coding agent of project {c}. {filler}"}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": f"Turn {turn}: what is the next step, and why?"})
            ttft, text, usage = stream_turn(addr, messages, args.max_tokens)
            messages.append({"role": "assistant", "content": text})
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            with lock:
                rows.append((c, turn, usage["prompt_tokens"], cached, ttft))

    try:
        threads = [threading.Thread(target=conversation, args=(c,)) for c in range(args.conversations)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        tracker.terminate()
        for p, _ in shards:
            p.terminate()
        os.unlink(token.name)
    return sorted(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--layers", type=int, default=None, help="the model's layer count (read with `strata model info` when absent)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=1)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--strata", default=os.path.join(ROOT, "target", "release", "strata"))
    args = ap.parse_args()
    if args.layers is None:
        info = subprocess.check_output([args.strata, "model", "info", "--model", model_path(args.model),
                                        "--layers", "0..1"], text=True)
        # "layers       0..1 of 24"
        args.layers = next(int(l.split()[-1]) for l in info.splitlines() if l.startswith("layers"))
    print(f"{args.conversations} conversation(s) x {args.turns} turns over {args.replicas} replica routes, "
          f"model {args.model}, {args.threads} thread(s) per shard")
    results = {}
    for route_by in ("cache", "load"):
        rows = run(args, route_by)
        results[route_by] = rows
        print(f"\n--route-by {route_by}")
        print("conv turn prompt cached  share   ttft_s")
        for c, turn, prompt, cached, ttft in rows:
            print(f"{c:4d} {turn:4d} {prompt:6d} {cached:6d} {cached / prompt:6.1%} {ttft:8.3f}")
    print("\nturns after the first: median time to first token, mean cached share")
    for route_by, rows in results.items():
        later = [r for r in rows if r[1] > 0]
        print(f"  --route-by {route_by:5s} {statistics.median(r[4] for r in later):7.3f} s "
              f"{statistics.mean(r[3] / r[2] for r in later):6.1%}")


if __name__ == "__main__":
    main()
