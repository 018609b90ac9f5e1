"""VocabTrim (Goel et al., arXiv 2506.22694): keep only the K tokens the target generates
most often in the draft's LM head, plus every special, control and chat-template token.

The target generates on calibration prompts (built-in and/or a user file); the counts of
its generated tokens pick the kept set. The pure functions here are what tests exercise;
`calibrate` runs a transformers model, `calibrate_runtime` the exported target itself on an
edgespec runtime (no torch: what a GGUF source uses).
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..files import path_problem
from ..models.families import Family

__all__ = ["Calibration", "chat_text", "special_tokens", "builtin_prompts", "read_prompt_file", "always_kept_ids",
           "choose_vocab", "coverage", "token_counts", "calibrate", "calibrate_runtime"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    counts: np.ndarray  # (V,) how often the target generated each token
    source: str  # what it was measured on, for the manifest
    n_tokens: int


def builtin_prompts() -> list[dict]:
    data = resources.files("edgespec.exporters").joinpath("data/calibration_prompts.json").read_text()
    return json.loads(data)["prompts"]


def _messages(value, where: str) -> list[dict]:
    """A JSON line's "messages", checked: a list of {"role": str, "content": str} objects."""
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise ConfigError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                          "objects with string values")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the calibration file {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"calibration file {path.name} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start})") from None


def read_prompt_file(path: Path) -> list[dict]:
    """One prompt per line; a JSON line {"messages": [...]} or {"text": ...} is taken as such.
    A file that is not UTF-8 text or a JSON line of another shape is a one-line ConfigError."""
    problem = path_problem(path) or ("a folder" if path.is_dir() else None)
    if problem == "missing":
        raise ConfigError(f"calibration file not found: {path}")
    if problem is not None:  # /dev/zero would be read until memory runs out, a FIFO wait for a writer
        raise ConfigError(f"calibration file {path} is {problem}, not a file of prompts")
    prompts = []
    for n, line in enumerate(_text(path).splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            where = f"{path.name} line {n}"
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ConfigError(f"{where}: bad JSON line: {str(e) or type(e).__name__}") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{where}: a JSON line must be an object with \"messages\" or \"text\"")
            if "messages" in obj:
                prompts.append({"kind": "messages", "messages": _messages(obj["messages"], where)})
                continue
            line = obj.get("text", "")
            if not isinstance(line, str):
                raise ConfigError(f"{where}: \"text\" must be a string")
        prompts.append({"kind": "text", "text": line})
    if not prompts:
        raise ConfigError(f"calibration file {path} holds no prompts")
    return prompts


