"""The OpenAI-compatible server, run by uvicorn on a loopback port and driven by a real HTTP
client (httpx) and by the official `openai` package: plain and streamed replies on both
endpoints equal the engine's own greedy output, concurrent requests all complete in arrival
order, bad requests get OpenAI-shaped 4xx errors, the API key is enforced, and a client that
leaves mid-reply frees the engine."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_mod, reason=f"the server tests need {_mod} (pip install 'edgespec[serve,test]')")

import httpx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402

from edgespec.engine.engine import load  # noqa: E402
from edgespec.server import ServerConfig, create_app  # noqa: E402
from tests.tiny import LONG_PROMPT, PROMPTS  # noqa: E402
from tests.zoo import DISAGREEING  # noqa: E402

MODEL = "tiny-qwen2"
KEY = "sk-test-123"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello world"}]


@contextmanager
def running(app):
    """Serve `app` with uvicorn on a free loopback port in a thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


@pytest.fixture(scope="module")
def engine(zoo):
    """A chat model (ChatML template) with a draft that is often rejected, so caches roll back."""
    with load(zoo.bundle("qwen2", DISAGREEING), k=3, drafter="model") as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, ServerConfig(model_id=MODEL))
    with running(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def keyed(engine):
    """A second server on the same engine that wants an API key."""
    with running(create_app(engine, ServerConfig(model_id=MODEL, api_key=KEY))) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference_chat(engine, messages=MESSAGES, max_tokens=12) -> str:
    """What the engine itself answers, greedily."""
    return engine.generate(engine.tokenizer.encode_chat(messages), max_tokens=max_tokens, wait=True)


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE response, and "[DONE]"."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return out


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# -- endpoints -----------------------------------------------------------------------------

def test_models_and_health(server):
    url, _ = server
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"
    assert httpx.get(f"{url}/v1/models/{MODEL}").json()["id"] == MODEL
    assert_openai_error(httpx.get(url + "/v1/models/gpt-4"), 404, "model", "model_not_found")
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["queued"] == 0


def test_chat_completion_equals_the_engine(server, engine):
    url, _ = server
    ref = reference_chat(engine)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-") and out["model"] == MODEL
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ref}
    assert choice["finish_reason"] == "length"
    prompt = len(engine.tokenizer.encode_chat(MESSAGES))
    usage = dict(out["usage"])
    note = usage.pop("edgespec", None)  # only where the probe refused drafting on this machine
    assert usage == {"prompt_tokens": prompt, "completion_tokens": 12, "total_tokens": prompt + 12}
    assert note == (None if engine.opened.inexact_refusal is None else engine.opened.speculation())


def test_chat_stream_equals_the_engine(server, engine):
    url, _ = server
    ref = reference_chat(engine)
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert "".join(content) == ref and len([c for c in content if c]) > 1  # streamed in pieces
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_completions_plain_and_streamed_equal_the_engine(server, engine):
    url, _ = server
    ref = engine.generate(LONG_PROMPT, max_tokens=20, wait=True)
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 20, "temperature": 0}
    out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == ref
    assert out["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(LONG_PROMPT))
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and "usage" not in events[-2]  # usage only when asked for
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ref
    # token ids work as the prompt too
    ids = engine.tokenizer.encode(LONG_PROMPT)
    out = httpx.post(url + "/v1/completions", json={**body, "prompt": ids}, timeout=60).json()
    assert out["choices"][0]["text"] == ref


def test_stop_strings_and_default_length(server, engine):
    url, _ = server
    full = engine.generate(PROMPTS[1], max_tokens=16, wait=True)
    stop = full[6:9]
    body = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "stop": stop}
    out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert out["choices"][0] == {"index": 0, "text": full[: full.find(stop)], "logprobs": None, "finish_reason": "stop"}
    # OpenAI's default for /v1/completions is 16 tokens; null means "not set"
    out = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[1], "temperature": 0, "max_tokens": None,
                                                    "stop": None, "seed": None}, timeout=60).json()
    assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["text"] == full


