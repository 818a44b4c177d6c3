#!/usr/bin/env python3
"""What records that lead nowhere cost a tracker: 2000 fake shard records (the right digest,
the whole model, addresses nobody serves) written beside one real shard's, and the tracker's
CPU time sampled from /proc while it follows them. Prints the share of a core it used in each
window and its RSS, and how many joins it counted as failed.

Usage: bench/registry-fakes.py ETCD_HOST:PORT TRACKER_HOST:PORT TRACKER_PID REAL_SHARD_ADDR
       [N_FAKES] [SECONDS]
"""
import base64
import json
import os
import sys
import time
import urllib.request

etcd, tracker, pid, real_addr = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
n_fakes = int(sys.argv[5]) if len(sys.argv) > 5 else 2000
seconds = int(sys.argv[6]) if len(sys.argv) > 6 else 180
prefix = "/strata/"
b64 = lambda b: base64.b64encode(b).decode()


def gateway(path, body):
    req = urllib.request.Request(f"http://{etcd}{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def cpu_seconds():
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib():
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024


def failed_joins():
    with urllib.request.urlopen(f"http://{tracker}/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith("strata_registry_rejected_total") and "join_failed" in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


key = f"{prefix}shards/{real_addr}"
kvs = gateway("/v3/kv/range", {"key": b64(key.encode())}).get("kvs", [])
real = json.loads(base64.b64decode(kvs[0]["value"]))
before = (cpu_seconds(), rss_mib())
print(f"before: tracker RSS {before[1]:.1f} MiB")
for i in range(n_fakes):
    address = f"127.0.{1 + i // 250}.{1 + i % 250}:9"
    fake = dict(real, address=address, instance=f"fake-{i}")
    gateway("/v3/kv/put", {"key": b64(f"{prefix}shards/{address}".encode()), "value": b64(json.dumps(fake).encode())})
t0 = time.monotonic()
last_t, last_cpu = t0, cpu_seconds()
while time.monotonic() - t0 < seconds:
    time.sleep(30)
    now, cpu = time.monotonic(), cpu_seconds()
    share = (cpu - last_cpu) / (now - last_t)
    print(
        f"{now - t0:5.0f} s: {100 * share:5.1f}% of a core in the last {now - last_t:.0f} s; "
        f"RSS {rss_mib():.1f} MiB; {failed_joins():.0f} failed joins"
    )
    last_t, last_cpu = now, cpu
for i in range(n_fakes):
    address = f"127.0.{1 + i // 250}.{1 + i % 250}:9"
    gateway("/v3/kv/deleterange", {"key": b64(f"{prefix}shards/{address}".encode())})
time.sleep(10)
print(f"fakes deleted: tracker RSS {rss_mib():.1f} MiB")
