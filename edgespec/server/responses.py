"""OpenAI response bodies and their server-sent-event stream, built from edgespec Responses."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.sse import format_sse_event

from .errors import error_body

if TYPE_CHECKING:
    from ..decoding import GenerationStats
    from ..engine.engine import Response

__all__ = ["usage", "finish_reason", "chat_completion", "chat_chunk", "completion", "completion_chunk",
           "sse", "sse_done", "sse_error", "collect"]

DONE = b"data: [DONE]\n\n"


def usage(st: GenerationStats) -> dict[str, int]:
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
            "total_tokens": st.prompt_tokens + st.new_tokens}


def finish_reason(reason: str | None) -> str:
    # "cancelled" only reaches a client when the server shuts down mid-reply: the text stopped
    return "length" if reason == "length" else "stop"


def _body(obj: str, id_: str, model: str, created: int, choice: dict[str, Any] | None,
          st: GenerationStats | None) -> dict[str, Any]:
    """The envelope every response and chunk shares; `choice` None: an empty choices list."""
    body: dict[str, Any] = {"id": id_, "object": obj, "created": created, "model": model,
                            "choices": [] if choice is None else [{"index": 0, **choice}]}
    if st is not None:
        body["usage"] = usage(st)
    return body


def chat_completion(id_: str, model: str, created: int, text: str, reason: str | None,
                    st: GenerationStats) -> dict[str, Any]:
    return _body("chat.completion", id_, model, created,
                 {"message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason(reason)}, st)


def chat_chunk(id_: str, model: str, created: int, delta: dict[str, Any], reason: str | None = None,
               st: GenerationStats | None = None, choices: bool = True) -> dict[str, Any]:
    choice = {"delta": delta, "logprobs": None, "finish_reason": reason} if choices else None
    return _body("chat.completion.chunk", id_, model, created, choice, st)


def completion(id_: str, model: str, created: int, text: str, reason: str | None,
               st: GenerationStats) -> dict[str, Any]:
    return _body("text_completion", id_, model, created,
                 {"text": text, "logprobs": None, "finish_reason": finish_reason(reason)}, st)


def completion_chunk(id_: str, model: str, created: int, text: str, reason: str | None = None,
                     st: GenerationStats | None = None, choices: bool = True) -> dict[str, Any]:
    choice = {"text": text, "logprobs": None, "finish_reason": reason} if choices else None
    return _body("text_completion", id_, model, created, choice, st)


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
