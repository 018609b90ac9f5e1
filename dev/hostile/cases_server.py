"""Hostile requests to a running `edgespec serve` (a child process on the tiny bundle): every one
gets an OpenAI-shaped reply, a 4xx for the client's mistakes; no reset, no hang."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

from fixtures import Fixtures
from outcome import HTTP_4XX, HTTP_REFUSED, SUCCESS, Outcome, case, from_http

__all__ = ["server_cases", "serving"]

KEY = "hostile-key"
CAP = 4096  # --max-request-size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(fx: Fixtures, *flags: str, bundle=None):
    port = _free_port()
    cmd = [sys.executable, "-m", "edgespec", "serve", str(bundle or fx.bundle), "--port", str(port), "--api-key", KEY,
           "--max-request-size", str(CAP), "--max-tokens-cap", "8", "--client-timeout", "2", "--max-context", "64",
           *flags]
    proc = subprocess.Popen(cmd, env=fx.env(), cwd=fx.work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + fx.timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start: {proc.stderr.read().decode()[-500:]}")
        time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


AUTH = {"Authorization": f"Bearer {KEY}"}


def _post(url: str, path: str, body, headers=None, timeout=30.0) -> Outcome:
    import httpx

    headers = AUTH if headers is None else headers
    try:
        if isinstance(body, (bytes, str)) or not isinstance(body, (dict, list)):
            r = httpx.post(url + path, content=body, headers={**headers, "Content-Type": "application/json"},
                           timeout=timeout)
        else:
            r = httpx.post(url + path, json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        return from_http(None, b"", f"{type(e).__name__}: {e}")
    return from_http(r.status_code, r.content)


def _raw(url: str, data: bytes, wait_s: float) -> Outcome:
    """Send `data` on a socket and wait for the reply (a stalled client)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(data)
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except TimeoutError:
            return Outcome("hang", f"no reply within {wait_s:g} s")
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head.startswith(b"HTTP/") else None
    return from_http(status, body, "closed without a reply")


def _keyed(url: str, auth: str) -> Outcome:
    """A completion request with this Authorization value, byte for byte (httpx refuses to send
    some of them)."""
    body = b'{"prompt": "the cat", "max_tokens": 2}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return _raw(url, head.encode() + body, 60)


def _openai_oversized(n: int):
    def run(url: str) -> Outcome:
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        counts: dict[str, int] = {}
        for i in range(n):
            size = (5_000, 300_000, 24_000_000)[i % 3]
            try:
                client.completions.create(model="m", prompt="x" * size, max_tokens=2)
                k = "success"
            except openai.APIStatusError as e:
                k = str(e.status_code)
            except openai.APIConnectionError as e:
                k = f"connection error ({type(e).__name__})"
            counts[k] = counts.get(k, 0) + 1
        if counts == {"413": n}:
            return Outcome(HTTP_4XX, f"413 on all {n}")
        return Outcome("traceback", f"not all 413: {counts}")
    return run


def _concurrent(n: int):
    def run(url: str) -> Outcome:
        import httpx

        results: list = []

        def one() -> None:
            try:
                with httpx.stream("POST", url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 8,
                                                                         "stream": True},
                                  headers=AUTH, timeout=120) as r:
                    results.append(r.status_code == 200 and "data: [DONE]" in r.read().decode())
            except httpx.HTTPError:
                results.append(False)

        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        done = sum(results)
        return Outcome(SUCCESS, f"{done} of {n} ended with [DONE]") if done == n else \
            Outcome("traceback", f"only {done} of {n} ended with [DONE]")
    return run


