#!/usr/bin/env python3
"""Tool calls under `tool_choice: auto` with strict tools: 20 prompts that plainly need one of
the offered tools and 20 that need none, against a running strata (or any OpenAI-compatible
server). Prints, for each prompt, whether the answer called a tool, and counts: calls on the
tool prompts, text on the others, and every call checked against its tool's schema (a call
that does not parse or match is counted as malformed; text that looks like a call but was
returned as text is counted too).

    bench/tool-choice.py --url http://127.0.0.1:8080 [--model ID] [--api chat|responses|messages] [--system TEXT]
"""

import argparse
import json
import re
import sys
import time
import urllib.request

import jsonschema

TOOLS = [
    ("get_weather", "Current weather for a city.", {"city": {"type": "string"}}, ["city"]),
    ("calculate", "Evaluates an arithmetic expression exactly.", {"expression": {"type": "string"}}, ["expression"]),
    ("search_files", "Finds files in the user's project whose names match a glob pattern.", {"pattern": {"type": "string"}}, ["pattern"]),
    ("send_email", "Sends an email.", {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}}, ["to", "subject", "body"]),
    ("get_stock_price", "The latest price of a stock by its ticker symbol.", {"ticker": {"type": "string"}}, ["ticker"]),
]

NEED = [
    "What is the weather in Paris right now?",
    "Is it raining in Tokyo at the moment?",
    "Tell me the current temperature in Nairobi.",
    "Compute 48213 * 9127 exactly.",
    "What is (1234567 + 7654321) / 3? Use the calculator.",
    "Calculate 2 to the power of 37.",
    "Find all Python files in my project.",
    "Which files in my project end in .toml?",
    "List every Markdown file in my repository.",
    "Send an email to ada@example.com with subject 'Meeting' saying the meeting moved to 3pm.",
    "Email bob@example.com to tell him the build is green; subject: Build.",
    "What is Apple's stock price right now?",
    "Get me the latest price of the MSFT ticker.",
    "How is NVDA trading at the moment?",
    "What's the weather like in Reykjavik today?",
    "Please find the files named Cargo.toml anywhere in my project.",
    "What is 98765 * 4321? I need the exact number.",
    "Check the current weather in Buenos Aires for me.",
    "Send carol@example.com an email with subject 'Lunch' and body 'Noon at the usual place?'.",
    "Look up the current TSLA share price.",
]

NONE = [
    "Write a haiku about autumn leaves.",
    "What is the capital of France?",
    "Explain what a Rust lifetime is in two sentences.",
    "Translate 'good morning' into Spanish.",
    "Give me three tips for writing clear commit messages.",
    "What does HTTP stand for?",
    "Write a Python function that reverses a string.",
    "Who wrote Pride and Prejudice?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What is the difference between a list and a tuple in Python?",
    "Say hello.",
    "Suggest a name for a pet goldfish.",
    "What is a binary search? Answer briefly.",
    "Is a tomato a fruit or a vegetable?",
    "Write one sentence about the ocean.",
    "What year did the first person walk on the moon?",
    "Explain recursion to a child in one sentence.",
    "What is the plural of 'mouse'?",
    "Recommend a classic science fiction novel.",
    "What does the 'git status' command show?",
]


def schema(props, required):
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def post(url, path, body, key):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json", "authorization": f"Bearer {key}", "x-api-key": key})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


SYSTEM = None


def chat_messages(prompt):
    m = [{"role": "user", "content": prompt}]
    return ([{"role": "system", "content": SYSTEM}] + m) if SYSTEM else m


def ask_chat(url, model, prompt, key):
    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": schema(p, r), "strict": True}} for n, d, p, r in TOOLS]
    v = post(url, "/v1/chat/completions", {"model": model, "messages": chat_messages(prompt), "tools": tools, "tool_choice": "auto", "temperature": 0, "max_tokens": 160}, key)
    m = v["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    return calls, m.get("content") or ""


def ask_responses(url, model, prompt, key):
    tools = [{"type": "function", "name": n, "description": d, "parameters": schema(p, r), "strict": True} for n, d, p, r in TOOLS]
    v = post(url, "/v1/responses", {"model": model, "input": prompt, "instructions": SYSTEM, "tools": tools, "temperature": 0, "max_output_tokens": 160}, key)
    calls = [(i["name"], i["arguments"]) for i in v["output"] if i["type"] == "function_call"]
    text = "".join(c["text"] for i in v["output"] if i["type"] == "message" for c in i["content"])
    return calls, text


def ask_messages(url, model, prompt, key):
    tools = [{"name": n, "description": d, "input_schema": schema(p, r)} for n, d, p, r in TOOLS]
    v = post(url, "/v1/messages", {"model": model, "messages": [{"role": "user", "content": prompt}], "system": SYSTEM or "", "tools": tools, "temperature": 0, "max_tokens": 160}, key)
    calls = [(b["name"], json.dumps(b["input"])) for b in v["content"] if b["type"] == "tool_use"]
    text = "".join(b["text"] for b in v["content"] if b["type"] == "text")
    return calls, text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model")
    ap.add_argument("--api", default="chat", choices=["chat", "responses", "messages"])
    ap.add_argument("--key", default="none")
    ap.add_argument("--system", help="a system prompt (instructions) for every request")
    a = ap.parse_args()
    global SYSTEM
    SYSTEM = a.system
    url = a.url.rstrip("/")
    model = a.model or json.load(urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers={"authorization": f"Bearer {a.key}"})))["data"][0]["id"]
    ask = {"chat": ask_chat, "responses": ask_responses, "messages": ask_messages}[a.api]
    schemas = {n: schema(p, r) for n, _, p, r in TOOLS}
    malformed = looks_like_call = 0
    need_called = none_text = 0
    t0 = time.time()
    for kind, prompts in (("need", NEED), ("none", NONE)):
        for p in prompts:
            calls, text = ask(url, model, p, a.key)
            for name, args in calls:
                try:
                    jsonschema.validate(json.loads(args), schemas[name])
                except Exception as e:
                    malformed += 1
                    print(f"  malformed call {name} {args!r}: {e}", file=sys.stderr)
            if "<tool_call>" in text or re.match(r'\s*(```(json)?\s*)?(<\w+>\s*)?\{\s*"name"\s*:', text):
                looks_like_call += 1
            if kind == "need" and calls:
                need_called += 1
            if kind == "none" and not calls and text.strip():
                none_text += 1
            shown = ", ".join(f"{n}({x})" for n, x in calls) if calls else repr(text[:70])
            print(f"{kind:4} {'call' if calls else 'text'}  {p[:60]:60}  {shown}", flush=True)
    print(f"\n{a.api}: tool prompts answered with a call: {need_called}/{len(NEED)}; "
          f"no-tool prompts answered with text: {none_text}/{len(NONE)}; malformed calls: {malformed}; "
          f"call-like text returned as text: {looks_like_call}; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
