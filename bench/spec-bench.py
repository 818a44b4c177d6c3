#!/usr/bin/env python3
"""Single-stream decode speed on the speculation workload set, two ways in the same run.

Usage: bench/spec-bench.py URL [--kind code_edit|json|chat|mixed|all] [--requests N] [--max-tokens N]
                           [--a JSON] [--b JSON] [--model NAME] [--concurrency C]

Sends the workload's requests of one kind (bench/spec-workload.json, greedy; `mixed`: the
kinds in turn) to an
OpenAI-compatible server, streamed, each twice in turn: once with the fields of --a merged into
the body, once with those of --b (for strata: --a '{"speculative": false}' --b '{}'; for two
llama-servers, run the script against each). A slow phase of the machine hits both alike.
Reports per variant the median decode rate of a stream (tokens after the first / time after the
first), the workload's total rate (all those tokens over all that time: `decode_tps_total`),
the median time to first token, and whether the two variants returned the same text
for every request. Prints one JSON object.
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse
from pathlib import Path


def stream(url, body):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise SystemExit(f"{url}: status {r.status}: {r.read()[:500]!r}")
    first = None
    text = []
    n = 0
    last = t0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            n = ev["usage"].get("completion_tokens", n)
        for c in ev.get("choices", []):
            piece = (c.get("delta") or {}).get("content") or ""
            if piece:
                if first is None:
                    first = time.perf_counter()
                text.append(piece)
                last = time.perf_counter()
    conn.close()
    first = first or last
    return {"ttft": first - t0, "decode_s": last - first, "tokens": n, "text": "".join(text)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--kind", default="code_edit")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--a", default="{}", help="fields merged into variant a's bodies")
    ap.add_argument("--b", default=None, help="fields merged into variant b's bodies (none: a only)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, default=1)
    args = ap.parse_args()
    w = json.load(open(Path(__file__).with_name("spec-workload.json")))["requests"]
    if args.kind == "mixed":
        # The kinds in turn: code edit, JSON, chat, code edit, ...
        by_kind = {}
        for r in w:
            by_kind.setdefault(r["kind"], []).append(r)
        turns = zip(*by_kind.values())
        reqs = [r for turn in turns for r in turn][: args.requests]
    else:
        reqs = [r for r in w if args.kind == "all" or r["kind"] == args.kind][: args.requests]
    variants = {"a": json.loads(args.a)}
    if args.b is not None:
        variants["b"] = json.loads(args.b)
    results = {k: [] for k in variants}

    def body(r, extra):
        b = {"messages": r["messages"], "max_tokens": args.max_tokens, "temperature": 0,
             "stream": True, "stream_options": {"include_usage": True}}
        if args.model:
            b["model"] = args.model
        b.update(extra)
        return b

    for r in reqs:
        for k, extra in variants.items():
            outs = [None] * args.concurrency

            def one(i):
                outs[i] = stream(args.url, body(r, extra))

            t = time.perf_counter()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(args.concurrency)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            wall = time.perf_counter() - t
            res = outs[0]
            res["aggregate_tps"] = sum(o["tokens"] for o in outs) / wall
            results[k].append(res)

    def summary(rs):
        rates = [(x["tokens"] - 1) / x["decode_s"] for x in rs if x["decode_s"] > 0 and x["tokens"] > 1]
        return {
            "decode_tps_p50": statistics.median(rates) if rates else 0.0,
            "decode_tps": [round(x, 2) for x in rates],
            # The workload's own rate: every decoded token over all the decoding time.
            "decode_tps_total": sum(x["tokens"] - 1 for x in rs) / max(1e-9, sum(x["decode_s"] for x in rs)),
            "ttft_s_p50": statistics.median(x["ttft"] for x in rs),
            "aggregate_tps_p50": statistics.median(x["aggregate_tps"] for x in rs),
            "tokens": [x["tokens"] for x in rs],
        }

    out = {"url": args.url, "kind": args.kind, "requests": len(reqs), "max_tokens": args.max_tokens,
           "concurrency": args.concurrency}
    for k in variants:
        out[k] = {"fields": variants[k], **summary(results[k])}
    if "b" in variants:
        out["same_text"] = all(x["text"] == y["text"] for x, y in zip(results["a"], results["b"]))
        a, b = out["a"]["decode_tps_p50"], out["b"]["decode_tps_p50"]
        out["b_over_a"] = b / a if a else None
        a, b = out["a"]["decode_tps_total"], out["b"]["decode_tps_total"]
        out["b_over_a_total"] = b / a if a else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
