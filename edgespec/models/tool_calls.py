"""Tool calls, as data: how a model is told about functions, how it writes a call, how calls are read.

A model whose own chat template knows tools is given them through the template (its `tools`
variable, as transformers and llama.cpp's `--jinja` pass them) and writes calls in the syntax it
was trained on:

  hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call
               (Qwen 2.5 and 3, Hermes, SmolLM3: templates that name `<tool_call>`)
  llama3-json  a bare {"name": ..., "parameters": {...}} (Llama 3.1 to 3.3's JSON tool calling)

Every other model, base models included (the embedded Gemma 3 270M), follows edgespec's plain-text
convention, `plain`: the functions are listed in a system message, a call is the line
<tool_call>{"name": ..., "arguments": {...}}</tool_call>, earlier calls are written back that way
and a function's result is a user message (docs/server.md#tool-calls).

Whatever the syntax, the reply is held to a grammar built from the functions' schemas
(`tool_grammar`): tool_choice "required" or a named function forces calls from the first token;
"auto" lets the reply be text without the syntax's opening marker, optionally followed by calls
(or, where the call has no marker, text that does not open with "{"); a response format's schema
may take the text's place. The arguments are always valid against the function's parameters.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = ["Function", "ToolCall", "ToolChoice", "ToolSyntax", "SYNTAXES", "CallSplitter", "parse_calls",
           "plain_messages", "tool_grammar", "tool_syntax_for", "tools_message"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
# JSON as the grammar writes it (decoding/grammar.py JSON_OPTIONS): compact, one space after ":" and ","
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Function:
    """A function the model may call: its name, what it does, and its parameters' JSON schema."""

    name: str
    description: str = ""
    parameters: Any = None  # a JSON schema object; None: no parameters

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(f"a function name is 1 to 64 letters, digits, '_' or '-', got {self.name!r}")
        if self.parameters is not None and not isinstance(self.parameters, dict):
            raise ConfigError(f"the parameters of function {self.name!r} must be a JSON schema object")

    @property
    def schema(self) -> dict:
        """The parameters' schema; an object of no fixed properties where none is given."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}

    def openai(self) -> dict:
        """OpenAI's tool object, as chat templates take it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.schema}}


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's tool_choice: "none", "auto", "required", or one function by name ("function")."""

    mode: str = "auto"
    function: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("none", "auto", "required", "function"):
            raise ConfigError(f"tool_choice must be none, auto, required or a function, got {self.mode!r}")
        if (self.mode == "function") != (self.function is not None):
            raise ConfigError("a function tool_choice names one function, and only it names one")


@dataclass(frozen=True)
class ToolCall:
    """One call read from a reply: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolSyntax:
    """How a model writes calls: `begin` + the call's JSON + `end`, calls joined by `separator`;
    the arguments under `arguments_key`. `marker`: the text of a chat template that says its model
    writes calls this way ("" for the plain convention, which any model can be shown)."""

    name: str
    marker: str
    begin: str
    end: str
    separator: str = "\n"
    arguments_key: str = "arguments"

    @property
    def in_template(self) -> bool:
        """The tools go through the model's own template (not a system message of edgespec's)."""
        return bool(self.marker)


SYNTAXES: dict[str, ToolSyntax] = {s.name: s for s in (
    ToolSyntax("hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>"),
    ToolSyntax("llama3-json", '"parameters": dictionary of argument name and its value', "", "", "; ", "parameters"),
    ToolSyntax("plain", "", "<tool_call>", "</tool_call>"),
)}


def tool_syntax_for(template: str | None, uses_template: bool) -> ToolSyntax:
    """The syntax a model writes calls in: its template's, where the chat format is that template
    and it names one; else the plain convention."""
    if uses_template and template:
        for syntax in SYNTAXES.values():
            if syntax.marker and syntax.marker in template and "tools" in template:
                return syntax
    return SYNTAXES["plain"]


# ---------------------------------------------------------------- the prompt


def tools_message(functions: Sequence[Function], syntax: ToolSyntax) -> str:
    """The plain convention's system message: the functions, and how to call one."""
    lines = [f"You can call these functions. To call one, answer with only {syntax.begin}"
             f'{{"name": NAME, "arguments": ARGUMENTS}}{syntax.end}, ARGUMENTS being a JSON object that follows '
             "the function's parameters; several calls go on separate lines.", "Functions:"]
    for f in functions:
        about = f": {f.description.strip().rstrip('.')}" if f.description and f.description.strip() else ""
        lines.append(f"- {f.name}{about}. Parameters: {json.dumps(f.schema, ensure_ascii=False)}")
    return "\n".join(lines)


