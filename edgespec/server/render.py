"""Chat prompts rendered in a child process that can be killed.

A bundle's chat template is Jinja code: sandboxed, but a loop nest such as
`{% for a in range(99999) %}{% for b in range(99999) %}` or a template that is quadratic in a
client's message runs for hours, and a Python thread cannot be stopped (nor would the server
exit on Ctrl-C while one runs). So the server turns chat requests into tokens (the same
`chat_format_for(...).prompt(...)` as ChatSession) in one child process,
`python -m edgespec.server.render`, which it kills and replaces when a request passes the time
limit. The child, its handshake, its address-space limit and its restarts are models/child.py's
`ChildWorker`, the same as the library's template renderer; the event loop only awaits a thread
that waits on the child's pipe.

The child's handshake carries the bundle folder; it says it is ready once it has loaded the
tokenizer (a second or more on a busy machine: not counted against the time limit). Then each
`{"messages": [...], "stop": [...], "tools": [...]}` is answered by `{"ids": [...], "stop": [...],
"transcript": bool, "blank_line_ends": bool, "tool_syntax": name}` (the worker shapes a
transcript's reply; the tool syntax says how the model writes calls, models/tool_calls.py) or
`{"error": "...", "kind": ...}`.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BackendError, ConfigError
from ..models.child import ChildDied, ChildSpec, ChildStartError, ChildStopped, ChildTimeout, ChildWorker, serve

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
        self.timeout_s = timeout_s
        # one prompt at a time needs no tokenizer thread pool under the memory cap
        self._worker = ChildWorker(ChildSpec(
            module=__name__, memory_bytes=_CHILD_MEMORY, startup_timeout_s=STARTUP_TIMEOUT_S, line_limit=_LINE_LIMIT,
            hello={"bundle": str(bundle_path)}, env=(("TOKENIZERS_PARALLELISM", "false"),)))
        # one request's thread waits on the child at a time; the others wait here, on the loop,
        # holding no thread of the pool. Made on the serving loop, in the first call
        self._lock: asyncio.Lock | None = None

    @property
    def restarts(self) -> int:
        """Children killed for running past the time limit."""
        return self._worker.restarts

    async def _waiting(self, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)` in a thread, one at a time. A cancelled caller (its client left) kills the
        child, so the thread returns at once and its late answer never reaches the next request."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                return await asyncio.to_thread(call, *args)
            except asyncio.CancelledError:
                self._worker.kill()
                raise

    async def start(self) -> None:
        """Start the child ahead of the first request (the server's startup calls this)."""
        try:
            await self._waiting(self._worker.start)
        except ChildStartError as e:
            logger.warning("%s; chat requests will try again", e)

    async def prompt(self, messages: list[dict], stop: list[str], tools: list[dict] | None = None) -> ChatPrompt:
        """The conversation's tokens and stop strings in the bundle's chat format, with `tools`
        (OpenAI's tool objects) where the model may call them. ConfigError: the template refused
        the messages (raise_exception); RenderTimeout: past the limit."""
        request = {"messages": messages, "stop": stop, "tools": tools or []}
        try:
            answer = await self._waiting(self._worker.ask, request, self.timeout_s)
        except ChildStopped:
            raise RendererStopped("the server is shutting down") from None
        except ChildTimeout:
            raise RenderTimeout(f"the chat template did not render within {self.timeout_s:g} s") from None
        except ChildDied as e:
            raise BackendError(f"the chat template renderer failed: it exited with status {e.status}") from None
        return _chat_prompt(answer)

    def interrupt(self) -> None:
        """End a render in progress and refuse new ones: the server is stopping. Safe to call
        from a signal handler (it only kills the child), so Ctrl-C does not wait for a template
        that would never end."""
        self._worker.interrupt()

    async def close(self) -> None:
        await asyncio.to_thread(self._worker.close)  # a second at most: the child ends at end of input


def _chat_prompt(answer: dict[str, Any]) -> ChatPrompt:
    from ..engine.session import ChatPrompt

    if "ids" in answer:
        return ChatPrompt(answer["ids"], tuple(answer["stop"]), transcript=answer["transcript"],
                          blank_line_ends=answer["blank_line_ends"], tool_syntax=answer["tool_syntax"])
    if answer.get("kind") == "config":
        raise ConfigError(answer["error"])
    raise BackendError(f"the chat template renderer failed: {answer.get('error')}")


# -- the child's side ------------------------------------------------------------------------

def _setup(hello: dict) -> Callable[[dict], dict]:
    """The child's handler for the bundle at `hello["bundle"]`."""
    from ..bundle import load_bundle
    from ..engine.session import chat_format_for
    from ..tokenizer import Tokenizer

    bundle = load_bundle(hello["bundle"])
    m = bundle.manifest
    # this process is the server's bounded render child already: render in it, not in a child of its own
    tok = Tokenizer(bundle.file(m.tokenizer.file), m.tokenizer, template_timeout_s=None)
    fmt = chat_format_for(m, tok)
    return lambda request: _answer(fmt, tok, request)


def _answer(fmt, tok, request: dict) -> dict[str, Any]:
    from ..errors import EdgespecError
    from ..models.tool_calls import Function

    try:
        functions = [Function(t["function"]["name"], t["function"].get("description") or "",
                              t["function"].get("parameters")) for t in request["tools"]]
        # the worker shapes replies; tools and earlier calls as the model writes them
        p = fmt.tool_prompt(tok, request["messages"], functions, request["stop"], shaped=True)
        return {"ids": p.tokens, "stop": list(p.stop), "transcript": p.transcript,
                "blank_line_ends": p.blank_line_ends, "tool_syntax": p.tool_syntax}
    except EdgespecError as e:
        return {"error": str(e), "kind": "config"}
    except Exception as e:  # noqa: BLE001 -- a template may raise anything; the parent reports it
        return {"error": f"{type(e).__name__}: {e}", "kind": "config" if _template_error(e) else "internal"}


def _template_error(e: Exception) -> bool:
    """Errors of the template code itself (undefined names, sandbox refusals, bad types in it):
    the request cannot be served as given, a 4xx."""
    from jinja2 import TemplateError

    return isinstance(e, (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                          MemoryError, RecursionError))


if __name__ == "__main__":
    serve(_setup)
