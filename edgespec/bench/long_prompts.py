"""The `long` prompt class: held-out questions over a document of a given length, the grounded
request an edge user pastes (benchmarks/bench_peer.py --long, issue 38).

The documents are licence text that ships inside the installed Python packages (every distinct
licence file once, in name order, repeated if the packages hold too little): no download, the
same text on every machine with the same packages, prose the models were not tuned on here. A
question record names the document's length in tokens of the model's tokenizer; the document is
cut there, at a line break.
"""
from __future__ import annotations

import glob
import os
import site
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..errors import ConfigError
from .suites import jsonl_records

__all__ = ["LONG_CLASS", "long_class", "licence_text", "cut_to_tokens", "long_prompts", "read_questions"]

LONG_CLASS = "long"
_PROMPT = ("Read the document below, then answer the question that follows it in two or three sentences.\n\n"
           "<document>\n{doc}\n</document>\n\nQuestion: {question}")


def licence_text(folders: Iterable[str] | None = None) -> str:
    """Every distinct licence file of the packages installed in `folders` (default: this Python's
    site-packages), in name order, joined by blank lines; a ConfigError when there are none."""
    seen: set[str] = set()
    parts: list[str] = []
    for folder in folders if folders is not None else site.getsitepackages():
        files = glob.glob(f"{folder}/*.dist-info/LICEN[CS]E*") + glob.glob(f"{folder}/*.dist-info/licenses/*")
        for f in sorted(files):
            if not os.path.isfile(f):
                continue
            text = Path(f).read_text(encoding="utf-8", errors="replace").strip()
            if text and text not in seen:
                seen.add(text)
                parts.append(text)
    if not parts:
        raise ConfigError("no licence files found in the installed packages to build long prompts from")
    return "\n\n".join(parts)


def cut_to_tokens(text: str, n_tokens: int, count: Callable[[str], int]) -> str:
    """The longest prefix of `text` (repeated as needed), ended at a line break, of at most
    `n_tokens` tokens by `count`; found by bisection, so `count` runs a few dozen times."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    while count(text) <= n_tokens and len(text) < 64 * n_tokens:  # about 4 characters a token: plenty
        text = text + "\n\n" + text
    lo, hi = 0, len(text)
    while lo < hi:  # the most characters whose tokens fit
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(text[:mid]) <= n_tokens else (lo, mid - 1)
    cut = text.rfind("\n", 0, lo)
    return text[:cut if cut > 0 else lo].rstrip()


def long_class(doc_tokens: int) -> str:
    """The class of a question over a document of `doc_tokens` tokens: `long-2k`, `long-8k`, ...
    (`long-300` below a thousand), so a report gives each document length its own row."""
    return f"{LONG_CLASS}-{round(doc_tokens / 1000)}k" if doc_tokens >= 1000 else f"{LONG_CLASS}-{doc_tokens}"


def read_questions(path: str | os.PathLike) -> list[dict]:
    """Question records of a JSONL file: {"id", "doc_tokens", "question"}; a one-line ConfigError
    for a bad one."""
    out = []
    for n, obj in jsonl_records(Path(path).read_text(encoding="utf-8"), Path(path).name):
        if not (isinstance(obj, dict) and isinstance(obj.get("id"), str) and isinstance(obj.get("question"), str)
                and isinstance(obj.get("doc_tokens"), int) and obj["doc_tokens"] > 0):
            raise ConfigError(f"{Path(path).name}:{n}: need 'id', 'question' and a positive 'doc_tokens'")
        out.append(obj)
    return out


def long_prompts(questions: Sequence[dict], count: Callable[[str], int], text: str | None = None) -> list[dict]:
    """Prompt records of the `long` class (edgespec bench's JSONL): each question after its document,
    cut to its `doc_tokens` by `count` (a document of a given length is built once)."""
    text = licence_text() if text is None else text
    docs: dict[int, str] = {}
    out = []
    for q in questions:
        n = q["doc_tokens"]
        if n not in docs:
            docs[n] = cut_to_tokens(text, n, count)
        content = _PROMPT.format(doc=docs[n], question=q["question"])
        out.append({"id": q["id"], "class": long_class(n), "messages": [{"role": "user", "content": content}]})
    return out