def token_counts(sequences: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for seq in sequences:
        np.add.at(counts, np.asarray(seq, dtype=np.int64), 1)
    return counts


def always_kept_ids(tokenizer, family: Family, template_ids: Iterable[int] = ()) -> set[int]:
    """Special/control tokens and chat-template tokens, minus reserved placeholders
    (e.g. Gemma's thousands of `<unusedN>`), which a model never emits."""
    reserved = re.compile(family.reserved_token_pattern) if family.reserved_token_pattern else None
    special = set(tokenizer.all_special_ids)
    special.update(tid for tid, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    keep = {int(i) for i in special
            if not (reserved and reserved.fullmatch(tokenizer.convert_ids_to_tokens(int(i)) or ""))}
    keep.update(int(i) for i in template_ids)
    return keep


def choose_vocab(counts: np.ndarray, k: int, always: set[int]) -> np.ndarray:
    """Sorted target ids of the kept set: `always` plus the most frequent tokens, K in all."""
    vocab = len(counts)
    if k > vocab:
        raise ConfigError(f"--draft-vocab {k} is larger than the vocabulary ({vocab})")
    if k < len(always):
        raise ConfigError(f"--draft-vocab {k} is smaller than the {len(always)} special and chat tokens "
                          "that must be kept")
    mask = np.zeros(vocab, dtype=bool)
    mask[list(always)] = True
    # stable order: by count, ties by id, so exports are reproducible
    order = np.lexsort((np.arange(vocab), -counts))
    rest = order[~mask[order]][: k - len(always)]
    mask[rest] = True
    return np.flatnonzero(mask).astype(np.int64)


def coverage(counts: np.ndarray, keep: np.ndarray) -> float:
    """Share of the target's generated tokens that the kept set contains."""
    total = counts.sum()
    return float(counts[keep].sum() / total) if total else 0.0


def special_tokens(tokenizer) -> dict[str, str]:
    """The special-token strings a chat template sees, as transformers hands them (its
    special_tokens_map); BOS and EOS are "" when the tokenizer has none."""
    out = {"bos_token": "", "eos_token": ""}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            out[name] = value
    return out


def chat_text(renderer, tokenizer, messages: list[dict], chat_template: str, *,
              add_generation_prompt: bool = True) -> str:
    """`messages` through the source's chat template, rendered by `renderer` (a
    models.templates.TemplateRenderer: the template is the source's code, so it runs with a time
    and memory limit, its errors one line naming it)."""
    context = {"messages": messages, "add_generation_prompt": add_generation_prompt, **special_tokens(tokenizer)}
    return renderer.render(chat_template, context, origin="the source model's")


def _prompt_ids(tokenizer, prompts: list[dict], chat_template: str | None) -> list[list[int]]:
    from ..models.templates import TemplateRenderer

    out = []
    with TemplateRenderer() as renderer:  # started on the first chat prompt only
        for p in prompts:
            if p["kind"] == "text" or chat_template is None:
                out.append(tokenizer(p["text"]).input_ids)
                continue
            messages = p.get("messages") or [{"role": "user", "content": p["text"]}]
            text = chat_text(renderer, tokenizer, messages, chat_template)
            out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def calibrate(model, tokenizer, prompts: list[dict], source: str, *, chat_template: str | None = None,
              max_new_tokens: int = 64,
              batch_size: int = 8, seed: int = 0, progress=None) -> Calibration:
    """Let the target (a transformers model) generate on `prompts`; count what it generates.

    Sampled at temperature 0.8 so the counts reflect the target's distribution, not only its
    greedy path; batched with left padding, which is far faster than one prompt at a time."""
    import torch

    torch.manual_seed(seed)
    ids = _prompt_ids(tokenizer, prompts, chat_template)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    generated: list[list[int]] = []
    for start in range(0, len(ids), batch_size):
        chunk = ids[start : start + batch_size]
        width = max(map(len, chunk))
        inp = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
        with torch.no_grad():
            out = model.generate(inp, attention_mask=mask, do_sample=True, temperature=0.8, top_p=0.95,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad)
        for row in out[:, width:].tolist():
            generated.append([t for t in row if t != pad])
        if progress:
            progress(len(chunk))
    counts = token_counts(generated, model.config.vocab_size)
    return Calibration(counts=counts, source=source, n_tokens=int(counts.sum()))


def calibrate_runtime(runtime, tokenizer, prompts: list[dict], source: str, *, chat_template: str | None = None,
                      stop_ids: Iterable[int] = (), max_new_tokens: int = 64, seed: int = 0,
                      progress=None) -> Calibration:
    """As `calibrate`, with an edgespec Runtime (the exported target) generating one prompt at a time.

    Sampled as transformers' generate() samples there (temperature 0.8, top-p 0.95, its default
    top-k 50), so both kinds of source count the same distribution."""
    from ..decoding.sampling import SamplingParams, probabilities, sample

    # top-k first, on the k best logits only: the same distribution as SamplingParams(top_k=50) over
    # the whole row, without sorting a 262k vocabulary every token, which dominated the calibration
    top_k, params = 50, SamplingParams(temperature=0.8, top_p=0.95)
    rng = np.random.default_rng(seed)
    stops = set(stop_ids)
    generated: list[list[int]] = []
    for ids in _prompt_ids(tokenizer, prompts, chat_template):
        runtime.reset()
        logits = runtime.forward(ids, 1)
        out: list[int] = []
        for _ in range(max_new_tokens):
            row = logits[-1]
            best = np.argpartition(row, -top_k)[-top_k:] if len(row) > top_k else np.arange(len(row))
            tok = int(best[sample(probabilities(row[best], params), rng)])
            if tok in stops:
                break
            out.append(tok)
            logits = runtime.forward([tok], 1)
        generated.append(out)
        if progress:
            progress(1)
    counts = token_counts(generated, runtime.vocab_size)
    return Calibration(counts=counts, source=source, n_tokens=int(counts.sum()))
