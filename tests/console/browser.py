#!/usr/bin/env python3
"""The console in a real browser: Debian's chromium, headless, driven over the DevTools protocol.

Two routes of SmolLM2-135M (two shards each) behind a tracker with an API key. The console page
loads without a key, asks for one, and once given it shows both routes and every shard; a shard
killed with SIGKILL shows as down within 3 s of the kill (the page polls; it is never reloaded),
and up again after the shard restarts on its address; with `--public-metrics` the panels show
without a key and the page asks for one when the chat box's request answers 401. A screenshot of
each state is saved under ARTIFACTS (default target/console-artifacts).

    cargo build --release -p strata && python3 tests/console/browser.py
STRATA_BIN names the binary, CHROMIUM the browser; needs the `websockets` package (in
tests/agents/requirements.txt).
"""

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from websockets.sync.client import connect

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("STRATA_BIN", os.path.join(ROOT, "target", "release", "strata"))
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = os.environ.get("ARTIFACTS", os.path.join(ROOT, "target", "console-artifacts"))
KEY = "console-test-key-0123456789"
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"

PROCS = []


def spawn(args, ready):
    """Starts `strata ARGS` and returns (process, address) once it prints READY ADDRESS."""
    p = subprocess.Popen([BIN] + args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    PROCS.append(p)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            raise SystemExit(f"strata {args[0]} exited: {p.wait()}")
        if ready in line:
            addr = line.split(ready)[1].split()[0].removeprefix("http://")
            # Keep reading its output, so it never blocks on a full pipe.
            subprocess.Popen(["cat"], stdin=p.stdout, stdout=subprocess.DEVNULL)
            return p, addr
    raise SystemExit(f"strata {args[0]} did not start")


def shard(model, layers, token, listen="127.0.0.1:0"):
    return spawn(
        ["shard", "--model", model, "--layers", layers, "--listen", listen, "--cluster-token-file", token, "--threads", "1"],
        "strata shard listening on ",
    )


class Page:
    """One browser tab over the DevTools protocol."""

    def __init__(self, ws_url):
        self.ws = connect(ws_url, max_size=64 << 20)
        self.ids = itertools.count(1)

    def call(self, method, **params):
        n = next(self.ids)
        self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            m = json.loads(self.ws.recv(timeout=30))
            if m.get("id") == n:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m["result"]

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, name):
        os.makedirs(ARTIFACTS, exist_ok=True)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path = os.path.join(ARTIFACTS, name)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        print(f"screenshot: {path}")


def shard_state(page, addr):
    """What the page's shard table says of ADDR ('' while it is not listed)."""
    return page.eval(
        f"(() => {{ const r = document.querySelector('#shards tr[data-shard=\"{addr}\"]');"
        " return r ? r.querySelector('.pill').textContent : ''; })()"
    )


def wait_for(what, limit, f):
    """Seconds until f() holds (an exception in the page, e.g. before it loaded, is a no)."""
    t = time.time()
    while time.time() - t < limit:
        try:
            if f():
                return time.time() - t
        except RuntimeError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {limit} s")


