#!/usr/bin/env python3
"""Tenants apart, by hand (issue 44): bob sends 3.9 MB `metadata` 30 times and 16 at once,
then 30 at OpenAI's bounds; prints statuses, tracker RSS, and whether alice's stored response
survives. Usage: bench/tenant-probe.py STRATA_BIN MODEL"""
import json, sys, time, subprocess, urllib.request, threading, os, tempfile
BIN = sys.argv[1]; MODEL = sys.argv[2]
d = tempfile.mkdtemp()
open(f"{d}/keys", "w").write("alice sk-alice 100000000\nbob sk-bob 100000000\n")
p = subprocess.Popen([BIN, "serve", "--model", MODEL, "--shards", "2", "--listen", "127.0.0.1:0", "--ledger", f"{d}/l.sqlite", "--api-keys", f"{d}/keys"], stdout=subprocess.PIPE, stderr=open("/tmp/probe44.err", "w"), text=True)
while True:
    l = p.stdout.readline()
    if not l: sys.exit("serve died")
    if "listening on " in l:
        addr = l.split("listening on ")[1].split()[0].removeprefix("http://"); break
def rss():
    return int(open(f"/proc/{p.pid}/status").read().split("VmRSS:")[1].split()[0]) / 1024
def req(method, path, body, key, timeout=120):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    r = urllib.request.Request(f"http://{addr}{path}", data=data, method=method, headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
try:
    st, b = req("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1, "store": True}, "sk-alice")
    alice_id = json.loads(b)["id"]
    print("alice stored", st, alice_id)
    big = ('{"input":"hi","max_output_tokens":1,"store":true,"metadata":[' + ",".join(["0"] * 1_950_000) + "]}").encode()
    print(f"body {len(big)/1e6:.1f} MB; rss before {rss():.0f} MiB")
    peak = rss(); codes = []
    for i in range(30):
        st, b = req("POST", "/v1/responses", big, "sk-bob")
        codes.append(st); peak = max(peak, rss())
    print("30 sequential:", {c: codes.count(c) for c in set(codes)}, "example:", b[:160], f"peak rss {peak:.0f} MiB")
    st, b = req("GET", f"/v1/responses/{alice_id}", None, "sk-alice")
    print("alice GET after:", st)
    codes = []; lock = threading.Lock(); base = rss(); peak = base
    def one():
        st, b = req("POST", "/v1/responses", big, "sk-bob")
        with lock: codes.append((st, b[:200]))
    ts = [threading.Thread(target=one) for _ in range(16)]
    for t in ts: t.start()
    while any(t.is_alive() for t in ts):
        peak = max(peak, rss()); time.sleep(0.02)
    print("16 concurrent:", {c: [x[0] for x in codes].count(c) for c in set(x[0] for x in codes)}, f"rss {base:.0f} -> peak {peak:.0f} MiB")
    for c in codes[:2]: print("  ", c)
    st, b = req("GET", f"/v1/responses/{alice_id}", None, "sk-alice")
    print("alice GET after:", st)
    # Valid metadata at OpenAI's bounds, stored 30 times by bob.
    md = {f"k{i:02d}": "v" * 512 for i in range(16)}
    codes = []
    for i in range(30):
        st, b = req("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1, "store": True, "metadata": md}, "sk-bob")
        codes.append(st)
    print("30 at the bounds:", {c: codes.count(c) for c in set(codes)}, f"rss {rss():.0f} MiB")
    st, b = req("GET", f"/v1/responses/{alice_id}", None, "sk-alice")
    print("alice GET after:", st)
finally:
    p.terminate()
