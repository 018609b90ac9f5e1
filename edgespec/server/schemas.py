"""OpenAI request and response bodies (the subset edgespec serves), as pydantic models.

Requests are validated when parsed: a bad field becomes a 400 in OpenAI's error shape
(errors.py). Unknown fields are ignored, as OpenAI-compatible servers do, but known features
edgespec does not implement (n > 1, logprobs, penalties...) are refused by name
rather than dropped silently.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ChatMessage", "ChatCompletionRequest", "CompletionRequest", "StreamOptions", "Usage",
    "ModelCard", "ModelList", "unsupported_features", "new_id", "now", "COMPLETION_MAX_TOKENS",
    "ResponseFormatBody", "ToolDef", "ToolCallBody", "NamedToolChoice", "format_conflicts",
]

COMPLETION_MAX_TOKENS = 16  # OpenAI's default reply length for /v1/completions


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def _unicode(text: str) -> str:
    # JSON may carry a lone surrogate ("\ud800"): not text, and the tokenizer and the reply's
    # UTF-8 encoding would fail on it deep inside (a 500); here it is a 400 naming the field
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text (a lone surrogate \\u{ord(text[e.start]):04x} at offset "
                         f"{e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _Request(BaseModel):
    # strict: a value of another JSON type is refused, not coerced ("7" is no seed, true no token
    # id, 5.0 no count); an integer still stands for a number. NaN and Infinity, which Python's
    # JSON parser accepts, are no numbers: refused by name (errors.validation_message)
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # clients send "temperature": null for "not set", as OpenAI accepts
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class TextPart(_Request):
    type: Literal["text"]
    text: Text


# -- structured output and tool calls: response_format, tools, tool_choice -------------------

_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule


class JSONSchemaBody(_Request):
    name: Annotated[str, Field(pattern=_FUNCTION_NAME)] = "response"
    description: Text | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormatBody(_Request):
    """OpenAI's response_format: text, json_object, or json_schema with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaBody | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormatBody:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response_format needs its json_schema object")
        return self


class FunctionDef(_Request):
    name: Annotated[str, Field(pattern=_FUNCTION_NAME)]
    description: Text = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Request):
    name: Annotated[str, Field(pattern=_FUNCTION_NAME)]


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Request):
    name: Text
    arguments: Text = "{}"  # JSON text, as OpenAI sends it


class ToolCallBody(_Request):
    """A call in an earlier assistant message of the conversation."""

    id: Text = ""
    type: Literal["function"] = "function"
    function: CalledFunction


# -- messages -----------------------------------------------------------------------------------

class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Request):
    include_usage: bool = False


Stop = Text | Annotated[list[Text], Field(max_length=4)] | None


class _Sampling(_Request):
    """Fields shared by both endpoints; defaults are OpenAI's."""

    model: str | None = None  # any name is accepted: the server runs one model
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # an extension, as in llama.cpp's and vLLM's servers
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)  # an extension, as in llama.cpp's and vLLM's servers
    stop: Stop = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    n: int = Field(default=1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool | Annotated[int, Field(ge=0, le=20)] | None = None  # chat: true/false; completions: a count
    user: str | None = None
    # structured output: OpenAI's response_format; `grammar` (GBNF or Lark) and `json_schema` as
    # llama.cpp's server takes them
    response_format: ResponseFormatBody | None = None
    grammar: Text | None = None
    json_schema: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Stop) -> Stop:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def asked_tokens(self) -> int | None:
        """The reply length the client asked for; None: the endpoint's default."""
        return self.max_tokens


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # tool calls (server/tools.py)
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def asked_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins where a client sends both
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        """Messages for the chat template ("developer" is OpenAI's newer name for "system"); an
        assistant's earlier calls and a tool message's call id where they have them."""
        out = []
        for m in self.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | list[int] = Field(min_length=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def unsupported_features(req: _Sampling) -> list[tuple[str, str]]:
    """(param, message) for every feature asked for that edgespec does not implement."""
    out = []
    if req.n != 1:
        out.append(("n", "only n=1 is supported"))
    if req.presence_penalty or req.frequency_penalty:
        out.append(("presence_penalty" if req.presence_penalty else "frequency_penalty",
                    "presence and frequency penalties are not supported (they would change the target's "
                    "distribution that speculative decoding keeps exactly)"))
    if req.logit_bias:
        out.append(("logit_bias", "logit_bias is not supported"))
    out += _logprobs_unsupported(req)
    if isinstance(req, CompletionRequest):
        out += _completion_unsupported(req)
    return out


def _logprobs_unsupported(req: _Sampling) -> list[tuple[str, str]]:
    if req.logprobs not in (None, False, 0):
        return [("logprobs", "logprobs are not supported")]
    if getattr(req, "top_logprobs", None):  # it asks for logprobs too, and needs them
        return [("top_logprobs", "top_logprobs are not supported (nor logprobs, which they need)")]
    return []


def _completion_unsupported(req: CompletionRequest) -> list[tuple[str, str]]:
    out = []
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) and len(req.prompt) > 1:
        out.append(("prompt", "one prompt per request is supported"))
    if req.echo:
        out.append(("echo", "echo is not supported"))
    if req.suffix:
        out.append(("suffix", "suffix (insertion) is not supported"))
    if req.best_of not in (None, 1):
        out.append(("best_of", "only best_of=1 is supported"))
    return out


def format_conflicts(req: _Sampling) -> list[tuple[str, str]]:
    """(param, message) for structured-output and tool fields that contradict each other."""
    given = [name for name, value in (("response_format", req.response_format), ("grammar", req.grammar),
                                      ("json_schema", req.json_schema))
             if value is not None and not (name == "response_format" and value.type == "text")]
    out = [(given[1], f"give one of {' and '.join(given)}, not both")] if len(given) > 1 else []
    if isinstance(req, ChatCompletionRequest) and req.tool_choice not in (None, "none") and not req.tools:
        out.append(("tool_choice", "tool_choice needs tools"))
    return out


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "edgespec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
