"""llama.cpp's BPE pre-tokenizers as data, keyed by the GGUF's `tokenizer.ggml.pre`.

A byte-level BPE GGUF (`tokenizer.ggml.model = gpt2`) names its pre-tokenizer; llama.cpp
(`src/llama-vocab.cpp`: the name -> `LLAMA_VOCAB_PRE_TYPE_*` chain in `load`, then the regex list
of each type in the `llm_tokenizer_bpe` constructor) splits the text with each regex of the list in
turn, every match and every run between two matches becoming a piece that the next regex splits
again, then byte-encodes the pieces as GPT-2 does. A `tokenizers` Sequence of isolated Splits
followed by a ByteLevel without its own regex is that same pipeline. The regexes are llama.cpp's
own spellings (its `(?:'[sS]|...)` for `(?i:'s|...)`, its ASCII look-ahead form of the
Tekken/GPT-4o letter classes), so both sides run the same expression.

Types whose llama.cpp split is hand-written rather than a regex (Kimi-K2's `\\p{Han}`, AFMoE's and
Tiny Aya's digit grouping), whose letter-case classes llama.cpp only approximates (Youtu, Tiny
Aya), or that are not byte-level (Gemma 4, Sarvam, whitespace) are left out: an export refuses
them rather than tokenize differently from llama.cpp.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ExportError

__all__ = ["PreTokenizer", "PRE_TOKENIZERS", "pre_tokenizer", "supported_names"]


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer type.

    regexes: applied in order, each splitting every piece of the one before (isolated).
    ignore_merges: a piece that is a token of the vocabulary is that token, unmerged (llama.cpp's
      `ignore_merges`, the `ignore_merges` of a `tokenizers` BPE).
    add_bos: llama.cpp's default when the GGUF has no `tokenizer.ggml.add_bos_token`.
    """

    kind: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False

    def __post_init__(self) -> None:
        if not self.regexes:
            raise ValueError(f"pre-tokenizer {self.kind} has no regex")


# the GPT-2 split, and the Llama 3 / Qwen 2 ones that differ from each other only in \p{N}{1,3} / \p{N}
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"  # a letter that is not a-z / not A-Z
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"

_TYPES: tuple[PreTokenizer, ...] = (
    PreTokenizer("default", (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    PreTokenizer("llama3", (_LLAMA3,), ignore_merges=True, add_bos=True),
    PreTokenizer("dbrx", (_LLAMA3,)),
    PreTokenizer("falcon", (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    PreTokenizer("starcoder", (r"\p{N}", _GPT2)),
    PreTokenizer("gpt2", (_GPT2,)),
    PreTokenizer("qwen2", (_QWEN2,)),
    PreTokenizer("qwen35", (_QWEN35,)),
    PreTokenizer("bloom", (_BLOOM,)),
    PreTokenizer("viking", (_BLOOM, r"\p{N}")),
    PreTokenizer("tekken", (_TEKKEN,), ignore_merges=True, add_bos=True),
    PreTokenizer("gpt4o", (_GPT4O,)),
    PreTokenizer("seed-coder", (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                                r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    PreTokenizer("bailingmoe", (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",)),
    PreTokenizer("minicpm5", (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
                              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True),
)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {t.kind: t for t in _TYPES}

# `tokenizer.ggml.pre` -> type, as llama.cpp's llama_vocab::impl::load maps them
_NAMES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe"), "dbrx"),
    "falcon": "falcon",
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    "starcoder"),
    # "gpt2" is no llama.cpp name (it spells it "gpt-2"); older edgespec exports accepted it
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "gigachat",
                     "a.x-4.0", "mellum", "exaone4", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
                     "modern-bert"), "gpt2"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
                     "grok-2"), "qwen2"),
    "qwen35": "qwen35",
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), "bloom"),
    "viking": "viking",
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o"),
    "seed-coder": "seed-coder",
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe"),
    "minicpm5": "minicpm5",
}


def supported_names() -> list[str]:
    """The `tokenizer.ggml.pre` values edgespec reads, sorted."""
    return sorted(_NAMES)


def pre_tokenizer(name: str) -> PreTokenizer:
    """The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre = name`; ExportError if unknown."""
    kind = _NAMES.get(name)
    if kind is None:
        raise ExportError(f"the GGUF's BPE pre-tokenizer {name[:40]!r} is not supported; supported: "
                          f"{', '.join(supported_names())}")
    return PRE_TOKENIZERS[kind]