def _call_text(call: dict, syntax: ToolSyntax) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # written back as the text it was
    body = {"name": fn.get("name", ""), syntax.arguments_key: args}
    return syntax.begin + json.dumps(body, ensure_ascii=False) + syntax.end


def plain_messages(messages: Sequence[dict], functions: Sequence[Function], syntax: ToolSyntax) -> list[dict]:
    """`messages` for a model without tools in its template: the functions in a system message
    (after the caller's), each earlier call written back as the model would have written it, each
    result as a user message naming its function."""
    names = {}
    out: list[dict] = []
    for m in messages:
        role, text = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c, syntax) for c in m["tool_calls"]]
            names.update({c.get("id"): (c.get("function") or {}).get("name", "") for c in m["tool_calls"]})
            out.append({"role": "assistant", "content": syntax.separator.join([text, *calls] if text else calls)})
        elif role == "tool":
            name = names.get(m.get("tool_call_id"), "the function")
            out.append({"role": "user", "content": f"{name} returned: {text}"})
        else:
            out.append({"role": role, "content": text})
    if functions:
        first = 1 if out and out[0]["role"] == "system" else 0
        system = tools_message(functions, syntax)
        if first:
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """`messages` as chat templates read them: a call's arguments as an object (OpenAI sends text)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                try:
                    fn["arguments"] = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError):
                    pass
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


# ---------------------------------------------------------------- the grammar


def _lark_text(text: str, special: Callable[[str], int | None]) -> str:
    """`text` as Lark terminals: its marker as a special token by id where the tokenizer has it
    as one (a special token is no text the grammar could spell), else all of it as a literal."""
    marker = text.strip()
    token = special(marker) if marker else None
    if token is None:
        return json.dumps(text) if text else ""
    before, after = text[:text.index(marker)], text[text.index(marker) + len(marker):]
    return " ".join(part for part in (json.dumps(before) if before else "", f"<[{token}]>",
                                      json.dumps(after) if after else "") if part)


def _call_schema(functions: Sequence[Function], syntax: ToolSyntax) -> dict:
    options = [{"type": "object", "additionalProperties": False, "required": ["name", syntax.arguments_key],
                "properties": {"name": {"const": f.name}, syntax.arguments_key: f.schema}} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": _JSON_OPTIONS}


def _text_then_calls(syntax: ToolSyntax, special: Callable[[str], int | None], parallel: bool) -> list[str]:
    """"auto" where calls open with a marker: any text, or text up to the marker and then calls.
    The text before a textual marker is a lazy lexeme: it ends at the marker's first appearance,
    after which only a call may follow (a greedy one would swallow the marker as text)."""
    marker = syntax.begin.strip()
    after = syntax.begin[syntax.begin.index(marker) + len(marker):]
    token = special(marker)
    lead = f"lead: TEXT <[{token}]>" if token is not None else f"lead[lazy]: TEXT {json.dumps(marker)}"
    first = " ".join(part for part in ("first: lead", json.dumps(after) if after else "", "body",
                                       _lark_text(syntax.end, special)) if part)
    more = f" ({json.dumps(syntax.separator)} call)*" if parallel else ""
    return [f"start: TEXT | first{more}", lead, first, "TEXT: /(?s:.*)/"]


def tool_grammar(functions: Sequence[Function], choice: ToolChoice, syntax: ToolSyntax, *, parallel: bool = True,
                 answer: dict | None = None, special: Callable[[str], int | None] = lambda text: None) -> str:
    """The Lark grammar (llguidance's syntax) a reply with these tools follows. `answer`: the JSON
    schema a reply that calls nothing must follow (a response format), else any text; `special`:
    a marker's special-token id, None where it is text."""
    if choice.mode == "none" or not functions:
        raise ConfigError("no tool may be called: no grammar for tool calls")
    pick = [f for f in functions if choice.mode != "function" or f.name == choice.function]
    if not pick:
        raise ConfigError(f"tool_choice names {choice.function!r}, which is not among the tools")
    call = " ".join(part for part in ("call:", _lark_text(syntax.begin, special), "body",
                                      _lark_text(syntax.end, special)) if part)
    lines = [call, f"body: %json {json.dumps(_call_schema(pick, syntax), ensure_ascii=False)}",
             f"calls: call ({json.dumps(syntax.separator)} call)*" if parallel else "calls: call"]
    if choice.mode in ("required", "function"):
        return "\n".join(["start: calls", *lines])
    if answer is not None:
        lines.append(f"answer: %json {json.dumps({**answer, 'x-guidance': _JSON_OPTIONS}, ensure_ascii=False)}")
        return "\n".join(["start: answer | calls", *lines])
    if syntax.begin.strip():
        return "\n".join([*_text_then_calls(syntax, special, parallel), *lines])
    # a bare JSON call: a reply that opens with "{" is one, any other is text
    return "\n".join(["start: TEXT | calls", *lines, "TEXT: /([^{\\s](?s:.*))?/"])


# ---------------------------------------------------------------- reading calls back


def _call_at(text: str, start: int, syntax: ToolSyntax) -> tuple[ToolCall, int] | None:
    """The call whose JSON begins at or after `start` (whitespace skipped), and where it ends."""
    decoder = json.JSONDecoder()
    pos = len(text) - len(text[start:].lstrip())
    try:
        obj, end = decoder.raw_decode(text, pos)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or syntax.arguments_key not in obj:
        return None
    call = ToolCall(obj["name"], json.dumps(obj[syntax.arguments_key], ensure_ascii=False))
    if syntax.end and text.startswith(syntax.end.strip(), len(text) - len(text[end:].lstrip())):
        end = len(text) - len(text[end:].lstrip()) + len(syntax.end.strip())
    return call, end


def parse_calls(text: str, syntax: ToolSyntax) -> tuple[str, list[ToolCall]]:
    """(the text before the first call, the calls) of a reply; ("whole text", []) without calls."""
    opener = syntax.begin.strip()
    if opener:
        first = text.find(opener)
        if first < 0:
            return text, []
        content, pos, calls = text[:first], first, []
        while (at := text.find(opener, pos)) >= 0:
            found = _call_at(text, at + len(opener), syntax)
            if found is None:
                break
            calls.append(found[0])
            pos = found[1]
        return (content, calls) if calls else (text, [])
    if not text.lstrip().startswith("{"):
        return text, []
    calls, pos = [], 0
    while (found := _call_at(text, pos, syntax)) is not None:
        calls.append(found[0])
        pos = found[1]
        rest = text[pos:].lstrip()
        if not rest.startswith(syntax.separator.strip() or "\0"):
            break
        pos = len(text) - len(rest) + len(syntax.separator.strip())
    return ("", calls) if calls else (text, [])


class CallSplitter:
    """Splits a streamed reply into the text to send as it comes and the calls read at its end.
    Text is held back while it could still become a call's opening (the marker split across
    pieces); once a call opens, the rest waits for the end, when `finish` reads it."""

    def __init__(self, syntax: ToolSyntax, calls_only: bool) -> None:
        self.syntax, self._calling = syntax, calls_only
        self._text = ""  # the whole reply so far
        self._sent = 0  # how much of it went out as text

    def push(self, piece: str) -> str:
        """The text of the reply, of what has come so far, that is not (the start of) a call."""
        self._text += piece
        if self._calling:
            return ""
        held = self._text[self._sent:]
        opener = self.syntax.begin.strip()
        if not opener:  # a bare JSON call: the reply's first character that is not a space decides
            if not held.strip():
                return ""
            self._calling = held.lstrip().startswith("{")
            cut = 0 if self._calling else len(held)
        elif (at := held.find(opener)) >= 0:
            self._calling, cut = True, at
        else:  # keep back what could be the marker's first characters
            cut = len(held) - next((n for n in range(min(len(opener) - 1, len(held)), 0, -1)
                                    if opener.startswith(held[-n:])), 0)
        self._sent += cut
        return held[:cut]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the reply's text not sent yet, its calls), at its end. A call that cannot be read (a
        reply cut short) is sent as the text it is."""
        _, calls = parse_calls(self._text, self.syntax)
        rest = "" if calls else self._text[self._sent:]
        self._sent = len(self._text)
        return rest, calls
