"""Benchmark prompt suites, shipped as data (bench/data/<suite>.jsonl).

One JSON object per line:

    {"id": "chat-sky", "messages": [{"role": "user", "content": "Why is the sky blue?"}]}
    {"id": "code-stack", "text": "class Stack:\\n"}          # raw completion, no chat format
    {"id": "...", "class": "mine", "messages": [...]}      # own files may name the class

A suite's chat prompts belong to the class named like the suite (a file's: its "class" field, else
the file's stem); a raw text prompt is a base-model continuation, class "continuation" unless its
record names one. How a prompt is shown to the model and where its runs end is endings.py's:
as `edgespec chat` shows a conversation and ends a reply.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import ConfigError

__all__ = ["SUITES", "Prompt", "load_prompts", "parse_prompt", "encode_prompt", "prompt_format", "jsonl_records"]

logger = logging.getLogger(__name__)

SUITES = ("chat", "code", "grounded", "long")  # data/<name>.jsonl; "all" = every one, in this order
CONTINUATION = "continuation"  # the class of a raw text prompt whose record names none
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    id: str
    cls: str  # the prompt class results are grouped by
    messages: tuple[tuple[str, str], ...] = ()  # (role, content); empty for a raw completion
    text: str | None = None  # raw completion prompt

    @property
    def is_chat(self) -> bool:
        return self.text is None


def parse_prompt(obj: object, default_cls: str, where: str) -> Prompt:
    """One JSONL record → Prompt, or a one-line ConfigError naming `where`."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    cls = obj.get("class", default_cls)
    pid = obj.get("id", where.rsplit(":", 1)[-1])
    if not isinstance(cls, str) or not cls or not isinstance(pid, str) or not pid:
        raise ConfigError(f"{where}: 'class' and 'id' must be non-empty strings")
    has_msgs, has_text = "messages" in obj, "text" in obj
    if has_msgs == has_text:
        raise ConfigError(f"{where}: give exactly one of 'messages' (chat) or 'text' (raw completion)")
    if has_text:
        if not isinstance(obj["text"], str) or not obj["text"].strip():
            raise ConfigError(f"{where}: 'text' must be a non-empty string")
        # a raw text is a base-model continuation: its own class unless the record names one
        return Prompt(pid, obj.get("class", CONTINUATION), text=obj["text"])
    return Prompt(pid, cls, messages=_messages(obj["messages"], where))


def _messages(msgs: object, where: str) -> tuple[tuple[str, str], ...]:
    """A record's 'messages' as (role, content) pairs, the last one the user's; else a one-line
    ConfigError naming `where`."""
    if not isinstance(msgs, list) or not msgs:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for m in msgs:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ConfigError(f"{where}: each message needs a role ({'/'.join(ROLES)}) and a string content")
        out.append((m["role"], m["content"]))
    if out[-1][0] != "user":
        raise ConfigError(f"{where}: the last message must be the user's (the model answers it)")
    return tuple(out)


def jsonl_records(text: str, name: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of a JSONL text; a one-line ConfigError
    naming `name` and the line for one that is not JSON."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name}:{n}: not valid JSON ({e.msg})") from None


def _read_jsonl(text: str, default_cls: str, name: str) -> list[Prompt]:
    prompts = []
    for n, obj in jsonl_records(text, name):
        prompts.append(parse_prompt(obj, default_cls, f"{name}:{n}"))
    if not prompts:
        raise ConfigError(f"{name} holds no prompts")
    ids = [(p.cls, p.id) for p in prompts]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{name}: prompt ids repeat within a class")
    return prompts


def _builtin(name: str) -> list[Prompt]:
    text = resources.files("edgespec.bench").joinpath("data", f"{name}.jsonl").read_text(encoding="utf-8")
    return _read_jsonl(text, name, f"suite {name}")


def load_prompts(spec: str) -> list[Prompt]:
    """Prompts from `spec`: "all", suite names joined by commas ("chat,code"), or a .jsonl file."""
    spec = spec.strip()
    if spec.endswith(".jsonl") or "/" in spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ConfigError(f"prompt file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read prompt file {path}: {e}") from None
        return _read_jsonl(text, path.stem, path.name)
    names = list(SUITES) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in names if s not in SUITES]
    if unknown or not names:
        raise ConfigError(f"unknown prompt suite {', '.join(unknown) or repr(spec)} "
                          f"(suites: all, {', '.join(SUITES)}; or a .jsonl file)")
    return [p for name in dict.fromkeys(names) for p in _builtin(name)]


def prompt_format(chat_format) -> str:
    """How chat prompts are rendered and end, in one phrase (a session.ChatFormat, as chat picks it)."""
    return f"{chat_format.describe()}; replies end where edgespec chat ends them"


def _plain_chat(messages: tuple[tuple[str, str], ...]) -> str:
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    return "".join(f"{names[r]}: {c.strip()}\n\n" for r, c in messages) + "Assistant:"


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of `prompt` under the bundle's chat template, or plain text without one: the
    rendering dev scripts compare runs on. The bench itself renders as chat does (endings.render)."""
    if not prompt.is_chat:
        return tokenizer.encode(prompt.text)
    if tokenizer.has_chat_template:
        return tokenizer.encode_chat([{"role": r, "content": c} for r, c in prompt.messages])
    return tokenizer.encode(_plain_chat(prompt.messages))
