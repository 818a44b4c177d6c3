#!/usr/bin/env python3
"""Time to first token of an agent's long first request, cold and with only its last message changed.

An agent's request carries its tool definitions before the conversation (Claude Code's are about
64 KB, Qwen Code's first request is about 14,700 tokens). This starts `strata serve` and, when
given, llama-server on the same model, threads and context, and per round sends each of them:

  1. cold: a system prompt of generated tool definitions (about --prompt-tokens tokens, with a
     round number at its start so no round finds another's prefix cached), one earlier exchange
     and a user message, streamed, greedy; the time to the first chunk that carries text;
  2. warm: the same conversation with only its last user message changed: a server that keeps
     the prompt's prefix computes only the new message.

It prints each round and the medians, with the prompt's token count as each server reported it,
and each server's peak RSS at the end (its sessions' KV still held: with --ctx 32768 and
--prompt-tokens 32000, what a 32k-token session costs).
The servers take their requests in turn, so a slow phase of the machine hits both.

Usage: bench/agent-prompt.py [--model NAME|PATH] [--threads 2] [--prompt-tokens 15000]
       [--rounds 3] [--strata PATH] [--llama-server PATH] [--ctx 16384] [--kv-type f16|q8_0]
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_path(name):
    if os.path.isfile(name):
        return name
    return subprocess.check_output([os.path.join(ROOT, "scripts", "fetch-model.sh"), name], text=True).strip()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(port, proc, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"nothing answered on port {port}")


def tool(i):
    """One tool definition in the JSON-schema shape agents send (deterministic, varied text)."""
    verbs = ["read", "write", "search", "list", "move", "delete", "patch", "run", "fetch", "format"]
    nouns = ["file", "directory", "symbol", "test", "branch", "issue", "package", "log", "config", "note"]
    v, n = verbs[i % len(verbs)], nouns[(i // len(verbs)) % len(nouns)]
    return {
        "name": f"{v}_{n}_{i}",
        "description": (
            f"Use this tool to {v} a {n} in the workspace (variant {i}). It returns a JSON object "
            f"describing what happened. Call it only when the user's request needs the {n} to be "
            f"{v} and no earlier result already answers it; prefer one call with several paths "
            f"over several calls. Errors are reported in the `error` field, never raised."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": f"Workspace-relative path of the {n}."},
                "recursive": {"type": "boolean", "description": "Whether to descend into subdirectories."},
                "limit": {"type": "integer", "minimum": 1, "maximum": 1000 + i, "description": "Most entries to return."},
                "pattern": {"type": "string", "description": f"A glob or regular expression selecting the {n} entries."},
                "mode": {"type": "string", "enum": ["fast", "thorough", f"mode{i}"], "description": "How much work to spend."},
            },
            "required": ["path"],
        },
    }


def conversation(round_no, n_tools, last):
    tools = "\n".join(json.dumps(tool(i)) for i in range(n_tools))
    system = (
        f"Session {round_no}. You are a coding agent working in a repository. You have these tools, "
        f"one JSON definition per line:\n{tools}\nAnswer briefly."
    )
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "List the files under src/ that mention the word parser."},
        {"role": "assistant", "content": "src/parse.rs and src/lexer.rs mention it."},
        {"role": "user", "content": last},
    ]


def peak_rss_mib(pid):
    """The process's peak resident set (VmHWM) so far, in MiB: with its session still held."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    return None


def model_id(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def first_token(port, messages):
    """Seconds to the first streamed chunk carrying text, and the prompt tokens reported."""
    body = json.dumps({
        "model": model_id(port), "messages": messages, "stream": True, "max_tokens": 4, "temperature": 0,
        "stream_options": {"include_usage": True},
    }).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, prompt_tokens = None, None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if ttft is None and (delta.get("content") or delta.get("reasoning_content")):
                    ttft = time.perf_counter() - t0
            usage = chunk.get("usage")
            if usage:
                prompt_tokens = usage.get("prompt_tokens")
    if ttft is None:
        sys.exit(f"port {port}: no text streamed")
    return ttft, prompt_tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=15000,
                    help="about how long the prompt is (tool definitions fill it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--strata", default=os.path.join(ROOT, "target", "release", "strata"))
    ap.add_argument("--llama-server", default=None, help="a llama-server binary to compare with")
    ap.add_argument("--kv-type", default="f16", choices=["f16", "q8_0"],
                    help="how both servers cache K and V (llama-server: -ctk/-ctv, with -fa on for q8_0)")
    args = ap.parse_args()
    model = model_path(args.model)
    # About 228 tokens per generated tool definition with Qwen2.5's tokenizer.
    n_tools = max(1, (args.prompt_tokens - 150) // 228)

    servers = []
    port = free_port()
    servers.append(("strata", port, subprocess.Popen(
        [args.strata, "serve", "--model", model, "--shards", "1", "--threads", str(args.threads),
         "--ctx", str(args.ctx), "--kv-type", args.kv_type, "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    if args.llama_server:
        port = free_port()
        servers.append(("llama-server", port, subprocess.Popen(
            [args.llama_server, "-m", model, "-t", str(args.threads), "-c", str(args.ctx), "-np", "1",
             "--port", str(port)]
            + (["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"] if args.kv_type == "q8_0" else []),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    try:
        for _, port, proc in servers:
            wait_health(port, proc)
        results = {name: {"cold": [], "warm": [], "tokens": None} for name, _, _ in servers}
        for rnd in range(1, args.rounds + 1):
            for name, port, _ in servers:
                # Each server's rounds differ from each other's too, so no cache is shared.
                session = f"{rnd}-{name}"
                cold, tokens = first_token(port, conversation(session, n_tools, "Which of those two files is longer?"))
                warm, _ = first_token(port, conversation(session, n_tools, "Which of those two files was changed last?"))
                results[name]["cold"].append(cold)
                results[name]["warm"].append(warm)
                results[name]["tokens"] = tokens
                print(f"round {rnd} {name}: {tokens} prompt tokens, cold {cold:.2f} s, last message changed {warm:.3f} s",
                      flush=True)
        print()
        print("| server | prompt tokens | cold first token (s) | last message changed (s) | peak RSS (MiB) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for (name, r), (_, _, proc) in zip(results.items(), servers):
            print(f"| {name} | {r['tokens']} | {statistics.median(r['cold']):.2f} | {statistics.median(r['warm']):.3f} "
                  f"| {peak_rss_mib(proc.pid)} |")
        if len(results) == 2:
            s, l = results["strata"], results["llama-server"]
            print(f"\ncold: llama-server / strata = {statistics.median(l['cold']) / statistics.median(s['cold']):.2f}x")
    finally:
        for _, _, proc in servers:
            proc.terminate()
        for _, _, proc in servers:
            proc.wait()


if __name__ == "__main__":
    main()
