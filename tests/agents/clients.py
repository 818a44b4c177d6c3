#!/usr/bin/env python3
"""The clients agents are built on, each with its own defaults, against `strata serve` on a
2-shard route of Qwen2.5-Coder-0.5B-Instruct (Q4_K_M): the OpenAI Agents SDK (Responses API by
default, and its chat-completions model), pydantic-ai, instructor, langchain-openai, the
anthropic SDK (plain, tools, streamed), Codex CLI (`codex exec`) and Claude Code (`claude -p`).

Each case must end with a valid, complete response read by the client's own parser; what the
small model says is not graded. Run by `.ci/run` (which installs the clients); by hand:
    python3 -m venv ~/.cache/strata/venv
    ~/.cache/strata/venv/bin/pip install -r tests/agents/requirements.txt  (pinned versions)
    (cd ~/.cache/strata/npm && npm install @openai/codex @anthropic-ai/claude-code)
    cargo build --release -p strata
    ~/.cache/strata/venv/bin/python tests/agents/clients.py
STRATA_BIN names the binary, STRATA_MODEL the model, STRATA_NPM the folder holding
node_modules (default ~/.cache/strata/npm); CASES=name,name runs some cases only;
STRATA_LONG=1 gives Codex CLI and Claude Code their own long instructions.
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
# Nothing here may reach the internet: the SDKs' telemetry and tracing stay off.
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("STRATA_BIN", os.path.join(ROOT, "target", "release", "strata"))
MODEL = os.environ.get("STRATA_MODEL", "qwen2.5-coder-0.5b")
NPM = os.environ.get("STRATA_NPM", os.path.expanduser("~/.cache/strata/npm"))
KEY = "strata-test-key-0123"
# STRATA_LONG=1: the agent CLIs with their own (long) instructions, as a user runs them.
LONG = os.environ.get("STRATA_LONG") == "1"


class Server:
    """`strata serve` (2 shards) on a free 127.0.0.1 port, with an API key. Requests that give
    no temperature are greedy (`--default-temperature 0`), so every case ends the same way
    every run: Codex sets none, and sampled at the APIs' default of 1 the small model once
    rambled to its 512-token cap (Codex exits 1 on an incomplete response)."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [BIN, "serve", "--model", MODEL, "--shards", "2", "--listen", "127.0.0.1:0", "--api-key", KEY,
             "--default-temperature", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        deadline = time.time() + 300
        self.addr = None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"strata serve exited: {self.proc.wait()}")
            if "strata tracker listening on " in line:
                self.addr = line.split("strata tracker listening on ")[1].split()[0].removeprefix("http://")
                break
        if self.addr is None:
            raise SystemExit("strata serve did not start")
        import openai

        self.model = openai.OpenAI(base_url=self.base(), api_key=KEY).models.list().data[0].id

    def base(self):
        return f"http://{self.addr}/v1"

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


CALLS = []


def weather(city: str) -> str:
    """The weather in a city."""
    CALLS.append(city)
    return f"It is sunny in {city}."


def run_agent(agents, agent, prompt):
    """Runs the agent loop: a final answer, or (a small model may call the tool again and
    again) a loop that ran out of turns after each response was parsed and its call run."""
    CALLS.clear()
    try:
        result = agents.Runner.run_sync(agent, prompt, max_turns=4)
    except agents.exceptions.MaxTurnsExceeded:
        assert len(CALLS) >= 3, f"out of turns with {len(CALLS)} calls run"
        return f"{len(CALLS)} tool calls run, then out of turns"
    assert isinstance(result.final_output, str), result.final_output
    if not result.final_output.strip():
        # The model may end its turn at once (its first token the end of turn): a complete,
        # empty answer. Anything longer must have reached the client as text.
        usage = result.raw_responses[-1].usage
        assert usage.output_tokens <= 1, f"{usage.output_tokens} tokens answered, no text read"
    return f"{result.final_output!r} after {len(CALLS)} tool calls"


