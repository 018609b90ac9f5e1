"""Slow tier: structured output and tool calls on the real default model (a base model, so every
reply is valid only because of the grammar), through `edgespec serve` and the official `openai`
client: the committed suite of extraction, classification and tool-call prompts
(benchmarks/data/structured.jsonl), greedy and sampled; every reply must parse and validate
against its schema. And greedy constrained speculative decoding equals plain on the real model."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

for _mod in ("openai", "jsonschema", "fastapi", "uvicorn"):
    pytest.importorskip(_mod, reason=f"the structured-output tier needs {_mod} (pip install 'edgespec[all]')")

import jsonschema  # noqa: E402
import openai  # noqa: E402

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "structured.jsonl"
MAX_TOKENS = 256
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.95}}


def suite() -> list[dict]:
    return [json.loads(line) for line in SUITE.read_text().splitlines() if line.strip()]


def chat_request(row: dict, mode: str, seed: int) -> dict:
    """The chat request of one suite row: a response_format, or tools and a tool_choice."""
    body = {"model": "default", "messages": [{"role": "user", "content": row["prompt"]}], "max_tokens": MAX_TOKENS,
            "seed": seed, **MODES[mode]}
    if row["kind"] == "tool":
        return {**body, "tools": row["tools"], "tool_choice": row["tool_choice"], "parallel_tool_calls": False}
    fmt = {"type": "json_schema", "json_schema": {"name": row["id"], "schema": row["schema"]}}
    return {**body, "response_format": fmt}


def check_reply(row: dict, choice) -> None:
    """The reply parses and validates: its JSON against the schema, or each call's arguments
    against the called function's parameters (a named tool_choice: that function)."""
    msg = choice.message
    if row["kind"] != "tool":
        jsonschema.validate(json.loads(msg.content), row["schema"])
        return
    assert choice.finish_reason == "tool_calls" and msg.tool_calls, msg
    functions = {t["function"]["name"]: t["function"]["parameters"] for t in row["tools"]}
    named = row["tool_choice"]["function"]["name"] if isinstance(row["tool_choice"], dict) else None
    for call in msg.tool_calls:
        assert call.function.name in functions and named in (None, call.function.name), call
        jsonschema.validate(json.loads(call.function.arguments), functions[call.function.name])


@pytest.fixture(scope="module")
def served(cache_env):
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cache_env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("edgespec serve: http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        yield line.split()[2]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("mode", list(MODES))
def test_every_reply_of_the_suite_validates(served, mode):
    rows = suite()
    assert len(rows) >= 30 and {r["kind"] for r in rows} == {"extract", "classify", "tool"}
    client = openai.OpenAI(base_url=served, api_key="unused", max_retries=0, timeout=300)
    forced = tokens = 0
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        r = client.chat.completions.create(**chat_request(row, mode, seed=i))
        check_reply(row, r.choices[0])
        forced += r.model_extra["timings"]["forced"]
        tokens += r.usage.completion_tokens
    print(f"{mode}: {len(rows)} replies valid, {tokens} tokens, {forced} forced, {time.perf_counter() - t0:.1f} s")
    assert 0.25 * tokens < forced < tokens  # the schemas force much of the text, not all of it


def test_greedy_constrained_speculative_equals_plain(cache_env, monkeypatch):
    from edgespec import ResponseFormat
    from edgespec.engine.engine import load

    monkeypatch.setenv("EDGESPEC_CACHE", cache_env["EDGESPEC_CACHE"])
    rows = [r for r in suite() if r["kind"] != "tool"][::3]
    with load() as spec, load(drafter="none") as plain:
        assert spec.drafter_name is not None
        accepted = 0
        for row in rows:
            fmt = ResponseFormat.json_schema(row["schema"])
            rs = list(spec.chat().send(row["prompt"], max_tokens=MAX_TOKENS, response_format=fmt))
            text = "".join(r.text for r in rs)
            assert text == "".join(r.text for r in plain.chat().send(row["prompt"], max_tokens=MAX_TOKENS,
                                                                      response_format=fmt)), row["id"]
            jsonschema.validate(json.loads(text), row["schema"])
            accepted += rs[-1].stats.accepted
        assert accepted > 0