def test_the_openai_package(client, engine):
    ref = reference_chat(engine)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert out.choices[0].message.content == ref and out.usage.completion_tokens == 12
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 12

    cref = engine.generate(LONG_PROMPT, max_tokens=10, wait=True)
    out = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=10, temperature=0)
    assert out.choices[0].text == cref and out.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=10, temperature=0, stream=True))
    assert text == cref
    assert [m.id for m in client.models.list()] == [MODEL]


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0.9, top_p=0.95)
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert client.completions.create(seed=7, **kw).choices[0].text == a
    assert len({client.completions.create(seed=s, **kw).choices[0].text for s in range(4)}) > 1


def test_twenty_concurrent_requests_all_complete(server, engine):
    url, app = server
    chat_ref = reference_chat(engine, max_tokens=10)
    text_ref = engine.generate(LONG_PROMPT, max_tokens=10, wait=True)
    done_before = app.state.worker.completed

    async def run():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async def chat(i):
                if i % 2:
                    s = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                                              temperature=0, stream=True)
                    return "chat", "".join([c.choices[0].delta.content or "" async for c in s])
                r = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
                return "chat", r.choices[0].message.content

            async def text(i):
                r = await http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 10,
                                                             "temperature": 0})
                assert r.status_code == 200, r.text
                return "text", r.json()["choices"][0]["text"]

            return await asyncio.gather(*(chat(i) if i % 3 else text(i) for i in range(20)))

    results = asyncio.run(run())
    assert len(results) == 20
    assert all(out == (chat_ref if kind == "chat" else text_ref) for kind, out in results), results
    assert app.state.worker.completed - done_before == 20


# -- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 3}, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "seed": -1}, "seed"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools.0.function"),
    ("/v1/chat/completions", {"messages": MESSAGES, "frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": ["one", "two"]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"max_tokens": 5}, "prompt"),
])
def test_bad_requests_get_openai_shaped_400s(server, path, body, param):
    url, _ = server
    for stream in (False, True):  # a streamed request fails before its stream starts
        assert_openai_error(httpx.post(url + path, json={**body, "stream": stream}, timeout=30), 400, param)


def test_malformed_bodies_and_unknown_routes(server):
    url, _ = server
    bad_json = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(bad_json, 400)
    assert_openai_error(httpx.post(url + "/v1/completions", json=["a", "list"]), 400)
    assert_openai_error(httpx.get(url + "/v1/nowhere"), 404)
    assert_openai_error(httpx.get(url + "/v1/completions"), 405)


def test_chat_on_a_model_without_a_template_uses_a_transcript(zoo):
    # the transcript's rendering and stop strings: tests/test_chat_formats.py
    with load(zoo.bundle("llama", DISAGREEING)) as e, running(create_app(e)) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200


def test_the_api_key_is_enforced(keyed, engine):
    body = {"prompt": "the cat", "max_tokens": 4, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY},
                    {"Authorization": f"Bearer  {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
        assert_openai_error(httpx.post(keyed + "/v1/completions", json=body, headers=headers), 401,
                            code="invalid_api_key")
        assert_openai_error(httpx.get(keyed + "/v1/models", headers=headers), 401)
    # authentication comes before validation: no hints for strangers
    assert_openai_error(httpx.post(keyed + "/v1/completions", json={}), 401)
    ok = httpx.post(keyed + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["text"] == engine.generate("the cat", max_tokens=4, wait=True)
    assert httpx.get(keyed + "/health").status_code == 200  # health checks need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=keyed + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL, **body).choices[0].text == ok.json()["choices"][0]["text"]


# -- queueing and cancellation --------------------------------------------------------------

@pytest.fixture
def slow_engine(engine, monkeypatch):
    """Each target forward takes >= 15 ms, so a long reply lasts seconds."""
    forward = engine.target.forward

    def slow(token_ids, n_logits=1):
        time.sleep(0.015)
        return forward(token_ids, n_logits)

    monkeypatch.setattr(engine.target, "forward", slow)
    return engine


def wait_idle(app, engine, timeout=10.0) -> float:
    t0 = time.monotonic()
    while engine.busy or app.state.worker.current is not None or app.state.worker.queued:
        assert time.monotonic() - t0 < timeout, "the generation was not cancelled"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_a_client_that_leaves_mid_stream_frees_the_engine(server, slow_engine):
    url, app = server
    engine = slow_engine
    cancelled = app.state.worker.cancelled
    body = {"prompt": LONG_PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # the first piece of text: now hang up
    wait_idle(app, engine)
    assert app.state.worker.cancelled == cancelled + 1
    assert engine.last_stats.new_tokens < 400
    # the caches were rewound: the next request answers as a fresh engine would
    out = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 12}, timeout=60).json()
    assert out["choices"][0]["text"] == engine.generate(LONG_PROMPT, max_tokens=12, wait=True)


def test_a_client_that_times_out_on_a_plain_request_frees_the_engine(server, slow_engine):
    url, app = server
    engine = slow_engine
    cancelled = app.state.worker.cancelled
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 400, "temperature": 0},
                   timeout=1.0)
    wait_idle(app, engine)
    assert app.state.worker.cancelled == cancelled + 1 and engine.last_stats.new_tokens < 400


