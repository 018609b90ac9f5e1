"""The checks a request passes before the app parses anything (an ASGI middleware).

In order: the API key (a client without it learns nothing from how its body is parsed), the
declared body size (413 before a byte is read), the body itself, read whole under the size cap
and within a time limit (a client that stalls mid-body is dropped with a 408), and that it is
UTF-8 text (JSON must be; a 400 naming the byte instead of a parser's 500). Every message sent to
a client gets the same time limit: a client that stops reading a stream frees its generation
instead of holding it (and the engine) forever.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import error_body

__all__ = ["RequestGuard", "ClientStalled"]

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_BEARER = b"bearer "


class ClientStalled(Exception):
    """A client did not take a message within the time limit."""


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class RequestGuard:
    """ASGI middleware: API key, body size, body time limit, UTF-8, send time limit."""

    def __init__(self, app, *, api_key: str | None, max_body: int, client_timeout_s: float,
                 protected: str = "/v1") -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_body = max_body
        self.timeout_s = client_timeout_s
        self.protected = protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._timed(send)
        try:
            self._check_key(scope)
            if scope["method"] in _BODY_METHODS:
                receive = _replay(await self._body(scope, receive), receive)
        except _Refused as e:
            await _reply(send, e)
            return
        except ClientStalled:
            return
        try:
            await self.app(scope, receive, send)
        except Exception as e:
            if not _stalled(e):
                raise
            logger.warning("a client stopped reading its response for %g s; dropped it", self.timeout_s)

    def _check_key(self, scope: Scope) -> None:
        if self.api_key is None or not scope["path"].startswith(self.protected):
            return
        auth = _header(scope, b"authorization")
        # the scheme is case-insensitive (RFC 9110); the token is the exact rest after one space:
        # a key with a trailing space or newline, or a doubled space, is another key
        scheme, token = auth[:len(_BEARER)], auth[len(_BEARER):]
        if scheme.lower() != _BEARER or not hmac.compare_digest(token, self.api_key):
            raise _Refused(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                           "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        declared = _header(scope, b"content-length")
        if declared.strip().isdigit() and int(declared) > self.max_body:
            raise self._too_large()
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise _Refused(408, f"The request body did not arrive within {self.timeout_s:g} s.",
                               "request_timeout", {"Connection": "close"}) from None
            if message["type"] == "http.disconnect":
                raise ClientStalled
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Refused(400, f"The request body is not UTF-8 text (byte 0x{body[e.start]:02x} at offset "
                                f"{e.start}); send JSON encoded as UTF-8.", "invalid_encoding") from None
        return body

    def _too_large(self) -> _Refused:
        return _Refused(413, f"The request body is larger than this server accepts ({self.max_body} bytes).",
                        "request_too_large", {"Connection": "close"})

    def _timed(self, send: Send) -> Send:
        async def timed(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.timeout_s)
            except asyncio.TimeoutError:
                raise ClientStalled from None

        return timed


def _header(scope: Scope, name: bytes) -> bytes:
    return next((v for k, v in scope.get("headers", ()) if k.lower() == name), b"")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then the client's later messages
    (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _stalled(e: BaseException) -> bool:
    """Whether `e` is ClientStalled, perhaps inside the exception group of a task group."""
    return isinstance(e, ClientStalled) or any(_stalled(x) for x in getattr(e, "exceptions", ()))


async def _reply(send: Send, e: _Refused) -> None:
    kind = "invalid_request_error"
    body = json.dumps(error_body(e.message, kind, code=e.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    try:
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    except ClientStalled:
        pass
