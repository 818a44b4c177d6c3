#!/usr/bin/env python3
"""What hostile schemas cost everyone else, against a running tracker.

A background client ("bg") sends an 8-token chat every 50 ms; its latency is measured idle,
then while 4 clients send the largest schemas the tracker accepts (and, in the same phase,
schemas far over the limits, which must be refused at once), then idle again. Prints bg's
p50/p99 per phase, the refusal times of 7000-, 10000- and 50000-property schemas, and the
tracker's RSS (from /proc, by PID) idle, under load and after.

A control phase sends the same 4 clients' requests without a schema: what the load alone
costs bg (continuous batching shares each step), against which the schemas' own cost shows.

Usage: bench/schema-flood.py HOST:PORT TRACKER_PID [SECONDS_PER_PHASE] [FLOOD_MAX_TOKENS]
"""
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request

addr, pid = sys.argv[1], int(sys.argv[2])
phase_s = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
flood_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 8


def post(body, timeout=120):
    req = urllib.request.Request(
        f"http://{addr}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        e.read()
        status = e.code
    return status, time.monotonic() - t


def rss_mib():
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wide(n, prefix="p"):
    return {
        "type": "object",
        "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(n)},
    }


def schema_body(schema, max_tokens=32):
    return {
        "messages": [{"role": "user", "content": "Fill in the form as JSON."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


# The largest accepted: 1024 optional properties in all, 128 per object (8 objects under one).
LARGEST = {
    "type": "object",
    "properties": {f"o{k}": wide(127, f"o{k}p") for k in range(8)},
}

BG = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


def bg_phase(seconds, flood=None):
    stop = threading.Event()
    results = {"accepted": [], "refused": []}

    def flooder():
        while not stop.is_set():
            status, took = post(flood)
            results["accepted" if status == 200 else "refused"].append((status, took))

    threads = [threading.Thread(target=flooder) for _ in range(4)] if flood else []
    for t in threads:
        t.start()
    lat = []
    peak = rss_mib()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        status, took = post(BG)
        if status == 200:
            lat.append(took)
        peak = max(peak, rss_mib())
        time.sleep(max(0.0, 0.05 - (time.monotonic() - t0)))
    stop.set()
    for t in threads:
        t.join()
    lat.sort()
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000
    return p(0.5), p(0.99), len(lat), peak, results


post(BG)
idle_rss = rss_mib()
p50, p99, n, _, _ = bg_phase(phase_s)
print(f"idle: bg p50 {p50:.0f} ms, p99 {p99:.0f} ms ({n} requests); tracker RSS {idle_rss:.1f} MiB")
for n_props in (7000, 10000, 50000):
    body = schema_body(wide(n_props))
    status, took = post(body)
    print(f"{n_props} properties ({len(json.dumps(body)) / 1024:.0f} KiB): {status} in {took * 1000:.1f} ms")
plain = dict(schema_body(LARGEST, flood_tokens))
del plain["response_format"]
p50c, p99c, n, _, _ = bg_phase(phase_s, flood=plain)
print(f"4 clients sending the same requests without a schema: bg p50 {p50c:.0f} ms, p99 {p99c:.0f} ms ({n} requests)")
p50f, p99f, n, peak, res = bg_phase(phase_s, flood=schema_body(LARGEST, flood_tokens))
acc = res["accepted"]
print(
    f"4 clients sending the largest accepted schema: bg p50 {p50f:.0f} ms, p99 {p99f:.0f} ms ({n} requests); "
    f"{len(acc)} schema requests answered (median {statistics.median([t for _, t in acc]) * 1000 if acc else 0:.0f} ms), "
    f"{len(res['refused'])} refused; tracker RSS peak {peak:.1f} MiB"
)
time.sleep(5)
after = rss_mib()
p50a, p99a, n, _, _ = bg_phase(phase_s / 2)
print(f"after: bg p50 {p50a:.0f} ms, p99 {p99a:.0f} ms; tracker RSS {after:.1f} MiB ({after - idle_rss:+.1f} MiB against idle)")
print(f"bg p99 under the schema flood / idle: {p99f / p99:.2f}; / under the same load without schemas: {p99f / p99c:.2f}")
