"""Structured output and tool calls through the server, driven by the official `openai` package:
response_format (json_object, json_schema) on chat and completions, llama.cpp's `grammar`, tools
with tool_choice auto / none / required / a named function, whole and streamed, in a model's own
tool-call syntax (a Hermes-style template) and in the plain convention (a base model's
transcript); bad schemas, grammars and choices as 400s."""
from __future__ import annotations

import json

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_mod, reason=f"the server tests need {_mod} (pip install 'edgespec[serve,test]')")

import httpx  # noqa: E402
import openai  # noqa: E402

from edgespec.engine.engine import load  # noqa: E402
from edgespec.server import ServerConfig, create_app  # noqa: E402
from tests.test_server import assert_openai_error, running  # noqa: E402
from tests.tiny import make_model  # noqa: E402
from tests.zoo import DISAGREEING  # noqa: E402

ITEM = {"type": "object", "additionalProperties": False, "required": ["word", "count"],
        "properties": {"word": {"type": "string", "maxLength": 8},
                       "count": {"type": "integer", "minimum": 0, "maximum": 99}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                                  "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
ASK = [{"role": "user", "content": "the weather in the city"}]
# a Hermes-style template (Qwen 2.5's tool calling, cut down): tools in the system turn, calls in
# <tool_call> blocks, results in <tool_response> blocks
HERMES = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Return each call as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def long_bundle(root, family: str, template: str | None = None):
    """A tiny model of `family` with a 4096-token context (tool lists are long in its byte-level
    tokens) and its int4 self-draft, which is often rejected."""
    from edgespec.exporters.export import ExportConfig, export_bundle

    src = make_model(family, root / "src", chat_template=template)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return export_bundle(ExportConfig(output=root / "bundle", target=src, draft_precision=DISAGREEING))


@pytest.fixture(scope="module")
def hermes_bundle(tmp_path_factory):
    return long_bundle(tmp_path_factory.mktemp("hermes"), "qwen2", HERMES)


@pytest.fixture(scope="module")
def base_bundle(tmp_path_factory):
    return long_bundle(tmp_path_factory.mktemp("base"), "llama")


@pytest.fixture(scope="module", params=["template", "transcript"])
def served(request, hermes_bundle, base_bundle):
    """A server on a chat model whose template writes Hermes tool calls, and one on a base model
    (a transcript and the plain convention); both draft with a model that is often rejected."""
    bundle = hermes_bundle if request.param == "template" else base_bundle
    with load(bundle, k=3, drafter="both") as engine, running(create_app(engine, ServerConfig(model_id="m"))) as url:
        yield request.param, url, engine


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def item(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"word", "count"} and len(obj["word"]) <= 8 and 0 <= obj["count"] <= 99
    return obj


def streamed(c: openai.OpenAI, **kw) -> tuple[str, list[dict], str]:
    """A streamed chat reply, accumulated as clients do: (text, calls, finish reason)."""
    text, calls, reason = "", {}, None
    for chunk in c.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return text, [calls[i] for i in sorted(calls)], reason


def test_response_formats(served):
    _, url, engine = served
    c = client(url)
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM}}
    for temperature in (0.0, 1.0):
        r = c.chat.completions.create(model="m", messages=ASK, response_format=fmt, temperature=temperature, seed=3,
                                      max_tokens=60)
        item(r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop"
        text, calls, reason = streamed(c, model="m", messages=ASK, response_format=fmt, temperature=temperature,
                                       seed=3, max_tokens=60)
        assert text == r.choices[0].message.content and not calls and reason == "stop"
    try:  # a random tiny model may write an object without end: then the reply is too short for it
        r = c.chat.completions.create(model="m", messages=ASK, response_format={"type": "json_object"}, max_tokens=60)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    except openai.BadRequestError as e:
        assert "max_tokens (60) before it completed a JSON object" in str(e)
    r = c.completions.create(model="m", prompt="the cat", max_tokens=60, extra_body={"response_format": fmt})
    item(r.choices[0].text)
    r = c.completions.create(model="m", prompt="the cat", max_tokens=8,
                             extra_body={"grammar": 'root ::= "the " ("cat" | "dog")'})
    assert r.choices[0].text in ("the cat", "the dog")


def test_tool_choice_required_and_named(served):
    kind, url, _ = served
    c = client(url)
    for choice, names in (("required", {"get_weather", "add"}),
                          ({"type": "function", "function": {"name": "add"}}, {"add"})):
        for temperature in (0.0, 1.0):
            r = c.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                          temperature=temperature, seed=5, max_tokens=80, parallel_tool_calls=False)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
            assert len(msg.tool_calls) == 1 and msg.tool_calls[0].type == "function"
            call = msg.tool_calls[0].function
            assert call.name in names and msg.tool_calls[0].id.startswith("call-")
            args = json.loads(call.arguments)
            assert args.get("city") in ("Paris", "Rome", "Oslo") if call.name == "get_weather" else \
                set(args) == {"a", "b"}
            text, calls, reason = streamed(c, model="m", messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                           temperature=temperature, seed=5, max_tokens=80, parallel_tool_calls=False)
            assert (text, reason) == ("", "tool_calls")
            assert calls == [{"name": call.name, "arguments": call.arguments}]


