#!/usr/bin/env python3
"""The speculation workload set: chat requests of three kinds, deterministic (fixed seeds).

  - code_edit: rewrite a given 40-line function with one change (agents editing code: the
    answer repeats most of the prompt);
  - json: extract fields of a short text as a JSON object (values copied from the text);
  - chat: free questions (little to copy: speculation should cost nothing there).

Usage: bench/spec-workload.py [--write bench/spec-workload.json]
Prints (or writes) {"requests": [{"kind": ..., "messages": [...]}, ...]}: 20 code edits,
15 extractions, 15 chats. The committed bench/spec-workload.json is what this writes; the
exactness tests (crates/strata/tests/it/speculation.rs) and bench/spec-bench.sh read it.
"""
import json
import random
import sys

NAMES = ["orders", "events", "rows", "items", "records", "entries", "samples", "jobs"]
FIELDS = ["price", "weight", "count", "score", "size", "delay", "cost", "rate"]
OPS = ["+", "-", "*"]


def function(rng, i):
    name = f"summarize_{rng.choice(NAMES)}_{i}"
    coll = rng.choice(NAMES)
    fa, fb = rng.sample(FIELDS, 2)
    lines = [f"def {name}({coll}, limit=None):", f'    """Totals of {fa} and {fb} over {coll}."""']
    lines += ["    total = 0", "    seen = set()", "    result = []"]
    lines += [f"    for index, entry in enumerate({coll}):"]
    lines += ["        if limit is not None and index >= limit:", "            break"]
    lines += ["        key = entry.get('id')", "        if key in seen:", "            continue", "        seen.add(key)"]
    while len(lines) < 36:
        f = rng.choice(FIELDS)
        op = rng.choice(OPS)
        k = rng.randint(2, 9)
        lines += [f"        {f}_value = entry.get('{f}', 0)"]
        lines += [f"        total = total {op} {f}_value * {k}"]
        if rng.random() < 0.3 and len(lines) <= 34:
            lines += [f"        if {f}_value > {k * 10}:", f"            result.append((key, '{f}', {f}_value))"]
    lines += ["    if not result:", "        return total, []", "    result.sort()", "    return total, result"]
    return name, "\n".join(lines)


def code_edit(rng, i):
    name, code = function(rng, i)
    change = rng.choice([
        ("rename the variable `total` to `acc`", None),
        ("rename the function to `" + name.replace("summarize", "collect") + "`", None),
        ("change the default of `limit` from None to 100", None),
        ("replace `result.sort()` with `result.sort(reverse=True)`", None),
    ])[0]
    prompt = (
        f"Rewrite this Python function with one change: {change}. Keep every other line exactly "
        f"as it is and answer with the code only.\n\n```python\n{code}\n```"
    )
    return {"kind": "code_edit", "messages": [{"role": "user", "content": prompt}]}


PEOPLE = ["Ada Byron", "Alan Moore", "Grace Park", "Linus Berg", "Joan Clarke", "Ken Adams"]
CITIES = ["Oslo", "Lyon", "Porto", "Kyoto", "Quito", "Perth", "Tartu"]


def extraction(rng, i):
    person = rng.choice(PEOPLE)
    city = rng.choice(CITIES)
    age = rng.randint(21, 70)
    email = person.lower().replace(" ", ".") + f"{i}@example.org"
    order = rng.randint(1000, 9999)
    text = (
        f"Hello, my name is {person} and I am {age} years old. I moved to {city} last year. "
        f"Please send the invoice for order {order} to {email}; my phone is "
        f"+47 {rng.randint(100, 999)} {rng.randint(10000, 99999)}."
    )
    prompt = (
        "Extract name, age, city, email and order number from the text below as one JSON object "
        f'with the keys "name", "age", "city", "email", "order".\n\nText: {text}'
    )
    return {"kind": "json", "messages": [{"role": "user", "content": prompt}]}


TOPICS = [
    "Why is the sky blue?", "Give me three tips for a job interview.",
    "What is the difference between a list and a tuple in Python?", "Describe a cat in two sentences.",
    "How do vaccines work?", "Write a haiku about autumn.", "What causes tides?",
    "Explain recursion to a child.", "Name some uses of copper.", "How does a bicycle stay upright?",
    "What is a prime number?", "Suggest a name for a bakery.", "Why do we sleep?",
    "What is photosynthesis?", "How do I boil an egg?",
]


def chat(rng, i):
    return {"kind": "chat", "messages": [{"role": "user", "content": TOPICS[i % len(TOPICS)]}]}


def workload():
    rng = random.Random(20261204)
    out = [code_edit(rng, i) for i in range(20)]
    out += [extraction(rng, i) for i in range(15)]
    out += [chat(rng, i) for i in range(15)]
    return {"requests": out}


if __name__ == "__main__":
    text = json.dumps(workload(), indent=1) + "\n"
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        open(sys.argv[2], "w").write(text)
    elif len(sys.argv) == 1:
        sys.stdout.write(text)
    else:
        sys.exit(__doc__)
