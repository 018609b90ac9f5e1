"""OpenAI response bodies and their server-sent-event stream, built from edgespec Responses.

Chat and completions differ only in data (a ReplyShape: object names, how text sits in a
choice, chat's opening role chunk), so one event generator serves both."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.sse import format_sse_event

from .errors import error_body
from .schemas import new_id, now
from .tools import openai_calls

if TYPE_CHECKING:
    from ..decoding import GenerationStats
    from ..engine.engine import Response
    from .tools import ReplyCalls

__all__ = ["ReplyShape", "CHAT", "COMPLETION", "Envelope", "usage", "timings", "finish_reason", "reply", "chunk",
           "usage_chunk", "events", "sse", "sse_done", "sse_error", "collect"]

DONE = b"data: [DONE]\n\n"


def _chat_message(text: str) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": text}}


def _chat_delta(text: str) -> dict[str, Any]:
    # the closing chunk carries an empty delta, as OpenAI's does
    return {"delta": {"content": text} if text else {}}


def _text(text: str) -> dict[str, Any]:
    return {"text": text}


@dataclass(frozen=True)
class ReplyShape:
    """How one endpoint's replies look: all that tells a chat reply from a completion."""

    id_prefix: str  # "chatcmpl-..." / "cmpl-..."
    whole_object: str  # the "object" of a whole reply
    chunk_object: str  # the "object" of a streamed chunk
    whole: Callable[[str], dict[str, Any]]  # a whole reply's text -> its choice's fields
    piece: Callable[[str], dict[str, Any]]  # a streamed piece of text -> its chunk's choice fields
    opening: dict[str, Any] | None = None  # choice fields of a chunk sent before any text (chat's role)


CHAT = ReplyShape("chatcmpl", "chat.completion", "chat.completion.chunk", _chat_message, _chat_delta,
                  opening={"delta": {"role": "assistant", "content": ""}})
COMPLETION = ReplyShape("cmpl", "text_completion", "text_completion", _text, _text)


@dataclass(frozen=True)
class Envelope:
    """What every response and chunk of one reply shares."""

    id: str
    model: str
    created: int
    # added to the usage block as "edgespec" (None: nothing): e.g. that the engine decodes plainly
    # because no verify width is exact here. OpenAI's clients keep unknown usage keys as extras
    note: dict[str, Any] | None = None

    @classmethod
    def new(cls, shape: ReplyShape, model: str, note: dict[str, Any] | None = None) -> Envelope:
        return cls(new_id(shape.id_prefix), model, now(), note)


def usage(st: GenerationStats) -> dict[str, int]:
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
            "total_tokens": st.prompt_tokens + st.new_tokens}


def timings(st: GenerationStats) -> dict[str, Any]:
    """How the reply was made, in llama.cpp's server's `timings` names (so one benchmark reads
    both): prompt_* covers the prompt and the first step, predicted_* the tokens after it; then
    what the drafts and a grammar did."""
    decode_ms = max(st.elapsed_s - st.first_token_s, 0.0) * 1e3
    return {"prompt_n": st.prompt_tokens, "prompt_ms": st.first_token_s * 1e3, "predicted_n": st.decode_tokens,
            "predicted_ms": decode_ms, "predicted_per_second": st.tokens_per_s, "steps": st.steps,
            "drafted": st.drafted, "accepted": st.accepted, "forced": st.forced}


def finish_reason(reason: str | None) -> str:
    # "cancelled" only reaches a client when the server shuts down mid-reply: the text stopped
    return reason if reason in ("length", "tool_calls") else "stop"


def _body(obj: str, env: Envelope, choice: dict[str, Any] | None, st: GenerationStats | None) -> dict[str, Any]:
    """The envelope every response and chunk shares; `choice` None: an empty choices list."""
    body: dict[str, Any] = {"id": env.id, "object": obj, "created": env.created, "model": env.model,
                            "choices": [] if choice is None else [{"index": 0, **choice}]}
    if st is not None:
        body["usage"] = usage(st) if env.note is None else {**usage(st), "edgespec": env.note}
        body["timings"] = timings(st)
    return body


def reply(shape: ReplyShape, env: Envelope, text: str, reason: str | None, st: GenerationStats,
          calls: ReplyCalls | None = None) -> dict[str, Any]:
    """A whole (non-streamed) reply; with `calls`, the calls read from it as its tool_calls."""
    fields = shape.whole(text)
    if calls is not None:
        content, found = calls.whole(text)
        if found:
            fields = {"message": {"role": "assistant", "content": content, "tool_calls": openai_calls(found)}}
            reason = "tool_calls"
    return _body(shape.whole_object, env, {**fields, "logprobs": None, "finish_reason": finish_reason(reason)}, st)


def chunk(shape: ReplyShape, env: Envelope, fields: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
    """One streamed chunk with one choice of `fields`."""
    return _body(shape.chunk_object, env, {**fields, "logprobs": None, "finish_reason": reason}, None)


def usage_chunk(shape: ReplyShape, env: Envelope, st: GenerationStats) -> dict[str, Any]:
    """The chunk after the last, with no choices, that `stream_options.include_usage` asks for."""
    return _body(shape.chunk_object, env, None, st)


async def events(responses: AsyncIterator[Response], shape: ReplyShape, env: Envelope,
                 include_usage: bool, calls: ReplyCalls | None = None) -> AsyncIterator[bytes]:
    """A generation's Responses as server-sent events, for either endpoint. With `calls`, text
    that may open a tool call is held back, and the calls go out as one delta at the end."""
    if shape.opening is not None:  # sent at once: the client sees its request was taken
        yield sse(chunk(shape, env, shape.opening))
    reason, st = None, None
    try:
        async for r in responses:
            text = r.text if calls is None else calls.push(r.text)
            if text:
                yield sse(chunk(shape, env, shape.piece(text)))
            reason, st = r.finish_reason or reason, r.stats
    except Exception as e:  # the status line is sent: the error travels as an event
        yield sse_error(e)
        return
    if calls is not None:
        rest, found = calls.finish()
        if rest:
            yield sse(chunk(shape, env, shape.piece(rest)))
        if found:
            yield sse(chunk(shape, env, {"delta": {"tool_calls": openai_calls(found, streamed=True)}}))
            reason = "tool_calls"
    yield sse(chunk(shape, env, shape.piece(""), finish_reason(reason)))
    if include_usage and st is not None:
        yield sse(usage_chunk(shape, env, st))
    yield sse_done()


def sse(body: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(body, ensure_ascii=False))


def sse_done() -> bytes:
    return DONE


def sse_error(e: Exception) -> bytes:
    """An error after the stream began: OpenAI's clients raise it from the event."""
    from ..errors import EdgespecError

    message = str(e) if isinstance(e, EdgespecError) else "The server had an error while processing your request."
    return sse(error_body(message, "server_error"))


async def collect(responses: AsyncIterator[Response]) -> tuple[str, str | None, GenerationStats | None]:
    """Text, finish reason and stats of a whole generation."""
    parts, reason, st = [], None, None
    async for r in responses:
        parts.append(r.text)
        reason, st = r.finish_reason or reason, r.stats
    return "".join(parts), reason, st
