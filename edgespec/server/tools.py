"""What a request's response_format, grammar, tools and tool_choice ask of the reply.

`RequestFormat.of(req)` reads them once (after pydantic has checked their shape): the functions
the prompt lists, the tool choice, the response format. Once the prompt is rendered and the chat
format has said how its model writes calls (models/tool_calls.py), `grammar_format` gives the one
ResponseFormat the reply is held to, which the engine compiles (a bad schema or grammar is a 400
naming it). `ReplyCalls` reads the calls out of the reply, streamed or whole, as OpenAI's
`tool_calls`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..decoding.grammar import ResponseFormat
from ..models.tool_calls import CallSplitter, Function, ToolCall, ToolChoice, ToolSyntax, parse_calls, tool_grammar
from .schemas import ChatCompletionRequest, CompletionRequest, new_id

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["RequestFormat", "ReplyCalls", "format_param", "openai_calls"]


def _choice(req: ChatCompletionRequest) -> ToolChoice:
    """OpenAI's default: "auto" where tools are given, "none" where they are not."""
    c = req.tool_choice
    if c is None:
        return ToolChoice("auto" if req.tools else "none")
    if isinstance(c, str):
        return ToolChoice(c)
    return ToolChoice("function", c.function.name)


def _response_format(req: ChatCompletionRequest | CompletionRequest) -> ResponseFormat | None:
    if req.grammar is not None:
        return ResponseFormat.grammar(req.grammar)
    if req.json_schema is not None:
        return ResponseFormat.json_schema(req.json_schema)
    body = req.response_format
    if body is None or body.type == "text":
        return None
    if body.type == "json_object":
        return ResponseFormat.json_object()
    return ResponseFormat.json_schema(body.json_schema.schema_, name=body.json_schema.name)


def format_param(req: ChatCompletionRequest | CompletionRequest) -> str:
    """The request field an error about its format names."""
    if isinstance(req, ChatCompletionRequest) and req.tools and req.tool_choice != "none":
        return "tools"
    return "grammar" if req.grammar is not None else ("json_schema" if req.json_schema is not None
                                                      else "response_format")


@dataclass(frozen=True)
class RequestFormat:
    """What shapes one request's reply: its response format and, for chat, its tools."""

    response: ResponseFormat | None = None
    functions: tuple[Function, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    parallel: bool = True

    @classmethod
    def of(cls, req: ChatCompletionRequest | CompletionRequest) -> RequestFormat:
        fmt = _response_format(req)
        if not isinstance(req, ChatCompletionRequest) or not req.tools:
            return cls(fmt)
        functions = tuple(Function(t.function.name, t.function.description, t.function.parameters)
                          for t in req.tools)
        return cls(fmt, functions, _choice(req), req.parallel_tool_calls)

    @property
    def calls(self) -> bool:
        """The model may call functions."""
        return self.choice.mode != "none" and bool(self.functions)

    def prompt_tools(self) -> list[dict] | None:
        """The tools the prompt lists (OpenAI's objects); none where none may be called."""
        return [f.openai() for f in self.functions] if self.calls else None

    def grammar_format(self, syntax: ToolSyntax, special: Callable[[str], int | None]) -> ResponseFormat | None:
        """The one format the reply follows (None: free text): the calls in the model's syntax,
        with the response format's schema for a reply that calls nothing; or the response format."""
        if not self.calls:
            return self.response
        answer = None
        if self.response is not None and self.response.kind in ("json_schema", "json_object"):
            answer = json.loads(self.response.spec) if self.response.spec else {"type": "object"}
        lark = tool_grammar(self.functions, self.choice, syntax, parallel=self.parallel, answer=answer,
                            special=special)
        return ResponseFormat.grammar(lark, name="tool-call")


def openai_calls(calls: list[ToolCall], streamed: bool = False) -> list[dict[str, Any]]:
    """OpenAI's tool_calls objects (with their index, in a streamed delta)."""
    out = []
    for i, call in enumerate(calls):
        body = {"id": new_id("call"), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        out.append({"index": i, **body} if streamed else body)
    return out


class ReplyCalls:
    """One reply's calls: `push` gives the text to stream as it comes, `finish` the rest and the calls."""

    def __init__(self, fmt: RequestFormat, syntax: ToolSyntax) -> None:
        self.syntax = syntax
        self._splitter = CallSplitter(syntax, calls_only=fmt.choice.mode in ("required", "function"))

    def push(self, text: str) -> str:
        return self._splitter.push(text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._splitter.finish()

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole reply's content (None where it only calls) and calls."""
        content, calls = parse_calls(text, self.syntax)
        return (content.strip() or None, calls) if calls else (text, [])
