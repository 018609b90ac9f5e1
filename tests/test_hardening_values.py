"""Odd values and slow clients (issue 51, items 5, 6 and the two messages of item 7).

- a temperature so small that x / T overflows (5e-324 is a valid float) gives the T -> 0 limit,
  the likeliest token: the greedy text, in the API, the CLI and the server, never an empty reply;
- the server takes no coerced values ("7" is no seed, true no token id, 5.0 no count), refuses
  top_logprobs (which needs logprobs, which it does not serve), and names a JSON NaN as NaN;
- a client that trickles its request headers gets a 408 and is closed at the client time limit,
  on a real socket against `edgespec serve`;
- a chat whose format alone fills a tiny context is one line up front; a token id of the wrong
  type is called that, not "out of range"."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from edgespec.decoding.sampling import SamplingParams, distribution, probabilities
from edgespec.engine.engine import load
from edgespec.errors import ContextFullError
from tests.test_hardening import cli, one_line_error

for _mod in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod, reason=f"the server tests need {_mod} (pip install 'edgespec[serve,test]')")

import httpx  # noqa: E402

from edgespec.server import ServerConfig, create_app  # noqa: E402
from tests.test_server import KEY, running  # noqa: E402

TINY = (5e-324, 1e-320, 1e-310, 1e-200)
PROMPT = "the cat and the dog"


# -- item 6: temperatures too small to divide by --------------------------------------------

@pytest.mark.parametrize("t", TINY)
@pytest.mark.parametrize("extra", [{}, {"top_k": 5}, {"top_p": 0.5}, {"min_p": 0.2}, {"top_k": 5, "top_p": 0.9}])
def test_a_tiny_temperature_is_the_limit_of_small_ones(t, extra):
    rng = np.random.default_rng(0)
    row = rng.standard_normal(300).astype(np.float32) * 4
    row[17] = row.max() + 0.5  # one likeliest token
    ties = row.copy()
    ties[40] = ties[17]  # two equally likely: the limit shares them
    for logits, likeliest in ((row, {17}), (ties, {17, 40})):
        p = probabilities(logits, SamplingParams(temperature=t, **extra))
        small = probabilities(logits, SamplingParams(temperature=1e-5, **extra))  # every gap > 5e4 T: the limit
        assert np.isfinite(p).all() and set(np.flatnonzero(p)) <= likeliest
        np.testing.assert_array_equal(p, small)  # a nucleus under 0.5 keeps one of two ties, as it should
        d = distribution(logits, SamplingParams(temperature=t, **extra))  # the fast path defers to the reference
        np.testing.assert_array_equal(d.ids, np.flatnonzero(p))
        np.testing.assert_allclose(d.probs, p[d.ids])


@pytest.fixture(scope="module")
def engine(zoo):
    with load(zoo.bundle("llama"), max_context=128) as e:
        yield e


@pytest.mark.parametrize("t", TINY)
def test_the_api_at_a_tiny_temperature_gives_the_greedy_text(engine, t):
    greedy = engine.generate(PROMPT, max_tokens=12, temperature=0.0)
    assert greedy
    for seed in (0, 1, 2):
        assert engine.generate(PROMPT, max_tokens=12, temperature=t, seed=seed) == greedy


def test_the_cli_at_a_tiny_temperature_gives_the_greedy_text(zoo):
    bundle = str(zoo.bundle("llama"))
    greedy = cli("generate", bundle, PROMPT, "--max-tokens", "8", "--temperature", "0")
    tiny = cli("generate", bundle, PROMPT, "--max-tokens", "8", "--temperature", "5e-324", "--seed", "3")
    assert greedy.returncode == tiny.returncode == 0, tiny.stderr
    assert tiny.stdout == greedy.stdout and greedy.stdout.strip()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_rope_frequency_factor_that_is_not_a_positive_number_is_one_line(zoo, tmp_path, bad):
    pytest.importorskip("gguf")
    from gguf import GGUFReader, GGUFWriter

    from edgespec.errors import ExportError
    from edgespec.exporters.sources import load_source
    from tests.test_hardening_gguf import tiny_gguf

    src, dst = tiny_gguf(zoo), tmp_path / "freqs.gguf"
    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), "llama")
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=[int(x) for x in reversed(t.shape)], raw_dtype=t.tensor_type)
    freqs = np.ones(8, dtype=np.float32)
    freqs[3] = bad
    w.add_tensor("rope_freqs.weight", freqs)  # llama 3's long-context factors: every rotation divides by them
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ExportError, match="rope_freqs.weight must hold finite factors > 0") as e:
        load_source(dst)
    assert "\n" not in str(e.value)


# -- item 6: strict request validation --------------------------------------------------------

@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, ServerConfig(model_id="m", api_key=KEY, max_tokens_cap=16, client_timeout_s=2.0))
    with running(app) as url:
        yield url


def post(url: str, path: str, body: str) -> httpx.Response:
    return httpx.post(url + path, content=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


CHAT = '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
COMP = '"prompt": "the cat", "max_tokens": 2'


@pytest.mark.parametrize("path, fields, param, needle", [
    ("/v1/completions", '"seed": "7"', "seed", 'valid integer, got "7"'),
    ("/v1/completions", '"seed": 7.0', "seed", "valid integer, got 7.0"),
    ("/v1/completions", '"seed": true', "seed", "valid integer, got true"),
    ("/v1/completions", '"max_tokens": 2.0', "max_tokens", "valid integer"),
    ("/v1/completions", '"temperature": "0.5"', "temperature", "valid number"),
    ("/v1/completions", '"temperature": true', "temperature", "valid number"),
    ("/v1/completions", '"stream": "true"', "stream", "valid boolean"),
    ("/v1/completions", '"stream": 1', "stream", "valid boolean"),
    ("/v1/completions", '"echo": "yes"', "echo", "valid boolean"),
    ("/v1/completions", '"n": "1"', "n", "valid integer"),
    ("/v1/completions", '"stop": [5]', "stop.0", "valid string, got 5"),
    ("/v1/completions", '"min_p": NaN', "min_p", "finite number, got NaN"),
    ("/v1/completions", '"top_p": NaN', "top_p", "finite number, got NaN"),
    ("/v1/completions", '"temperature": Infinity', "temperature", "finite number, got Infinity"),
    ("/v1/completions", '"temperature": -Infinity', "temperature", "finite number, got -Infinity"),
    ("/v1/completions", '"temperature": 1e999', "temperature", "finite number, got Infinity"),
    ("/v1/completions", '"presence_penalty": NaN', "presence_penalty", "got NaN"),
    ("/v1/completions", '"logit_bias": {"5": NaN}', "logit_bias.5", "got NaN"),
    ("/v1/completions", '"logprobs": "yes"', "logprobs", ""),
    ("/v1/chat/completions", '"top_logprobs": 3', "top_logprobs", "top_logprobs are not supported"),
    ("/v1/chat/completions", '"top_logprobs": 30', "top_logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", '"top_logprobs": "3"', "top_logprobs", "valid integer"),
    ("/v1/chat/completions", '"logprobs": true', "logprobs", "logprobs are not supported"),
    ("/v1/chat/completions", '"max_completion_tokens": "2"', "max_completion_tokens", "valid integer"),
    ("/v1/chat/completions", '"stream_options": {"include_usage": "yes"}', "stream_options.include_usage",
     "valid boolean"),
])
def test_values_of_another_type_or_nan_are_400s_naming_them(server, path, fields, param, needle):
    base = CHAT if "chat" in path else COMP
    r = post(server, path, "{" + base + ", " + fields + "}")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and "\n" not in err["message"], err


@pytest.mark.parametrize("prompt, param, needle", [
    ("[true, 5]", "prompt.0", "valid integer, got true"),
    ("[5, 6.0]", "prompt.1", "valid integer, got 6.0"),
    ('[5, "6"]', "prompt.1", 'valid integer, got "6"'),
    ("[null]", "prompt.0", ""),
])
def test_token_ids_that_are_not_integers_are_400s_naming_the_item(server, prompt, param, needle):
    r = post(server, "/v1/completions", '{"prompt": ' + prompt + ', "max_tokens": 2}')
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_a_chat_message_content_of_another_type_is_a_400(server):
    r = post(server, "/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}')
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content"), r.text


@pytest.mark.parametrize("fields", ['"temperature": 1', '"seed": 7, "top_p": 1', '"temperature": null',
                                    '"logprobs": false, "top_logprobs": 0', '"logprobs": 0', '"min_p": 0'])
def test_plain_json_numbers_and_nulls_still_pass(server, fields):
    r = post(server, "/v1/completions", "{" + COMP + ", " + fields + "}")
    assert r.status_code == 200, r.text


def test_the_server_at_a_tiny_temperature_gives_the_greedy_text(server):
    texts = [post(server, "/v1/completions", "{" + COMP.replace("2", "8") + f', "temperature": {t}, "seed": 1}}')
             for t in ("0", "5e-324", "1e-310")]
    assert all(r.status_code == 200 for r in texts), [r.text for r in texts]
    got = [r.json()["choices"][0]["text"] for r in texts]
    assert got[0] and got[1] == got[0] == got[2]


# -- item 5: a client that trickles its request headers -----------------------------------

@pytest.fixture(scope="module")
def served(zoo):
    """`edgespec serve` as a user starts it, with a 1 s client time limit."""
    proc = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", str(zoo.bundle("llama")), "--port", "0",
                             "--client-timeout", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("edgespec serve: http://127.0.0.1:"), (line, proc.poll() and proc.stderr.read())
        host, port = line.split()[2].removeprefix("http://").removesuffix("/v1").split(":")
        yield host, int(port)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _trickle(sock: socket.socket, data: bytes, every_s: float, limit_s: float) -> tuple[bytes, float]:
    """Send `data` a byte every `every_s`; the reply and when the server closed (or `limit_s`)."""
    t0, reply = time.monotonic(), b""
    sock.settimeout(every_s)
    for b in data:
        try:
            sock.sendall(bytes([b]))
        except OSError:  # closed by the server
            break
        try:
            chunk = sock.recv(4096)
            reply += chunk
            if not chunk:
                break
        except TimeoutError:
            pass
        except OSError:  # reset
            break
        if time.monotonic() - t0 > limit_s:
            break
    return reply, time.monotonic() - t0


def test_a_client_that_trickles_its_headers_gets_a_408_and_is_closed(served):
    heads = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 200
             for _ in range(5)]
    socks = [socket.create_connection(served) for _ in heads]
    replies: list = [None] * len(socks)

    def run(i: int) -> None:
        replies[i] = _trickle(socks[i], heads[i], 0.05, 10)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(socks))]  # five at once, as reported
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for reply, seconds in replies:
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"request_timeout" in reply and seconds < 5
    for s in socks:
        s.close()


def test_an_idle_connection_is_closed_and_a_kept_alive_one_gets_the_same_limit(served):
    idle = socket.create_connection(served, timeout=10)
    t0 = time.monotonic()
    assert idle.recv(100) == b"" and time.monotonic() - t0 < 5  # closed quietly: nothing was asked
    idle.close()
    s = socket.create_connection(served, timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200"), first
    reply, seconds = _trickle(s, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200, 0.05, 10)
    second = (first + reply).split(b"HTTP/1.1 ")[2:]  # the 200's body may arrive after its head
    assert second and second[0].startswith(b"408") and seconds < 5, first + reply
    s.close()


def test_a_slow_reply_is_not_cut_by_the_head_limit(served):
    """The limit is on what the client owes (its head), not on a generation longer than it."""
    url = f"http://{served[0]}:{served[1]}"
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 64, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    assert httpx.get(url + "/health", timeout=10).status_code == 200


# -- item 7: the two messages left from last round -----------------------------------------

def test_a_chat_whose_format_fills_a_tiny_context_is_one_line_before_it_starts(zoo):
    proc = cli("chat", str(zoo.bundle("llama")), "--max-context", "16", "--max-tokens", "4",
               stdin=b"hello there\nsecond\n")
    one_line_error(proc, "chat format takes", "tokens before any message", "no message fits", "--max-context")


def test_the_api_says_the_same_and_keeps_the_message_error_for_long_messages(zoo):
    with load(zoo.bundle("llama"), max_context=16) as e:
        session = e.chat()
        with pytest.raises(ContextFullError, match="no message fits"):
            session.check_room(4)
        with pytest.raises(ContextFullError, match="no message fits"):
            list(session.send("hello", max_tokens=4))
        assert session.messages == []  # the turn did not happen
    with load(zoo.bundle("llama"), max_context=300) as e:
        session = e.chat()
        session.check_room(4)  # room for a message
        with pytest.raises(ContextFullError, match="the message is too long"):
            list(session.send("word " * 400, max_tokens=4))
        assert list(session.send("hello", max_tokens=2))  # and the chat goes on


def test_a_system_prompt_that_fills_the_context_is_named_too(zoo):
    with load(zoo.bundle("qwen2"), max_context=64) as e:  # a chat template, short framing
        session = e.chat(system="be brief " * 80)
        with pytest.raises(ContextFullError, match="chat format and the system prompt take"):
            session.check_room(4)
    proc = cli("chat", str(zoo.bundle("qwen2")), "--max-context", "64", "--system", "be brief " * 80,
               stdin=b"hi\n")
    one_line_error(proc, "and the system prompt take")


def test_a_second_request_to_a_served_model_still_works_after_a_refused_one(server):
    assert post(server, "/v1/completions", "{" + COMP + ', "seed": "7"}').status_code == 400
    r = post(server, "/v1/completions", "{" + COMP + ', "seed": 7}')
    assert r.status_code == 200 and json.loads(r.text)["choices"][0]["text"] is not None