def test_tool_choice_auto_none_and_history(served):
    kind, url, _ = served
    c = client(url)
    r = c.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0)
    msg = r.choices[0].message
    for call in msg.tool_calls or []:  # the model decides; whatever it calls is well formed
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    assert r.choices[0].finish_reason in ("tool_calls", "stop", "length")
    text, calls, reason = streamed(c, model="m", messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0)
    assert (text, [(x["name"], x["arguments"]) for x in calls]) == \
        (msg.content or "", [(x.function.name, x.function.arguments) for x in msg.tool_calls or []])
    r = c.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=12)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    # a conversation that goes on after a call and its result
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "rain"}]
    r = c.chat.completions.create(model="m", messages=history, tools=[WEATHER], parallel_tool_calls=False,
                                  response_format={"type": "json_schema", "json_schema": {"name": "i", "schema": ITEM}},
                                  max_completion_tokens=150, temperature=0)
    msg = r.choices[0].message
    assert msg.tool_calls or item(msg.content)  # calls again, or answers in the format (the rendering: below)


def test_tool_prompts(hermes_bundle, base_bundle):
    from edgespec.bundle import load_bundle
    from edgespec.engine.session import chat_format_for
    from edgespec.models.tool_calls import Function
    from edgespec.tokenizer import Tokenizer

    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    functions = [Function("get_weather", "The weather in a city", WEATHER["function"]["parameters"])]
    for bundle, syntax in ((hermes_bundle, "hermes"), (base_bundle, "plain")):
        b = load_bundle(bundle)
        tok = Tokenizer(b.file(b.manifest.tokenizer.file), b.manifest.tokenizer, template_timeout_s=None)
        p = chat_format_for(b.manifest, tok).tool_prompt(tok, history, functions)
        text = tok.decode(p.tokens)
        assert p.tool_syntax == syntax
        assert "get_weather" in text and "The weather in a city" in text and "rain" in text
        assert '{"city": "Oslo"}' in text  # the earlier call, as the model would have written it
        if syntax == "plain":
            assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
            assert "get_weather returned: rain" in text
        else:
            assert "<tool_response>\nrain\n</tool_response>" in text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                                         "minimum": 3,
                                                                                         "maximum": 1}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"json_schema": {"type": "string", "minLength": 3, "maxLength": 1}}, "json_schema"),
    ({"json_schema": {"enum": ["x" * 1000] * 300}}, "json_schema"),  # past 256 KiB
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"grammar": 'root ::= "a" | ('}, "grammar"),
    ({"grammar": "root ::= x", "response_format": {"type": "json_object"}}, "grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
])
def test_bad_formats_and_tools_are_400s(served, body, param):
    _, url, _ = served
    for stream in (False, True):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "stream": stream, **body}, timeout=60)
        assert_openai_error(r, 400, param)


def test_a_reply_too_short_for_its_schema(served):
    _, url, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM}}
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "response_format": fmt, "max_tokens": 9},
                   timeout=60)
    err = assert_openai_error(r, 400)
    assert "max_tokens (9)" in err["message"]
    with pytest.raises(openai.APIError, match="max_tokens"):  # streamed: the error arrives as an event
        list(client(url).chat.completions.create(model="m", messages=ASK, response_format=fmt, max_tokens=9,
                                                 stream=True))