def test_a_client_that_leaves_while_queued_is_skipped(server, slow_engine, monkeypatch):
    url, app = server
    engine = slow_engine
    started: list[int] = []
    stream_ids = engine.stream_ids
    monkeypatch.setattr(engine, "stream_ids", lambda tokens, *a, **kw: started.append(len(tokens)) or
                        stream_ids(tokens, *a, **kw))
    cancelled = app.state.worker.cancelled
    first = threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                             kwargs=dict(json={"prompt": LONG_PROMPT, "max_tokens": 120, "temperature": 0}, timeout=60))
    first.start()
    while not started:
        time.sleep(0.005)
    body = {"messages": MESSAGES, "max_tokens": 40, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert json.loads(next(r.iter_lines())[6:])["choices"][0]["delta"]["role"] == "assistant"  # sent at once
        assert app.state.worker.queued == 1
    first.join(60)
    wait_idle(app, engine)
    assert len(started) == 1 and app.state.worker.cancelled == cancelled + 1  # the chat never ran


def test_requests_are_served_in_arrival_order(server, slow_engine, monkeypatch):
    url, app = server
    engine = slow_engine
    started: list[int] = []
    stream_ids = engine.stream_ids

    def spy(tokens, *args, **kw):
        started.append(len(tokens))
        return stream_ids(tokens, *args, **kw)

    monkeypatch.setattr(engine, "stream_ids", spy)
    # prompts of distinct lengths name the requests; each is sent once the previous one queued
    prompts = [" ".join(["the cat"] * (n + 1)) for n in range(5)]
    lengths = [len(engine.tokenizer.encode(p)) for p in prompts]
    results: dict[int, str] = {}

    def send(i):
        r = httpx.post(url + "/v1/completions", json={"prompt": prompts[i], "max_tokens": 8, "temperature": 0},
                       timeout=60)
        results[i] = r.json()["choices"][0]["text"]

    threads = []
    for i in range(len(prompts)):
        threads.append(threading.Thread(target=send, args=(i,)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while len(started) + app.state.worker.queued < i + 1:  # running or waiting
            assert time.monotonic() < deadline
            time.sleep(0.005)
    for t in threads:
        t.join(60)
    assert started == lengths
    assert len(results) == len(prompts)


def test_a_full_queue_answers_503(engine, slow_engine):
    app = create_app(engine, ServerConfig(model_id=MODEL, max_queue=1))
    with running(app) as url:
        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 20})
                                              for _ in range(4)))

        results = asyncio.run(burst())
    statuses = sorted(r.status_code for r in results)
    busy = [r for r in results if r.status_code == 503]
    assert statuses[0] == 200 and statuses[-1] == 503
    assert busy and busy[0].headers["retry-after"] == "1"
    assert_openai_error(busy[0], 503, code="queue_full")
