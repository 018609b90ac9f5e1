"""Hostile requests to `edgespec serve` (issue 27): every one gets an OpenAI-shaped 4xx before
anything streams, never a 500 or a traceback; a pathological chat template, a stalled client or
a slow tokenization does not freeze the server; and a fuzz test sends random bodies."""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai", "hypothesis"):
    pytest.importorskip(_mod, reason=f"the server hardening tests need {_mod} (pip install 'edgespec[serve,test]')")

import httpx  # noqa: E402
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgespec.bundle import MANIFEST  # noqa: E402
from edgespec.engine.engine import load  # noqa: E402
from edgespec.errors import ConfigError  # noqa: E402
from edgespec.server import ServerConfig, create_app  # noqa: E402
from edgespec.server.guard import RequestGuard  # noqa: E402
from tests.test_server import KEY, MESSAGES, assert_openai_error, running, sse_events  # noqa: E402
from tests.zoo import DISAGREEING  # noqa: E402

CONTEXT = 64
CAP = 8  # --max-tokens-cap of the servers here, so a fuzzed request never generates for long


@pytest.fixture(scope="module")
def engine(zoo):
    with load(zoo.bundle("qwen2", DISAGREEING), k=3, drafter="model", max_context=CONTEXT) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    cfg = ServerConfig(model_id="m", api_key=KEY, max_tokens=CAP, max_tokens_cap=CAP, max_request_bytes=4096,
                       client_timeout_s=1.0)
    app = create_app(engine, cfg)
    with running(app) as url:
        yield url, app


AUTH = {"Authorization": f"Bearer {KEY}"}


def post(url: str, path: str, body, headers=AUTH, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={**headers, "Content-Type": "application/json"},
                          timeout=30, **kw)
    return httpx.post(url + path, json=body, headers=headers, timeout=30, **kw)


# -- item 10: the key first; the configured key stripped, the header matched exactly -----------

def test_the_key_is_checked_before_the_body_is_parsed(server):
    url, _ = server
    for body in (b"{not json", b"\xff\xfe", b"x" * 10_000):
        assert_openai_error(post(url, "/v1/completions", body, headers={}), 401, code="invalid_api_key")


def test_a_configured_key_is_stripped_but_the_header_must_match_exactly(engine):
    cfg = ServerConfig(api_key="  secret-1 \n")  # as read from a file or an environment variable
    assert cfg.api_key == "secret-1"
    with running(create_app(engine, cfg)) as url:
        body = {"prompt": "the cat", "max_tokens": 2}
        ok = post(url, "/v1/completions", body, headers={"Authorization": "Bearer secret-1"})
        assert ok.status_code == 200, ok.text
        for auth in ("Bearer  secret-1", "Bearer   secret-1", "Bearer\tsecret-1", "Bearer secret-1x", "Bearersecret-1"):
            assert_openai_error(post(url, "/v1/completions", body, headers={"Authorization": auth}), 401,
                                code="invalid_api_key")


def _guard_status(auth: bytes, key: str = "secret-1") -> int:
    """The status RequestGuard answers for an Authorization header, given byte for byte (an
    HTTP parser may trim the spaces around a header before the app sees it; the guard must not
    rely on that)."""
    sent: list[dict] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    guard = RequestGuard(app, api_key=key, max_body=100, client_timeout_s=5.0)
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": [(b"authorization", auth)]}
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize("auth, status", [
    (b"Bearer secret-1", 200), (b"bearer secret-1", 200), (b"BEARER secret-1", 200),  # the scheme's case is free
    (b"Bearer secret-1 ", 401), (b"Bearer secret-1\n", 401), (b"Bearer secret-1\r\n", 401),
    (b"Bearer  secret-1", 401), (b" Bearer secret-1", 401), (b"Bearer\tsecret-1", 401),
    (b"Bearer secret-", 401), (b"Bearer secret-12", 401), (b"Bearer ", 401), (b"", 401), (b"secret-1", 401),
])
def test_the_key_is_the_exact_token_after_bearer(auth, status):
    assert _guard_status(auth) == status


