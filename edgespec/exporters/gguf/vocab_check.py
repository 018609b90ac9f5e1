"""Whether a draft GGUF may draft for a target GGUF: the rule llama.cpp's speculative decoding
applies before it pairs two models (common/speculative.cpp, common_speculative_are_compatible):
the same vocabulary type, the same BOS/EOS tokens and whether they are added, vocabulary sizes
within 128 tokens, and identical token texts for every id both have from id 5 on (the first few
ids are special tokens some conversions renumber). A pair that passes here also passes in
llama.cpp's server (`-m target.gguf -md draft.gguf`)."""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ExportError

__all__ = ["CHECK_START_ID", "MAX_SIZE_DIFFERENCE", "VocabFacts", "check_compatible", "incompatibility",
           "vocab_facts"]

# llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE and SPEC_VOCAB_CHECK_START_TOKEN_ID
MAX_SIZE_DIFFERENCE = 128
CHECK_START_ID = 5


@dataclass(frozen=True)
class VocabFacts:
    """What the compatibility rule reads from one model's vocabulary."""

    kind: str | None  # tokenizer.ggml.model: llama (SentencePiece), gpt2 (BPE), ...
    tokens: tuple[bytes, ...]  # token texts by id, as stored
    bos: int | None
    eos: int | None
    add_bos: bool | None
    add_eos: bool | None


def _tokens(reader) -> tuple[bytes, ...]:
    """Token texts as raw bytes, without decoding 100k+ strings one by one."""
    f = reader.fields.get("tokenizer.ggml.tokens")
    if f is None or not isinstance(f.value, list):
        return ()
    return tuple(f.value)  # reader.GGUFField keeps strings as the bytes stored


def vocab_facts(reader) -> VocabFacts:
    """The facts of an open GGUF's vocabulary (reader.open_gguf)."""
    from .reader import field

    def opt_int(key: str) -> int | None:
        v = field(reader, key)
        return int(v) if v is not None and not isinstance(v, bool | str) else None

    def opt_bool(key: str) -> bool | None:
        v = field(reader, key)
        return bool(v) if v is not None else None

    kind = field(reader, "tokenizer.ggml.model")
    return VocabFacts(kind=str(kind) if kind is not None else None, tokens=_tokens(reader),
                      bos=opt_int("tokenizer.ggml.bos_token_id"), eos=opt_int("tokenizer.ggml.eos_token_id"),
                      add_bos=opt_bool("tokenizer.ggml.add_bos_token"),
                      add_eos=opt_bool("tokenizer.ggml.add_eos_token"))


def _show(token: bytes) -> str:
    text = token.decode("utf-8", "replace")
    return repr(text if len(text) <= 24 else text[:21] + "...")


def incompatibility(target: VocabFacts, draft: VocabFacts) -> str | None:
    """Why `draft` cannot draft for `target` under llama.cpp's rule (the first reason), or None."""
    if not target.tokens or not draft.tokens:
        return "a model has no vocabulary (tokenizer.ggml.tokens)"
    if target.kind != draft.kind:
        return f"vocabulary types differ (target {target.kind!r}, draft {draft.kind!r})"
    for what in ("bos", "eos"):
        t, d = getattr(target, f"add_{what}"), getattr(draft, f"add_{what}")
        if t != d:
            return f"adding {what.upper()} differs (target {t}, draft {d})"
        t, d = getattr(target, what), getattr(draft, what)
        if t != d:
            return f"{what.upper()} token ids differ (target {t}, draft {d})"
    nt, nd = len(target.tokens), len(draft.tokens)
    if abs(nt - nd) > MAX_SIZE_DIFFERENCE:
        return f"vocabulary sizes differ by more than {MAX_SIZE_DIFFERENCE} (target {nt}, draft {nd})"
    for i in range(CHECK_START_ID, min(nt, nd)):
        if target.tokens[i] != draft.tokens[i]:
            return f"token {i} differs (target {_show(target.tokens[i])}, draft {_show(draft.tokens[i])})"
    return None


def check_compatible(target: VocabFacts, draft: VocabFacts, draft_name: str = "the draft") -> None:
    """A one-line ExportError naming the first mismatch when `draft` cannot draft for `target`."""
    reason = incompatibility(target, draft)
    if reason is not None:
        raise ExportError(f"{draft_name} cannot draft for this target (llama.cpp's vocabulary rule): {reason}")
