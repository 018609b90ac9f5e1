"""Chat templates rendered with a time and a memory bound, in a child process that can be killed.

A chat template is Jinja code that comes with a bundle or a GGUF. jinja2's sandbox refuses
attribute escapes, but not work: two nested `range(99999)` loops run for hours, and a template
that builds a huge string takes the machine's memory (or aborts the process that renders it). A
Python thread cannot be stopped, so the template runs in a child process,
`python -m edgespec.models.templates`, under an address-space limit; the caller waits for its
answer with a time limit and kills the child (starting a new one on the next render) when it
passes (models/child.py owns the child, its handshake, its limits and its restarts). The child is
started on the first render and kept: its start costs a Python start and jinja2's import, a
render afterwards a pipe round trip.

After the child's handshake, each request `{"template": ..., "context": {...}}` is answered by
`{"text": ...}` or `{"kind": ..., "error": ...}` (kinds: "invalid", "unsafe", "raised", "limit",
"failed").

Errors: a template that does not compile or that the sandbox refuses is broken whatever the
messages (ChatTemplateError, a BundleError: "the bundle's chat template is invalid/unsafe: ...");
one that ran out of time or memory, or failed on these messages, is a TemplateLimitError or a
ConfigError naming the template. Every message is one line.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any

from ..errors import BundleError, ConfigError
from .child import ChildDied, ChildSpec, ChildStartError, ChildTimeout, ChildWorker, limit_memory, serve

__all__ = ["ChatTemplateError", "TemplateLimitError", "TemplateRenderer", "InProcessRenderer", "limit_memory",
           "TEMPLATE_TIMEOUT_S", "CHILD_MEMORY", "OUTPUT_LIMIT"]

logger = logging.getLogger(__name__)

TEMPLATE_TIMEOUT_S = 5.0  # a chat prompt renders in milliseconds; the server's --template-timeout default
# address space of the child: Python and jinja2 take a small part of it; the rest is for the prompt
CHILD_MEMORY = 2 << 30
OUTPUT_LIMIT = 32 << 20  # characters of one rendered prompt: far past any context, well under the memory cap
STARTUP_TIMEOUT_S = 60.0  # for the child to start Python and import jinja2 on a busy machine
_LINE_LIMIT = 8 * OUTPUT_LIMIT  # one answer line: the text JSON-escaped (at most 6 bytes a character)
_CACHED_TEMPLATES = 8  # compiled templates the child keeps (one per bundle or GGUF in use)


class ChatTemplateError(BundleError):
    """The chat template is broken whatever the messages: Jinja syntax, or an operation the
    sandbox refuses."""


class TemplateLimitError(ConfigError):
    """The chat template did not render within the time or memory limit."""


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _raise(msg: Any):
    # a template's own refusal ("Conversation roles must alternate"): the messages are wrong
    raise ConfigError(f"chat template: {_one_line(msg)}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators=None,
            sort_keys: bool = False) -> str:
    # as transformers' chat templates see it (HF templates call tojson with these keywords)
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(str(fmt))


def _generation_tag():
    """`{% generation %}...{% endgeneration %}`, which transformers' templates use to mark the
    assistant's tokens: rendered as its body (nothing here asks for the mask)."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # the extensions and globals transformers' apply_chat_template gives a template
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _generation_tag()])
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    return env