def server_cases() -> list:
    """(name, expect, fn(url) -> Outcome): all run against one server."""
    msgs = [{"role": "user", "content": "hi"}]
    plain = [
        ("no API key", HTTP_4XX, lambda u: _post(u, "/v1/completions", {"prompt": "x"}, headers={})),
        # RFC 9110: whitespace around a header's value is not part of it, so the HTTP parser drops it
        # and the key check sees the exact key (a 200); the check itself compares the exact token
        ("API key with a trailing space (on the wire)", (HTTP_4XX, SUCCESS), lambda u: _keyed(u, f"Bearer {KEY} ")),
        ("API key after a doubled space", HTTP_4XX,
         lambda u: _post(u, "/v1/completions", {"prompt": "x"}, headers={"Authorization": f"Bearer  {KEY}"})),
        ("API key with a trailing tab (on the wire)", (HTTP_4XX, SUCCESS), lambda u: _keyed(u, f"Bearer {KEY}\t")),
        ("API key with a space inside", HTTP_4XX, lambda u: _keyed(u, f"Bearer {KEY[:3]} {KEY[3:]}")),
        ("body over the cap (Content-Length)", HTTP_4XX,
         lambda u: _post(u, "/v1/completions", {"prompt": "x" * 5000})),
        ("body over the cap (chunked)", HTTP_4XX,
         lambda u: _post(u, "/v1/completions", (b" " * 1000 for _ in range(10)))),
        ("a 4 MB prompt", HTTP_4XX, lambda u: _post(u, "/v1/completions", {"prompt": "x" * 4_000_000})),
        ("a client that stops mid-body", HTTP_4XX,
         lambda u: _raw(u, (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                            "Content-Length: 100\r\n\r\n{\"pro").encode(), 15)),
        ("not UTF-8", HTTP_4XX, lambda u: _post(u, "/v1/completions", b'{"prompt": "caf\xe9"}')),
        ("not JSON", HTTP_4XX, lambda u: _post(u, "/v1/completions", b"{not json")),
        ("JSON NaN as max_tokens", HTTP_4XX,
         lambda u: _post(u, "/v1/completions", b'{"prompt": "x", "max_tokens": NaN}')),
        ("a lone surrogate in prompt", HTTP_4XX, lambda u: _post(u, "/v1/completions", b'{"prompt": "\\ud800"}')),
        ("a lone surrogate in messages", HTTP_4XX,
         lambda u: _post(u, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}')),
        ("a lone surrogate in stop", HTTP_4XX,
         lambda u: _post(u, "/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}')),
        ("max_tokens over the cap", HTTP_4XX, lambda u: _post(u, "/v1/completions", {"prompt": "x", "max_tokens": 99})),
        ("max_tokens negative", HTTP_4XX, lambda u: _post(u, "/v1/completions", {"prompt": "x", "max_tokens": -1})),
        ("a prompt past the context", HTTP_4XX,
         lambda u: _post(u, "/v1/completions", {"prompt": "the cat " * 200, "max_tokens": 2})),
        ("a prompt past the context, streamed", HTTP_4XX,
         lambda u: _post(u, "/v1/completions", {"prompt": "the cat " * 200, "max_tokens": 2, "stream": True})),
        ('an empty prompt ""', HTTP_4XX, lambda u: _post(u, "/v1/completions", {"prompt": ""})),
        ('an empty prompt [""]', HTTP_4XX, lambda u: _post(u, "/v1/completions", {"prompt": [""]})),
        ("messages not a list", HTTP_4XX, lambda u: _post(u, "/v1/chat/completions", {"messages": "hi"})),
        ("a role nobody knows", HTTP_4XX,
         lambda u: _post(u, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]})),
        ("temperature a string", HTTP_4XX,
         lambda u: _post(u, "/v1/chat/completions", {"messages": msgs, "temperature": "hot"})),
        ("a valid chat request", SUCCESS,
         lambda u: _post(u, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4})),
        ("469 oversized uploads through the OpenAI SDK", HTTP_4XX, _openai_oversized(469)),
        ("50 concurrent streams", SUCCESS, _concurrent(50)),
    ]
    return [case("server", name, expect, fn) for name, expect, fn in plain]


SLOW_TEMPLATE = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}x"


def template_server_case(fx: Fixtures):
    """A bundle whose chat template never ends: the request gets a 500 template_timeout and the
    server keeps answering."""
    def run(fx: Fixtures) -> Outcome:
        b = fx.copy("server-slow-template")
        data = fx.manifest(b)
        data["tokenizer"]["chat_template"] = SLOW_TEMPLATE
        fx.write_manifest(b, data)
        with serving(fx, "--template-timeout", "1", bundle=b) as url:
            out = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
            after = _post(url, "/v1/completions", {"prompt": "the cat", "max_tokens": 2})
        if after.cls != SUCCESS:
            return Outcome(after.cls, f"the next request failed: {after.detail}")
        return out
    return case("server", "a chat template that never ends", HTTP_REFUSED, run)


def queue_case(fx: Fixtures):
    """--max-queue 2 with 10 clients: each ends with [DONE] or a 503 with Retry-After."""
    def run(fx: Fixtures) -> Outcome:
        import httpx

        results: list = []
        with serving(fx, "--max-queue", "2") as url:
            def one() -> None:
                try:
                    r = httpx.post(url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 8},
                                   headers=AUTH, timeout=120)
                    results.append(r.status_code if r.status_code != 503 or "retry-after" in r.headers else -1)
                except httpx.HTTPError:
                    results.append(None)
            threads = [threading.Thread(target=one) for _ in range(10)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
        summary = json.dumps({str(s): results.count(s) for s in set(results)})
        ok = all(s in (200, 503) for s in results) and len(results) == 10
        return Outcome(SUCCESS if ok else "traceback", summary)
    return case("server", "--max-queue 2 with 10 clients", SUCCESS, run)