def main():
    if not CHROMIUM:
        raise SystemExit("no chromium (Debian's package chromium; .ci/run installs it)")
    model = subprocess.run([os.path.join(ROOT, "scripts", "fetch-model.sh"), "smollm2-135m"], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    tmp = tempfile.mkdtemp(prefix="strata-console-")
    token = os.path.join(tmp, "token")
    with open(token, "w") as f:
        f.write("console-cluster-token-0123456789")
    shards = {}
    for route in ["a", "b"]:
        for layers in ["0..15", "15..30"]:
            shards[(route, layers)] = shard(model, layers, token)
    routes = []
    for route in ["a", "b"]:
        routes += ["--route", f"{route}=" + ",".join(shards[(route, l)][1] for l in ["0..15", "15..30"])]
    _, addr = spawn(
        ["tracker", "--listen", "127.0.0.1:0", "--cluster-token-file", token, "--api-key", KEY, "--health-period-ms", "200"] + routes,
        "strata tracker listening on ",
    )
    browser = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
         f"--user-data-dir={tmp}/profile", "--window-size=1400,1000", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    PROCS.append(browser)
    devtools = None
    for line in browser.stderr:
        m = re.search(r"DevTools listening on (ws://\S+)", line)
        if m:
            devtools = m.group(1)
            break
    if devtools is None:
        raise SystemExit("chromium did not start its DevTools server")
    subprocess.Popen(["cat"], stdin=browser.stderr, stdout=subprocess.DEVNULL)
    port = re.search(r":(\d+)/", devtools).group(1)
    targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
    page = Page(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])
    page.call("Page.enable")
    page.call("Page.navigate", url=f"http://{addr}/console")
    # Without a key the page holds nothing and asks for one.
    wait_for("the key form", 10, lambda: page.eval("!document.getElementById('keyform').hidden") is True)
    assert page.eval("document.querySelectorAll('#shards tbody tr').length") == 0
    page.eval(f"document.getElementById('key').value = '{KEY}'; document.getElementById('keyform').requestSubmit(); true")
    every = [a for _, a in shards.values()]
    wait_for("both routes and every shard up", 20, lambda: all(shard_state(page, a) == "up" for a in every))
    listed = page.eval("[...document.querySelectorAll('.route')].map(r => r.dataset.route)")
    assert sorted(listed) == ["a", "b"], listed
    segs = page.eval("[...document.querySelectorAll('.seg')].map(s => s.dataset.shard)")
    assert sorted(segs) == sorted(every), segs
    assert "every layer covered" in page.eval("document.querySelector('.caption').textContent")
    # Each shard's release and protocol, as it described itself.
    versions = page.eval("[...document.querySelectorAll('#shards tbody tr td:nth-child(5)')].map(t => t.textContent)")
    assert len(versions) == len(every) and all(v.startswith("v") and "protocol" in v for v in versions), versions
    page.screenshot("console-up.png")
    polls = page.eval("Number(document.body.dataset.polls)")

    # SIGKILL one shard of route b: down on the page within 3 s, the page never reloaded.
    victim, victim_addr = shards[("b", "15..30")]
    victim.kill()
    killed = time.time()
    took = wait_for("the killed shard shown down", 3, lambda: shard_state(page, victim_addr) == "down")
    assert page.eval("document.querySelector('.route[data-route=\"b\"] .pill').textContent") == "down"
    assert page.eval("document.querySelector('.route[data-route=\"a\"] .pill').textContent") == "up"
    assert page.eval("Number(document.body.dataset.polls)") > polls, "the page did not poll"
    print(f"killed shard {victim_addr} shown down {took:.2f} s after SIGKILL")
    page.screenshot("console-shard-down.png")

    # Restarted on its address: up again.
    shards[("b", "15..30")] = shard(model, "15..30", token, listen=victim_addr)
    took = wait_for("the restarted shard shown up", 20, lambda: shard_state(page, victim_addr) == "up")
    print(f"restarted shard shown up {took:.2f} s after it started ({time.time() - killed:.1f} s after the kill)")
    page.screenshot("console-recovered.png")

    # The chat box answers through the API with the key.
    page.eval("document.getElementById('prompt').value = 'What is the capital of France?'; document.getElementById('chat').requestSubmit(); true")
    wait_for("an answer in the chat box", 60, lambda: len(page.eval("document.getElementById('answer').textContent") or "") > 0)
    print("chat box:", repr(page.eval("document.getElementById('answer').textContent")[:80]))

    # The route that answered shows its prefix-cache hit rate; the same question again goes to
    # that route and starts on its cached blocks: one of its two sessions hit.
    def models_text():
        return page.eval("document.getElementById('models').textContent") or ""
    wait_for("a route's prefix-cache hit rate", 10, lambda: "prefix cache hits 0%" in models_text())
    page.eval("document.getElementById('prompt').value = 'What is the capital of France?'; document.getElementById('chat').requestSubmit(); true")
    wait_for("the hit rate after the same question", 60, lambda: "prefix cache hits 50%" in models_text())
    page.screenshot("console-hit-rate.png")

    # With --public-metrics the panels need no key, so the page does not ask for one until a
    # request that needs it answers 401: the chat box's.
    _, open_addr = spawn(
        ["tracker", "--listen", "127.0.0.1:0", "--cluster-token-file", token, "--api-key", KEY,
         "--public-metrics", "--health-period-ms", "200"] + routes,
        "strata tracker listening on ",
    )
    page.eval("sessionStorage.clear(); true")
    page.call("Page.navigate", url=f"http://{open_addr}/console")
    wait_for("the panels without a key", 20, lambda: page.eval("document.querySelectorAll('.route').length") == 2)
    assert page.eval("document.getElementById('keyform').hidden") is True
    page.eval("document.getElementById('prompt').value = 'hi'; document.getElementById('chat').requestSubmit(); true")
    wait_for("the chat's 401 and the key form", 10,
             lambda: page.eval("!document.getElementById('keyform').hidden") is True
             and (page.eval("document.getElementById('answer').textContent") or "").startswith("401"))
    print("console browser test: ok")


if __name__ == "__main__":
    try:
        main()
    finally:
        for p in PROCS:
            p.kill()
