#!/usr/bin/env python3
"""A previous_response_id chain of N links on `strata serve --shards 2` (issue 44): per link its
time, prompt tokens and cached tokens. Usage: bench/response-chain.py STRATA_BIN MODEL N"""
import json, sys, time, subprocess, urllib.request
BIN = sys.argv[1]; MODEL = sys.argv[2]; N = int(sys.argv[3]); SHARDS = sys.argv[4] if len(sys.argv) > 4 else "2"
p = subprocess.Popen([BIN, "serve", "--model", MODEL, "--shards", SHARDS, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=open("/tmp/chain-serve.err", "w"), text=True)
addr = None
while True:
    l = p.stdout.readline()
    if not l: sys.exit("serve died")
    if "listening on " in l:
        addr = l.split("listening on ")[1].split()[0].removeprefix("http://"); break
def post(body):
    r = urllib.request.Request(f"http://{addr}/v1/responses", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(r, timeout=600))
def metric(name):
    m = urllib.request.urlopen(f"http://{addr}/metrics").read().decode()
    return sum(float(l.split()[-1]) for l in m.splitlines() if l.startswith(name))
prev = None
times = []
try:
    for i in range(N):
        body = {"input": f"Note {i}: the quick brown fox jumps over the lazy dog.", "max_output_tokens": 1, "store": True}
        if prev: body["previous_response_id"] = prev
        r0 = metric("strata_shard_prefix_reused_tokens_total")
        t = time.time(); r = post(body); dt = time.time() - t
        r1 = metric("strata_shard_prefix_reused_tokens_total")
        prev = r["id"]; times.append(dt)
        u = r['usage']; print(f"{i} {dt:.2f}s in={u['input_tokens']} cached={u['input_tokens_details']['cached_tokens']} reused={r1-r0:.0f}", flush=True)
finally:
    p.terminate()
