"""Oversized uploads to `edgespec serve` (issue 43): the real OpenAI client gets the 413 (or the
401) as an `APIStatusError`, never a connection error. The server answers, then reads and throws
away the rest of the body (bounded in bytes and time) before it closes: closing with unread bytes
makes the kernel reset the connection, which loses the reply a client that writes its whole body
first has not read yet."""
from __future__ import annotations

import socket
import time

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_mod, reason=f"the upload tests need {_mod} (pip install 'edgespec[serve,test]')")

import httpx  # noqa: E402
import openai  # noqa: E402

from edgespec.engine.engine import load  # noqa: E402
from edgespec.server import ServerConfig, create_app  # noqa: E402
from edgespec.server.guard import DRAIN_MAX_BYTES  # noqa: E402
from tests.test_server import KEY, assert_openai_error, running  # noqa: E402
from tests.zoo import DISAGREEING  # noqa: E402

CAP = 4096  # --max-request-size of the server here
TIMEOUT = 1.0  # --client-timeout: also the time a refused body is drained for
# Bodies past the cap; the big ones outgrow the sockets' buffers on loopback, where an early
# close used to reset about one request in five.
SIZES = (5_000, 300_000, 24_000_000)


@pytest.fixture(scope="module")
def server(zoo):
    cfg = ServerConfig(model_id="m", api_key=KEY, max_tokens=4, max_tokens_cap=4, max_request_bytes=CAP,
                       client_timeout_s=TIMEOUT)
    with load(zoo.bundle("qwen2", DISAGREEING), drafter="none") as e, running(create_app(e, cfg)) as url:
        yield url


def _outcomes(url: str, sizes, key: str = KEY) -> dict[str, int]:
    """Send one completion request with a prompt of each size through the OpenAI SDK (no retries,
    so a reset is counted, not hidden); counts of what came back."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    counts: dict[str, int] = {}
    for size in sizes:
        try:
            client.completions.create(model="m", prompt="x" * size, max_tokens=2)
            outcome = "success"
        except openai.APIStatusError as e:
            outcome = f"{e.status_code} {(e.body or {}).get('code')}"
        except openai.APIConnectionError as e:
            outcome = f"connection error: {type(e).__name__}"
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def test_the_openai_client_gets_every_413(server):
    n = 4 * len(SIZES)
    assert _outcomes(server, SIZES * 4) == {"413 request_too_large": n}


def test_the_openai_client_gets_the_401_of_a_big_body_without_the_key(server):
    assert _outcomes(server, SIZES * 2, key="wrong") == {"401 invalid_api_key": 2 * len(SIZES)}


@pytest.mark.slow
def test_469_oversized_requests_all_get_a_413(server):
    sizes = [SIZES[i % 3] if i % 7 else 48_000_000 for i in range(469)]
    assert _outcomes(server, sizes) == {"413 request_too_large": 469}


def test_a_big_chunked_body_is_cut_at_the_cap_and_answered(server):
    def chunks():  # no Content-Length: the server counts as it reads
        for _ in range(3000):
            yield b" " * 8192

    r = httpx.post(server + "/v1/completions", content=chunks(), headers={"Authorization": f"Bearer {KEY}"},
                   timeout=30)
    assert_openai_error(r, 413, code="request_too_large")


def _raw(url: str, head: bytes, body: bytes = b"") -> tuple[bytes, float]:
    """Send `head` and `body` on a plain socket, then read until the server closes; the reply and
    the seconds the server kept the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body)
        t0, reply = time.monotonic(), b""
        while chunk := s.recv(65536):
            reply += chunk
        return reply, time.monotonic() - t0


def _head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def test_a_client_that_stops_mid_body_after_the_413_is_closed_after_the_time_limit(server):
    reply, held = _raw(server, _head(10 * CAP), b"x" * 100)
    assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply
    assert TIMEOUT * 0.8 < held < TIMEOUT + 3  # drained for the time limit, not forever


def test_a_body_declared_past_the_drain_bound_is_answered_and_closed_at_once(server):
    reply, held = _raw(server, _head(DRAIN_MAX_BYTES + 1))
    assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply
    assert held < TIMEOUT * 0.8


def test_a_client_waiting_for_100_continue_gets_the_413_without_sending(server):
    head = _head(10 * CAP).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")
    reply, held = _raw(server, head)
    assert reply.startswith(b"HTTP/1.1 413") and b"100 Continue" not in reply and held < TIMEOUT * 0.8
