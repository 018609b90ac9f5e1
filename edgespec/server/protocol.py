"""A time limit on a request's head: the HTTP protocol `edgespec serve` runs uvicorn with.

The guard (guard.py) runs once a request's headers are in; a client that sends them a byte at a
time (slowloris) never gets there, and uvicorn bounds only the idle time between requests. So the
connection itself carries a deadline: from the moment it opens, and again from the end of each
response, the next request line and headers must be complete within the limit (the client time
limit, `--client-timeout`). A client that has sent part of a head by then gets a 408 and the
connection closes; one that has sent nothing is closed quietly, as an idle keep-alive is.

It is uvicorn's own h11 protocol with the deadline added; an app served some other way keeps
that server's own limits (nginx's `client_header_timeout` in front of it, for instance):

    uvicorn.run(app, http=edgespec.server.http_protocol(30.0))
"""
from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

__all__ = ["http_protocol"]

logger = logging.getLogger(__name__)

_LINGER_S = 2.0  # at most this long after a 408 for the client to see it and close its side


def _timeout_reply(seconds: float) -> bytes:
    body = json.dumps(error_body(f"The request headers did not arrive within {seconds:g} s.",
                                 code="request_timeout")).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class _HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request head is not in on time."""

    head_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._answered = False
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        if self._answered:  # the 408 is out: what still trickles in is read and thrown away
            return
        if self.conn.their_state is h11.IDLE:
            self._head_bytes += len(data)
        super().data_received(data)

    def eof_received(self) -> bool | None:
        if self._answered:
            self.transport.close()
            return None
        return super().eof_received()

    def handle_events(self) -> None:
        super().handle_events()
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """A deadline runs exactly while the client owes a request head (h11's IDLE), set when
        it began to owe it."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._deadline is None:
            self._head_bytes = len(self.conn.trailing_data[0])  # a pipelined head already in
            self._deadline = self.loop.call_later(self.head_timeout_s, self._expired)
        elif not waiting:
            self._disarm()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self._head_bytes:
            self.transport.close()
            return
        logger.info("a client sent part of a request head and no more for %g s; answered 408 and closed",
                    self.head_timeout_s)
        # closing a socket with unread bytes resets it, and the reset throws away the 408: say it,
        # end our side, read and drop what still comes for a moment, then close
        self._answered = True
        self.transport.write(_timeout_reply(self.head_timeout_s))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(min(self.head_timeout_s, _LINGER_S), self.transport.close)


def http_protocol(head_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a `head_timeout_s` time limit on each request's head, for
    uvicorn.Config(http=...)."""
    if not head_timeout_s > 0:
        raise ValueError(f"the head time limit must be a positive number of seconds, got {head_timeout_s!r}")
    return type("EdgespecH11Protocol", (_HeadDeadline,), {"head_timeout_s": float(head_timeout_s)})