@pytest.mark.parametrize("kw, needle", [
    (dict(api_key="two words"), "without spaces"), (dict(api_key=" \t"), "must not be empty"),
    (dict(max_request_bytes=0), "max_request_bytes"), (dict(max_request_bytes="lots"), "--max-request-size"),
    (dict(max_tokens=600, max_tokens_cap=512), "must not exceed"), (dict(max_tokens=0), "--max-tokens"),
    (dict(port=70000), "--port"), (dict(max_queue=True), "--max-queue"), (dict(host=""), "--host"),
    (dict(template_timeout_s=0), "template_timeout_s"), (dict(client_timeout_s=float("nan")), "client_timeout_s"),
])
def test_bad_server_settings_are_config_errors(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        ServerConfig(**kw)


# -- items 2, 3: size caps -----------------------------------------------------------------

def test_a_body_over_the_cap_is_a_413(server):
    url, _ = server
    body = {"prompt": "x" * 5000, "max_tokens": 2}
    assert_openai_error(post(url, "/v1/completions", body), 413, code="request_too_large")

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(url + "/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert_openai_error(r, 413, code="request_too_large")


def test_server_settings_are_stored_parsed():
    assert ServerConfig().max_tokens == 512 and ServerConfig().max_request_bytes == 1 << 20
    assert ServerConfig(max_tokens_cap=100).max_tokens == 100  # the chat default stays within the cap
    assert ServerConfig(max_tokens=7, max_tokens_cap=100).max_tokens == 7
    assert ServerConfig(max_request_bytes="4KiB").max_request_bytes == 4096


def test_replies_without_max_tokens_get_the_endpoints_default_within_the_cap(server, engine):
    url, _ = server  # --max-tokens and --max-tokens-cap are CAP here, below OpenAI's 16 for completions
    chat = post(url, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0})
    assert chat.status_code == 200, chat.text
    reference = engine.generate(engine.tokenizer.encode_chat(MESSAGES), max_tokens=CAP, wait=True)
    assert chat.json()["choices"][0]["message"]["content"] == reference
    text = post(url, "/v1/completions", {"prompt": "the cat", "temperature": 0})
    assert text.status_code == 200, text.text
    assert text.json()["choices"][0]["text"] == engine.generate("the cat", max_tokens=CAP, wait=True)
    assert text.json()["usage"]["completion_tokens"] == engine.last_stats.new_tokens <= CAP


def test_max_tokens_over_the_cap_is_a_400(server):
    url, _ = server
    r = post(url, "/v1/completions", {"prompt": "the cat", "max_tokens": CAP + 1})
    assert f"at most {CAP}" in assert_openai_error(r, 400, "max_tokens", "max_tokens_exceeded")["message"]
    r = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10_000})
    assert_openai_error(r, 400, "max_tokens", "max_tokens_exceeded")


# -- item 4: bytes that are not text -------------------------------------------------------

def test_invalid_utf8_is_a_400(server):
    url, _ = server
    r = post(url, "/v1/completions", b'{"prompt": "caf\xe9", "max_tokens": 2}')
    assert "0xe9" in assert_openai_error(r, 400, code="invalid_encoding")["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a \\ud800 b"}, "prompt"),
    ("/v1/completions", {"prompt": ["\\udfff"]}, "prompt.0"),
    ("/v1/completions", {"prompt": "ok", "stop": "\\ud83d"}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]},
     "messages.0.content.0.text"),
])
def test_lone_surrogates_are_400s(server, path, body, param):
    url, _ = server
    raw = json.dumps(body).replace("\\\\u", "\\u")  # a JSON escape of a lone surrogate, as a client may send
    err = assert_openai_error(post(url, path, raw.encode()), 400, param)
    assert "lone surrogate" in err["message"]


# -- item 5: the context, before streaming -------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_a_400_before_streaming(server, stream):
    url, _ = server
    long = " ".join(["word"] * 200)
    for path, body, param in (("/v1/completions", {"prompt": long}, "prompt"),
                              ("/v1/completions", {"prompt": list(range(3, CONTEXT + 3))}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages")):
        r = post(url, path, {**body, "max_tokens": 2, "stream": stream})
        assert r.headers["content-type"].startswith("application/json")
        err = assert_openai_error(r, 400, param, "context_length_exceeded")
        assert f"holds {CONTEXT} tokens" in err["message"]


def test_an_empty_prompt_is_a_400(server):
    url, _ = server
    for prompt in ("", [""]):
        assert_openai_error(post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2}), 400, "prompt")


# -- item 3 and 10: the event loop stays free; stalled clients are dropped -------------------

