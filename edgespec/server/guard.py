"""The checks a request passes before the app parses anything (an ASGI middleware).

In order: the API key (a client without it learns nothing from how its body is parsed), the
declared body size (refused before a byte is kept), the body itself, read whole under the size
cap and within a time limit (a client that stalls mid-body is dropped with a 408), and that it is
UTF-8 text (JSON must be; a 400 naming the byte instead of a parser's 500). Every message sent to
a client gets the same time limit: a client that stops reading a stream frees its generation
instead of holding it (and the engine) forever.

A request refused before its body was read (401, 413) is answered at once, and then the rest of
the body is read and thrown away, bounded in bytes and time, before the connection closes.
Closing a socket that still holds unread bytes makes the kernel send a reset, which throws away
the reply the client has not read yet: most clients (the OpenAI SDK among them) write the whole
body before reading, so they would see a connection error instead of the 413.
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
# The most of a refused body read and thrown away before closing: past it (or a declared length
# past it) the connection is closed at once, and such a client may see a reset.
DRAIN_MAX_BYTES = 1 << 30


class ClientStalled(Exception):
    """A client did not take a message within the time limit."""


class _Refused(Exception):
    """A reply the guard gives instead of the app's; `unread`: the request body is not read to its
    end yet (`received`: bytes of it read so far), so it is drained after the reply."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None, *,
                 unread: bool = False, received: int = 0) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.unread, self.received = unread, received


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
            drain = e.unread and _drainable(scope, e.received)
            await _reply(send, e, more_body=drain)
            if drain:
                await self._drain(receive, e.received)
                await _finish(send)
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
                           "invalid_api_key", {"WWW-Authenticate": "Bearer", "Connection": "close"},
                           unread=scope["method"] in _BODY_METHODS)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        declared = _header(scope, b"content-length")
        if declared.strip().isdigit() and int(declared) > self.max_body:
            raise self._too_large(0)
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
            if size > self.max_body:  # a chunked body is cut here, not kept to its end
                raise self._too_large(size if message.get("more_body", False) else None)
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

    def _too_large(self, received: int | None) -> _Refused:
        """The 413; `received`: bytes read of a body with more to come (None: it was all read)."""
        return _Refused(413, f"The request body is larger than this server accepts ({self.max_body} bytes).",
                        "request_too_large", {"Connection": "close"}, unread=received is not None,
                        received=received or 0)

    async def _drain(self, receive: Receive, received: int) -> int:
        """Read and throw away the rest of a refused body, within the client time limit and
        DRAIN_MAX_BYTES in all; returns the bytes thrown away."""
        loop = asyncio.get_running_loop()
        deadline, drained = loop.time() + self.timeout_s, 0
        while received + drained <= DRAIN_MAX_BYTES:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                logger.info("a refused request body did not end within %g s; closing", self.timeout_s)
                break
            drained += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        return drained

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


def _drainable(scope: Scope, received: int) -> bool:
    """Whether a refused body is worth reading to its end: not when the client waits for a
    `100 Continue` before sending it (it never gets one), nor when it declares more than the
    drain bound."""
    if _header(scope, b"expect").strip().lower() == b"100-continue":
        return False
    declared = _header(scope, b"content-length").strip()
    return not (declared.isdigit() and int(declared) > DRAIN_MAX_BYTES) and received <= DRAIN_MAX_BYTES


async def _reply(send: Send, e: _Refused, *, more_body: bool = False) -> None:
    """Send the error reply whole; `more_body`: leave the response open, so the server keeps
    reading the request until `_finish` (the whole JSON body is sent already, so a client that
    reads while it writes sees the reply at once)."""
    kind = "invalid_request_error"
    body = json.dumps(error_body(e.message, kind, code=e.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    try:
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": more_body})
    except ClientStalled:
        pass


async def _finish(send: Send) -> None:
    try:
        await send({"type": "http.response.body", "body": b""})
    except ClientStalled:
        pass