class _Refusal(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _compile(env, source: str, origin: str, cache: dict):
    from jinja2 import TemplateSyntaxError

    if source in cache:
        return cache[source]
    try:
        template = env.from_string(source)
    except TemplateSyntaxError as e:
        line = f" (line {e.lineno})" if e.lineno else ""
        raise _Refusal("invalid", f"{origin} chat template is invalid: {_one_line(e.message or e)}{line}") from None
    except (RecursionError, MemoryError) as e:  # nesting deeper than the parser's recursion
        raise _Refusal("invalid", f"{origin} chat template is invalid: {type(e).__name__} while compiling it") from None
    if len(cache) >= _CACHED_TEMPLATES:
        cache.pop(next(iter(cache)))
    cache[source] = template
    return template


def _render(env, source: str, context: dict, origin: str, cache: dict) -> str:
    """The text of `source` rendered with `context`, or a _Refusal naming what went wrong."""
    from jinja2.exceptions import SecurityError

    template = _compile(env, source, origin, cache)
    try:
        parts, size = [], 0
        for part in template.generate(**context):  # bounded as it grows, not after
            size += len(part)
            if size > OUTPUT_LIMIT:
                raise _Refusal("limit", f"{origin} chat template wrote more than {OUTPUT_LIMIT >> 20} M characters")
            parts.append(part)
        return "".join(parts)
    except _Refusal:
        raise
    except SecurityError as e:
        raise _Refusal("unsafe", f"{origin} chat template is unsafe: {_one_line(e)}") from None
    except ConfigError as e:  # raise_exception
        raise _Refusal("raised", str(e)) from None
    except MemoryError:
        raise _Refusal("limit", f"{origin} chat template needs more than {CHILD_MEMORY >> 30} GiB of memory "
                                "to render") from None
    except RecursionError:
        raise _Refusal("limit", f"{origin} chat template recurses too deeply") from None
    except Exception as e:  # noqa: BLE001 -- template code may raise anything; the caller gets one line
        raise _Refusal("failed", f"{origin} chat template failed on these messages: "
                                 f"{type(e).__name__}: {_one_line(e)}") from None


def _error(kind: str, message: str) -> Exception:
    if kind in ("invalid", "unsafe"):
        return ChatTemplateError(message)
    if kind == "limit":
        return TemplateLimitError(message)
    return ConfigError(message)


class InProcessRenderer:
    """Renders here, with no time or memory bound: for a process that is itself a bounded child
    (the server's renderer). Errors as TemplateRenderer.render."""

    def __init__(self) -> None:
        self._env = None
        self._cache: dict = {}

    def render(self, source: str, context: dict, origin: str = "the bundle's") -> str:
        if self._env is None:
            self._env = _environment()
        try:
            return _render(self._env, source, context, origin, self._cache)
        except _Refusal as e:
            raise _error(e.kind, str(e)) from None

    def close(self) -> None:
        self._cache.clear()


class TemplateRenderer:
    """Renders chat templates in a child process (models/child.py), one at a time, each within
    `timeout_s`. Thread-safe; the child is started on the first render and ended by close() (or
    when the renderer is collected, or at exit)."""

    def __init__(self, timeout_s: float = TEMPLATE_TIMEOUT_S, memory_bytes: int = CHILD_MEMORY) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"the chat template time limit must be > 0 s, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.memory_bytes = int(memory_bytes)
        self._worker = ChildWorker(ChildSpec(module=__name__, memory_bytes=self.memory_bytes,
                                             startup_timeout_s=STARTUP_TIMEOUT_S, line_limit=_LINE_LIMIT))
        self._lock = threading.Lock()
        # where no child can be started (a frozen app, an interpreter under user-mode emulation):
        # render here, unbounded, said once, rather than refuse every chat
        self._here: InProcessRenderer | None = None

    @property
    def restarts(self) -> int:
        """Children killed for passing the time limit."""
        return self._worker.restarts

    def render(self, source: str, context: dict, origin: str = "the bundle's") -> str:
        """`source` rendered with `context` (JSON values: messages, add_generation_prompt, the
        special tokens). ChatTemplateError: invalid or unsafe; TemplateLimitError: past the time or
        memory limit; ConfigError: the template refused or failed on these messages."""
        request = {"template": source, "context": context, "origin": origin}
        try:
            json.dumps(request)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"chat messages must be JSON values (strings, numbers, lists, objects): {e}") from None
        here = self._fallback()
        if here is not None:
            return here.render(source, context, origin)
        answer = self._ask(request, origin)
        if "text" in answer:
            return answer["text"]
        raise _error(answer.get("kind", "failed"), str(answer.get("error", "no answer")))

    def _fallback(self) -> InProcessRenderer | None:
        """The in-process renderer where this platform cannot start the child (tried once: a
        child that started before and fails to restart after a kill is an error, since what
        killed it would run unbounded here)."""
        with self._lock:
            if self._here is None and not self._worker.started:
                try:
                    self._worker.start()
                except ChildStartError as e:
                    logger.warning("%s; rendering chat templates in this process, without a time or memory "
                                   "limit", e)
                    self._here = InProcessRenderer()
            return self._here

    def _ask(self, request: dict, origin: str) -> dict:
        try:
            return self._worker.ask(request, self.timeout_s)
        except ChildTimeout:
            return {"kind": "limit", "error": f"{origin} chat template did not render within {self.timeout_s:g} s"}
        except ChildDied as e:
            return {"kind": "limit", "error": f"{origin} chat template stopped its renderer (exit status "
                                              f"{e.status}; memory limit {self.memory_bytes >> 20} MiB)"}

    def close(self) -> None:
        self._worker.close()

    def __enter__(self) -> TemplateRenderer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _handler(hello: dict):
    """The child's side: a render request answered by its text or its refusal."""
    env, cache = _environment(), {}

    def handle(request: dict) -> dict:
        origin = str(request.get("origin", "the bundle's"))
        try:
            return {"text": _render(env, request["template"], request["context"], origin, cache)}
        except _Refusal as e:
            return {"kind": e.kind, "error": str(e)}

    return handle


if __name__ == "__main__":
    serve(_handler)