def test_tokenizing_runs_off_the_event_loop(engine, monkeypatch):
    encode = engine.tokenizer.encode

    def slow(text, *a, **kw):
        time.sleep(1.5)  # a multi-megabyte prompt
        return encode(text, *a, **kw)

    monkeypatch.setattr(engine.tokenizer, "encode", slow)
    with running(create_app(engine, ServerConfig(max_tokens=CAP, max_tokens_cap=CAP))) as url:
        done = []
        t = threading.Thread(target=lambda: done.append(
            (post(url, "/v1/completions", {"prompt": "the cat", "max_tokens": 2}).status_code, time.monotonic())))
        t.start()
        time.sleep(0.3)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        health = time.monotonic()
        t.join(30)
        assert done[0][0] == 200 and health < done[0][1] - 0.5  # answered while the tokenizer still ran


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_a_client_that_stalls_mid_body_gets_a_408(server):
    url, _ = server
    s = _raw(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
    t0 = time.monotonic()
    answer = b""
    while chunk := s.recv(65536):  # the server closes the connection after its answer
        answer += chunk
    s.close()
    answer = answer.decode()
    assert answer.startswith("HTTP/1.1 408"), answer
    assert time.monotonic() - t0 < 5 and "request_timeout" in answer


def test_a_client_that_stops_reading_is_dropped():
    """A send the client does not take within the limit ends the response (and so the job)."""
    finished = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        finally:
            finished.append(True)

    async def stuck_send(message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)  # the client's window is full and it never reads

    async def receive():
        return {"type": "http.disconnect"}

    guard = RequestGuard(app, api_key=None, max_body=100, client_timeout_s=0.2)
    t0 = time.monotonic()
    asyncio.run(guard({"type": "http", "method": "GET", "path": "/health", "headers": []}, receive, stuck_send))
    assert finished and time.monotonic() - t0 < 2


# -- item 3: a pathological chat template ----------------------------------------------------

SLOW_TEMPLATE = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x"


@pytest.fixture(scope="module")
def slow_template_bundle(zoo, tmp_path_factory) -> Path:
    out = Path(shutil.copytree(zoo.bundle("qwen2", DISAGREEING), tmp_path_factory.mktemp("tpl") / "bundle"))
    data = json.loads((out / MANIFEST).read_text())
    data["tokenizer"]["chat_template"] = SLOW_TEMPLATE
    (out / MANIFEST).write_text(json.dumps(data))
    return out


def test_a_template_that_never_ends_is_stopped(slow_template_bundle):
    with load(slow_template_bundle, max_context=CONTEXT) as e, \
            running(create_app(e, ServerConfig(template_timeout_s=1.0, max_tokens=CAP, max_tokens_cap=CAP))) as url:
        results, done = [], []

        def chat():
            results.append(post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}, headers={}))
            done.append(time.monotonic())

        t = threading.Thread(target=chat)
        t0 = time.monotonic()
        t.start()
        time.sleep(0.3)
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # the loop is free meanwhile:
        health = time.monotonic()
        t.join(30)
        assert health < done[0] and done[0] - t0 < 10  # /health answered while the template still ran
        err = assert_openai_error(results[0], 500, "messages", "template_timeout")
        assert "did not render within 1 s" in err["message"]
        # the next requests are served: completions at once, chat again within its limit
        assert post(url, "/v1/completions", {"prompt": "the cat", "max_tokens": 2}, headers={}).status_code == 200
        assert_openai_error(post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}, headers={}),
                            500, code="template_timeout")


def test_ctrl_c_stops_a_server_stuck_in_a_template(slow_template_bundle):
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", str(slow_template_bundle), "--port", "0",
                             "--template-timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("edgespec serve: http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        base = line.split()[2].removesuffix("/v1")
        threading.Thread(target=lambda: _ignore(post, base, "/v1/chat/completions", {"messages": MESSAGES},
                                                headers={}), daemon=True).start()
        time.sleep(1.0)  # the template is rendering now
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ignore(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except httpx.HTTPError:
        pass


def test_serve_flags_for_the_caps_are_one_line(zoo):
    for args, needle in ((["--max-request-size", "lots"], "--max-request-size"),
                         (["--max-tokens", "100", "--max-tokens-cap", "50"], "must not exceed"),
                         (["--template-timeout", "0"], "template_timeout")):
        proc = subprocess.run([sys.executable, "-m", "edgespec", "serve", str(zoo.bundle("qwen2", DISAGREEING)),
                               *args], capture_output=True, text=True, timeout=120)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


# -- the fuzz test -------------------------------------------------------------------------------

_SCALAR = (st.none() | st.booleans() | st.integers(-2**65, 2**65) | st.floats()
           | st.text(max_size=20) | st.sampled_from(["\ud800", "user", "assistant", "system", "text", ""]))
_JSON = st.recursive(_SCALAR, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids,
                                                                                         max_size=4), max_leaves=12)
_FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop",
           "seed", "stream", "stream_options", "n", "logprobs", "tools", "response_format", "echo", "suffix",
           "best_of", "model", "logit_bias", "presence_penalty"]
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", 3]),
                                  "content": _JSON | st.text(max_size=30)})
