"""Chat prompts rendered in a child process that can be killed.

A bundle's chat template is Jinja code: sandboxed, but a loop nest such as
`{% for a in range(99999) %}{% for b in range(99999) %}` or a template that is quadratic in a
client's message runs for hours, and a Python thread cannot be stopped (nor would the server
exit on Ctrl-C while one runs). So the server turns chat requests into tokens (the same
`chat_format_for(...).prompt(...)` as ChatSession) in one child process,
`python -m edgespec.server.render`, which it kills and replaces when a request passes the time
limit; the event loop only awaits a pipe.

The protocol is one JSON object per line: the parent first sends the bundle folder and the
child answers `{"ready": true}` once it has loaded the tokenizer (a second or more on a busy
machine: not counted against the time limit); then one `{"messages": [...], "stop": [...],
"tools": [...]}` per request, answered by `{"ids": [...], "stop": [...], "transcript": bool,
"blank_line_ends": bool, "tool_syntax": name}` (the worker shapes a transcript's reply; the tool
syntax says how the model writes calls, models/tool_calls.py) or `{"error": "...", "kind": ...}`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BackendError, ConfigError

if TYPE_CHECKING:
    from ..engine.session import ChatPrompt

__all__ = ["ChatRenderer", "RenderTimeout", "RendererStopped"]

logger = logging.getLogger(__name__)

_LINE_LIMIT = 64 << 20  # one answer line: the ids of a prompt at the request-size cap, as JSON
# address space of the child: a tokenizer and one rendered prompt take a few hundred MB; the
# margin is for the allocator's per-thread arenas on machines with many cores
_CHILD_MEMORY = 8 << 30
STARTUP_TIMEOUT_S = 120.0  # for a child to import edgespec and load the tokenizer


class RenderTimeout(Exception):
    """The chat template did not render within the time limit; the child was replaced."""


class RendererStopped(Exception):
    """The server is stopping: a render in progress was ended, new ones are refused."""


class ChatRenderer:
    """Renders and tokenizes chat messages in a child process, one request at a time."""

    def __init__(self, bundle_path: Path, timeout_s: float) -> None:
        self._hello = json.dumps({"bundle": str(bundle_path)}) + "\n"
        self.timeout_s = timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock: asyncio.Lock | None = None  # made on the serving loop, in the first call
        self.restarts = 0  # children killed for running past the time limit
        self._stopping = False

    async def _child(self) -> asyncio.subprocess.Process:
        """The running child, started (and awaited until ready) if there is none."""
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        self._proc = proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=_LINE_LIMIT)
        try:
            proc.stdin.write(self._hello.encode())
            await proc.stdin.drain()
            ready = await asyncio.wait_for(proc.stdout.readline(), STARTUP_TIMEOUT_S)
            if json.loads(ready or b"null") != {"ready": True}:
                raise ValueError(f"it answered {ready[:80]!r}")
        except (OSError, ValueError, asyncio.TimeoutError) as e:
            await self._kill()
            raise BackendError(f"the chat template renderer did not start: {e or type(e).__name__}") from None
        return proc

    async def start(self) -> None:
        """Start the child ahead of the first request (the server's startup calls this)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                await self._child()
            except BackendError as e:
                logger.warning("%s; chat requests will try again", e)

    async def prompt(self, messages: list[dict], stop: list[str], tools: list[dict] | None = None) -> ChatPrompt:
        """The conversation's tokens and stop strings in the bundle's chat format, with `tools`
        (OpenAI's tool objects) where the model may call them. ConfigError: the template refused
        the messages (raise_exception); RenderTimeout: past the limit."""
        from ..engine.session import ChatPrompt

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._stopping:
                raise RendererStopped("the server is shutting down")
            proc = await self._child()
            line = json.dumps({"messages": messages, "stop": stop, "tools": tools or []}, ensure_ascii=True) + "\n"
            try:
                proc.stdin.write(line.encode())
                answer = await asyncio.wait_for(self._answer(proc), self.timeout_s)
            except asyncio.CancelledError:
                # the answer would reach the next request: this child must not serve another
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                self._proc = None
                raise
            except asyncio.TimeoutError:
                self.restarts += 1
                await self._kill()
                raise RenderTimeout(f"the chat template did not render within {self.timeout_s:g} s") from None
            except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
                await self._kill()
                if self._stopping:  # interrupt() killed the child
                    raise RendererStopped("the server is shutting down") from None
                raise BackendError(f"the chat template renderer failed: {e}") from None
        if "ids" in answer:
            return ChatPrompt(answer["ids"], tuple(answer["stop"]), transcript=answer["transcript"],
                              blank_line_ends=answer["blank_line_ends"], tool_syntax=answer["tool_syntax"])
        if answer.get("kind") == "config":
            raise ConfigError(answer["error"])
        raise BackendError(f"the chat template renderer failed: {answer.get('error')}")

    @staticmethod
    async def _answer(proc: asyncio.subprocess.Process) -> dict[str, Any]:
        await proc.stdin.drain()
        line = await proc.stdout.readline()
        if not line:
            raise ValueError(f"it exited with status {await proc.wait()}")
        return json.loads(line)

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    def interrupt(self) -> None:
        """End a render in progress and refuse new ones: the server is stopping. Safe to call
        from a signal handler (it only kills the child), so Ctrl-C does not wait for a template
        that would never end."""
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.stdin.close()  # the child ends at end of input
        try:
            await asyncio.wait_for(proc.wait(), 2.0)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


def _serve(stdin, stdout) -> None:
    """The child: read requests, write answers, until stdin closes."""
    from ..bundle import load_bundle
    from ..engine.session import chat_format_for
    from ..errors import EdgespecError
    from ..models.tool_calls import Function
    from ..tokenizer import Tokenizer

    bundle = load_bundle(json.loads(stdin.readline())["bundle"])
    m = bundle.manifest
    # this process is the server's bounded render child already: render in it, not in a child of its own
    tok = Tokenizer(bundle.file(m.tokenizer.file), m.tokenizer, template_timeout_s=None)
    fmt = chat_format_for(m, tok)
    stdout.write(json.dumps({"ready": True}) + "\n")
    stdout.flush()
    for line in stdin:
        try:
            request = json.loads(line)
            functions = [Function(t["function"]["name"], t["function"].get("description") or "",
                                  t["function"].get("parameters")) for t in request["tools"]]
            # the worker shapes replies; tools and earlier calls as the model writes them
            p = fmt.tool_prompt(tok, request["messages"], functions, request["stop"], shaped=True)
            answer: dict[str, Any] = {"ids": p.tokens, "stop": list(p.stop), "transcript": p.transcript,
                                      "blank_line_ends": p.blank_line_ends, "tool_syntax": p.tool_syntax}
        except EdgespecError as e:
            answer = {"error": str(e), "kind": "config"}
        except Exception as e:  # noqa: BLE001 -- a template may raise anything; the parent reports it
            answer = {"error": f"{type(e).__name__}: {e}", "kind": "config" if _template_error(e) else "internal"}
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()


def _template_error(e: Exception) -> bool:
    """Errors of the template code itself (undefined names, sandbox refusals, bad types in it):
    the request cannot be served as given, a 4xx."""
    from jinja2 import TemplateError

    return isinstance(e, (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                          MemoryError, RecursionError))


if __name__ == "__main__":
    # Ctrl-C in the server's terminal reaches the whole process group: the parent stops this
    # child (closes its input), so it must not die on SIGINT with a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # this process only: one prompt at a time needs no tokenizer thread pool under the memory cap
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if sys.platform != "win32":
        import resource

        # a template that builds a huge string fails here (MemoryError, a 4xx) instead of
        # taking the machine's memory before the time limit kills it
        resource.setrlimit(resource.RLIMIT_AS, (_CHILD_MEMORY, _CHILD_MEMORY))
    sys.stdout = os.fdopen(sys.stdout.fileno(), "w", encoding="utf-8", closefd=False)
    _serve(sys.stdin, sys.stdout)