def case_openai_agents_responses(s):
    """The Agents SDK as it comes: the Responses API, a function tool (strict schema)."""
    import agents
    import openai

    client = openai.AsyncOpenAI(base_url=s.base(), api_key=KEY, max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agents.set_tracing_disabled(True)
    agent = agents.Agent(
        name="helper",
        instructions="Answer briefly. Use the weather tool when asked about weather.",
        model=s.model,
        tools=[agents.function_tool(weather)],
        model_settings=agents.ModelSettings(max_tokens=96, temperature=0),
    )
    return run_agent(agents, agent, "What is the weather in Paris?")


def case_openai_agents_chat(s):
    """The Agents SDK with its chat-completions model and the same strict tool."""
    import agents
    import openai

    client = openai.AsyncOpenAI(base_url=s.base(), api_key=KEY, max_retries=0)
    agents.set_tracing_disabled(True)
    model = agents.OpenAIChatCompletionsModel(model=s.model, openai_client=client)
    agent = agents.Agent(
        name="helper",
        instructions="Answer briefly. Use the weather tool when asked about weather.",
        model=model,
        tools=[agents.function_tool(weather)],
        model_settings=agents.ModelSettings(max_tokens=96, temperature=0),
    )
    return run_agent(agents, agent, "What is the weather in Rome?")


def case_pydantic_ai(s):
    """pydantic-ai: a tool the agent may call, and structured output."""
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(s.model, provider=OpenAIProvider(base_url=s.base(), api_key=KEY))
    agent = Agent(model, system_prompt="Be brief.", model_settings={"max_tokens": 96, "temperature": 0})

    @agent.tool_plain
    def roll_die() -> str:
        """Roll a six-sided die."""
        return "4"

    text = agent.run_sync("Roll a die and tell me the number.").output
    assert isinstance(text, str) and text.strip(), text

    class City(BaseModel):
        name: str
        country: str

    city = Agent(model, output_type=City, model_settings={"max_tokens": 96, "temperature": 0}).run_sync(
        "Name a city in Italy."
    ).output
    assert isinstance(city, City), city
    return f"{text!r} / {city!r}"


def case_instructor(s):
    """instructor in its tools and JSON-schema modes."""
    import instructor
    import openai
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    out = []
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(openai.OpenAI(base_url=s.base(), api_key=KEY, max_retries=0), mode=mode)
        p = client.chat.completions.create(
            model=s.model,
            response_model=Person,
            max_tokens=96,
            temperature=0,
            max_retries=0,
            messages=[{"role": "user", "content": "Ada Lovelace was 36. Extract the person."}],
        )
        assert isinstance(p, Person), p
        out.append(repr(p))
    return " / ".join(out)


def case_langchain(s):
    """langchain-openai: bind_tools and with_structured_output."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model=s.model, base_url=s.base(), api_key=KEY, max_tokens=96, temperature=0, max_retries=0)
    msg = llm.bind_tools([get_weather]).invoke("What is the weather in Oslo? Use the tool.")
    assert msg.tool_calls or (isinstance(msg.content, str) and msg.content.strip()), msg
    for call in msg.tool_calls:
        assert call["name"] == "get_weather" and isinstance(call["args"], dict), call

    class Capital(BaseModel):
        country: str
        capital: str

    cap = llm.with_structured_output(Capital).invoke("What is the capital of France?")
    assert isinstance(cap, Capital), cap
    return f"{msg.tool_calls or msg.content!r} / {cap!r}"


def case_anthropic(s):
    """The anthropic SDK: a plain message, a tool call answered, and a stream."""
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://{s.addr}", api_key=KEY, max_retries=0)
    m = client.messages.create(
        model=s.model, max_tokens=64, messages=[{"role": "user", "content": "Say hello in French."}]
    )
    assert m.type == "message" and m.content and m.content[0].type == "text", m
    tools = [
        {
            "name": "get_weather",
            "description": "The weather in a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # Greedy: sampled at the API's default temperature the small model sometimes calls the tool
    # for city after city until max_tokens cuts the last call (a CI run saw four calls and a cut
    # fifth). A cut answer is still read: its complete calls are tool_use blocks.
    t = client.messages.create(
        model=s.model, max_tokens=128, tools=tools, tool_choice={"type": "any"}, messages=ask,
        extra_body={"temperature": 0},  # this SDK release takes no temperature argument
    )
    uses = [b for b in t.content if b.type == "tool_use"]
    assert t.stop_reason in ("tool_use", "max_tokens") and uses, t
    assert all(b.name == "get_weather" and isinstance(b.input, dict) for b in uses), t
    follow = client.messages.create(
        model=s.model,
        max_tokens=64,
        tools=tools,
        messages=ask
        + [
            {"role": "assistant", "content": [b.model_dump() for b in t.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]},
        ],
    )
    assert follow.type == "message" and follow.stop_reason in ("end_turn", "max_tokens", "tool_use"), follow
    with client.messages.stream(
        model=s.model, max_tokens=48, messages=[{"role": "user", "content": "Count to five."}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and text.strip(), (text, final)
    n = client.messages.count_tokens(model=s.model, messages=ask).input_tokens
    assert n > 0
    return f"{m.content[0].text!r} / {uses[0].input!r} / {text!r} / {n} tokens"


def workdir():
    d = tempfile.mkdtemp(prefix="strata-agent-")
    with open(os.path.join(d, "calc.py"), "w") as f:
        f.write("def add(a, b):\n    \"\"\"Adds two numbers.\"\"\"\n    return a + b\n")
    return d


def run_cli(argv, env, cwd, timeout=900):
    t = time.time()
    p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    took = time.time() - t
    assert p.returncode == 0, f"exit {p.returncode}\nstdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}"
    return p.stdout, took


def case_codex(s):
    """Codex CLI, non-interactive, with a provider pointing at strata (Responses API), its tools
    as they come. Its built-in instructions (about 6k tokens of manual) are replaced by a short
    file unless STRATA_LONG=1: on a 2-core AVX2 machine the whole prompt took past 900 s to
    answer, on AVX-512 a few minutes; the protocol, the tools and the client's parser are the
    same either way."""
    d = workdir()
    home = tempfile.mkdtemp(prefix="strata-codex-home-")
    env = dict(os.environ, STRATA_KEY=KEY, CODEX_HOME=home)
    provider = f'model_providers.strata={{name="strata",base_url="{s.base()}",wire_api="responses",env_key="STRATA_KEY"}}'
    argv = [os.path.join(NPM, "node_modules", ".bin", "codex"), "exec", "--skip-git-repo-check",
            "-c", "model_provider=strata", "-c", provider, "-m", s.model]
    if not LONG:
        brief = os.path.join(home, "instructions.md")
        with open(brief, "w") as f:
            f.write("You are a coding agent in a terminal. Use the shell tool to look at files when "
                    "you need to, then answer the user briefly.\n")
        argv += ["-c", f"model_instructions_file={json.dumps(brief)}"]
    out, took = run_cli(argv + ["What does calc.py do?"], env, d)
    assert out.strip(), "codex printed no answer"
    return f"{out.strip()[-300:]!r} ({took:.0f} s)"


def case_claude_code(s):
    """Claude Code, non-interactive, against strata's Messages API. Its built-in tools are
    cut to Read: the default set is 21k prompt tokens, which this 2-core machine prefills in
    about 400 s, past Claude Code's stream watchdog. Its system prompt is a short one unless
    STRATA_LONG=1 (with its own, the case took 195 s on a 2-core AVX2 machine)."""
    d = workdir()
    env = dict(
        os.environ,
        ANTHROPIC_BASE_URL=f"http://{s.addr}",
        ANTHROPIC_AUTH_TOKEN=KEY,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        # Greedy and bounded, so the case ends the same way every run: sampled at Claude
        # Code's default temperature the small model once rambled on for minutes
        # (Claude Code asks for up to 32000 tokens).
        CLAUDE_CODE_EXTRA_BODY=json.dumps({"temperature": 0}),
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="400",
        HOME=tempfile.mkdtemp(prefix="strata-claude-home-"),
    )
    argv = [os.path.join(NPM, "node_modules", ".bin", "claude"), "-p", "What does calc.py do?",
            "--model", s.model, "--tools", "Read"]
    if not LONG:
        argv += ["--system-prompt", "You are a coding assistant. Use the Read tool to look at "
                 "files when you need to, then answer briefly."]
    out, took = run_cli(argv, env, d)
    assert out.strip(), "claude printed no answer"
    return f"{out.strip()[-300:]!r} ({took:.0f} s)"


CASES = [
    ("openai-agents (responses)", case_openai_agents_responses),
    ("openai-agents (chat completions)", case_openai_agents_chat),
    ("pydantic-ai", case_pydantic_ai),
    ("instructor", case_instructor),
    ("langchain-openai", case_langchain),
    ("anthropic", case_anthropic),
    ("codex", case_codex),
    ("claude-code", case_claude_code),
]


def main():
    only = [c for c in os.environ.get("CASES", "").split(",") if c]
    s = Server()
    failed = []
    try:
        for name, case in CASES:
            if only and not any(o in name for o in only):
                continue
            t = time.time()
            try:
                got = case(s)
                print(f"ok   {name} ({time.time() - t:.1f} s): {got}", flush=True)
            except Exception:
                failed.append(name)
                print(f"FAIL {name} ({time.time() - t:.1f} s):\n{traceback.format_exc()}", flush=True)
    finally:
        s.stop()
    if failed:
        raise SystemExit(f"{len(failed)} client case(s) failed: {', '.join(failed)}")
    print("every client completed its case")


if __name__ == "__main__":
    main()