# near-valid requests: these reach tokenization and generation (ranges a little past the limits)
_PARAMS = {"max_tokens": st.integers(-1, CAP + 1), "temperature": st.floats(-0.5, 2.5), "top_p": st.floats(-0.2, 1.2),
           "top_k": st.integers(-1, 40), "seed": st.integers(-1, 2**64), "stream": st.booleans(),
           "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5),
           "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
_TEXT = st.text(max_size=60) | st.text(st.characters(codec="utf-8"), max_size=20)
_BODY = st.one_of(
    st.fixed_dictionaries({"prompt": _TEXT | st.lists(st.integers(-2, 600), min_size=1, max_size=70)},
                          optional=_PARAMS),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": _TEXT}),
        min_size=1, max_size=3)}, optional=_PARAMS),
    _JSON,
    st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6),
    st.fixed_dictionaries({"prompt": st.text(max_size=40) | st.lists(st.integers(-5, 2**40), max_size=8)},
                          optional={k: _JSON for k in _FIELDS[2:]}),
    st.fixed_dictionaries({"messages": st.lists(_MESSAGE, max_size=3)}, optional={k: _JSON for k in _FIELDS[2:]}),
)


@pytest.fixture(scope="module")
def fuzz_server(zoo):
    """A server with the backend's full context, so near-valid requests reach generation."""
    with load(zoo.bundle("qwen2", DISAGREEING), k=3, drafter="model") as e, \
            running(create_app(e, ServerConfig(max_tokens=CAP, max_tokens_cap=CAP, max_request_bytes=4096))) as url:
        yield url


def _encode(body) -> bytes:
    # ensure_ascii: a lone surrogate travels as its JSON escape, as a client's would
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()  # NaN and Infinity too, as a hostile client may


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=_BODY, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       junk=st.one_of(st.none(), st.binary(max_size=40)))
def test_fuzz_random_bodies_never_get_a_5xx(fuzz_server, body, path, junk):
    url = fuzz_server
    raw = junk if junk is not None else _encode(body)
    if isinstance(body, dict) and junk is None and set(body) & {"prompt", "messages"}:  # the endpoint it was made for
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = post(url, path, raw, headers={})
    event(f"status {r.status_code}")  # --hypothesis-show-statistics: how many got through to generation
    assert r.status_code < 500, (r.status_code, r.text, raw)
    if r.status_code >= 400:
        assert set(r.json()) == {"error"}, r.text
    elif "text/event-stream" in r.headers["content-type"]:
        events = sse_events(r)
        assert events[-1] == "[DONE]", events


# -- item 10: shutdown is bounded ----------------------------------------------------------------

def test_stopping_the_server_does_not_wait_forever_for_a_stuck_generation(zoo, monkeypatch, caplog):
    from edgespec.cli.serve import _closing

    engine = load(zoo.bundle("qwen2", DISAGREEING), drafter="none")
    forward, release = engine.target.forward, threading.Event()

    def stuck(token_ids, n_logits=1):  # a backend call that does not come back (a hung device)
        release.wait(30)
        return forward(token_ids, n_logits)

    monkeypatch.setattr(engine.target, "forward", stuck)
    t = threading.Thread(target=lambda: engine.generate("the cat", max_tokens=4, wait=True), daemon=True)
    t.start()
    while not engine.busy:
        time.sleep(0.01)
    t0 = time.monotonic()
    with _closing(engine, 0.3):
        pass
    assert time.monotonic() - t0 < 2 and "did not stop within 0.3 s" in caplog.text
    release.set()
    t.join(30)
    engine.close()
    assert engine.closed


def test_a_template_error_is_a_400_and_the_renderer_stays_in_step(zoo, tmp_path):
    """raise_exception in a template is the client's 400; a render cancelled half-way (its
    request gone) never hands its answer to the next request."""
    from edgespec.server.render import ChatRenderer

    out = Path(shutil.copytree(zoo.bundle("qwen2", DISAGREEING), tmp_path / "bundle"))
    data = json.loads((out / MANIFEST).read_text())
    data["tokenizer"]["chat_template"] = ("{% if messages[0]['content'] == 'slow' %}{% for a in range(100000) %}"
                                          "{% for b in range(300) %}{% endfor %}{% endfor %}{% endif %}"
                                          "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}"
                                          "{% endif %}{{ messages[0]['content'] }}")
    (out / MANIFEST).write_text(json.dumps(data))

    async def scenario():
        r = ChatRenderer(out, timeout_s=30)
        await r.start()
        with pytest.raises(ConfigError, match="no system"):
            await r.prompt([{"role": "system", "content": "x"}], [])
        slow = asyncio.create_task(r.prompt([{"role": "user", "content": "slow"}], []))
        await asyncio.sleep(0.3)
        slow.cancel()  # its client left while it rendered
        fast = await r.prompt([{"role": "user", "content": "fast"}], [])
        await r.close()
        return fast

    with load(out) as e:
        assert asyncio.run(scenario()).tokens == e.tokenizer.encode("fast", add_special_tokens=False)
