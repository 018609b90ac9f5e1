"""A GGUF's own tokenizer as a `tokenizers` tokenizer, without transformers.

SentencePiece-style vocabularies (`tokenizer.ggml.model = llama`: Gemma, Llama 2) carry tokens and
scores but no merges; llama.cpp merges the adjacent pair whose joined piece scores highest. A BPE
whose merges are ordered by the joined piece's score does the same, so the merges are generated
from the vocabulary, as transformers' GGUF converter does (Gemma's merge order being its token
order, which its scores follow). Byte-level BPE vocabularies
(`gpt2`: Qwen, Llama 3, SmolLM) carry their merges and name their pre-tokenizer, whose regexes
are llama.cpp's own (gguf/pretokenizers.py). Control tokens are special added tokens and
user-defined tokens plain added tokens, both matched in the raw text before the model, as
llama.cpp does with special tokens parsed; tests/test_gguf_tokenizer.py checks the ids against
llama.cpp's.

`GGUFTokenizer` answers the part of a transformers tokenizer that the exporter uses
(tokenizer_export, vocabtrim), so both kinds of source take the same path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ... import checks
from ...errors import ExportError
from ...models.families import merges_by_position
from .pretokenizers import pre_tokenizer
from .reader import field

__all__ = ["GGUFTokenizer", "build_tokenizer", "compact_merges", "default_add_bos", "spm_merges"]

logger = logging.getLogger(__name__)

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-scored joined piece first;
    ties by the longer left piece, then the longer right one (transformers' generate_merges order,
    so both paths build the same tokenizer)."""
    ids = {t: i for i, t in enumerate(tokens)}
    best = dict(zip(tokens, scores))  # a repeated piece keeps its last score, as a dict does there
    merges = []
    for tok, score in best.items():
        local = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ids and tok[i:] in ids]
        local.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        merges.extend((score, len(a), len(b), (a, b)) for a, b in local)
    merges.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)  # stable among equal keys
    return [m[3] for m in merges]


def compact_merges(text: str) -> str:
    """A tokenizer.json `text` with its BPE merges written "left right" instead of
    ["left", "right"]: the same tokenizer (tokenizers reads both), whose parse at run time peaks at
    about half the memory and leaves the heap far less fragmented, so the models loaded after it
    take less (docs/backend-onnxruntime.md). Unchanged where a
    piece holds a space, which the short form would split at."""
    import json

    data = json.loads(text)
    merges = (data.get("model") or {}).get("merges")
    if not merges or not all(isinstance(m, list) and len(m) == 2 for m in merges):
        return text
    if any(" " in piece for m in merges for piece in m):
        return text
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


_field = field


def _bad(key: str, want: str, value) -> ExportError:
    text = repr(value)
    return ExportError(f"the GGUF's '{key}' must be {want}, got {text if len(text) <= 40 else text[:37] + '...'}")


def _string(reader, key: str, default=None) -> str | None:
    value = _field(reader, key, default)
    if value is not None and not isinstance(value, str):
        raise _bad(key, "a string", value)
    return value


# what an item of a metadata list must be, by the kind asked for, and its name in an error
_ITEMS = {str: (lambda v: isinstance(v, str), "strings"), int: (checks.is_int, "integers"),
          float: (checks.is_number, "numbers")}


def _list(reader, key: str, kind: type, n: int | None) -> list | None:
    """The array `key` of `kind` items (numbers for float), `n` long where given; None if absent."""
    value = _field(reader, key)
    if value is None:
        return None
    item, name = _ITEMS[kind]
    ok = isinstance(value, list) and all(item(v) for v in value)
    if not ok or (n is not None and len(value) != n):
        raise _bad(key, f"a list of {n if n is not None else 'some'} {name}", value)
    return value


def _token_id(reader, key: str, n_tokens: int) -> int | None:
    value = _field(reader, key)
    if value is None:
        return None
    if not checks.is_int(value) or not 0 <= value < n_tokens:
        raise _bad(key, f"a token id below {n_tokens}", value)
    return int(value)


def default_add_bos(reader) -> bool:
    """Whether llama.cpp puts BOS first when the GGUF has no `tokenizer.ggml.add_bos_token`: always
    for SentencePiece, for BPE only with some pre-tokenizers (Llama 3, Tekken)."""
    if _field(reader, "tokenizer.ggml.model") == "gpt2":
        return pre_tokenizer(_string(reader, "tokenizer.ggml.pre", "default")).add_bos
    return True


def _spm(reader, tokens: list[str]):
    """SentencePiece as llama.cpp runs it: spaces escaped to "▁" (one more in front of each run of
    text when `add_space_prefix`, llama.cpp's default), the best-scored pair merged first, unknown
    characters as <0xXX> byte tokens."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    if merges_by_position(str(_field(reader, "general.architecture", ""))):
        scores = [-float(i) for i in range(len(tokens))]
    else:
        scores = _list(reader, "tokenizer.ggml.scores", float, len(tokens))
        if scores is None:
            raise ExportError("the GGUF's SentencePiece tokenizer has no scores")
    unk_id = _token_id(reader, "tokenizer.ggml.unknown_token_id", len(tokens))
    unk = tokens[unk_id] if unk_id is not None else None
    vocab = {t: i for i, t in enumerate(tokens)}
    # no text reaches the model with a space left (all become "▁"): merges of pieces holding one
    # (Gemma's runs of spaces) never apply, and would keep compact_merges from its short form
    merges = [m for m in spm_merges(tokens, scores) if " " not in m[0] and " " not in m[1]]
    tok = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    norms = [normalizers.Replace(" ", "▁")]
    # the normalizer runs on each stretch of text between added tokens, and llama.cpp adds the
    # prefix to each stretch after a special or user-defined token: the same places
    if _field(reader, "tokenizer.ggml.add_space_prefix", True):
        norms.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norms)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _merge_pair(merge: str) -> tuple[str, str] | None:
    # llama.cpp splits at the first space after the first character
    cut = merge.find(" ", 1)
    return None if cut < 0 else (merge[:cut], merge[cut + 1:])


def _byte_level_bpe(reader, tokens: list[str]):
    """Byte-level BPE with the merges the GGUF carries, split first by the regexes llama.cpp uses
    for the GGUF's `tokenizer.ggml.pre` (gguf/pretokenizers.py)."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    pre = pre_tokenizer(_string(reader, "tokenizer.ggml.pre", "default"))
    merges = [p for p in map(_merge_pair, _list(reader, "tokenizer.ggml.merges", str, None) or []) if p is not None]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab, merges, unk_token=None, fuse_unk=False, byte_fallback=False,
                        ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(reader):
    """(tokenizers.Tokenizer, token types, token strings) from an open GGUF's tokenizer.* metadata,
    tokenizing as llama.cpp does with special tokens parsed."""
    from tokenizers import AddedToken

    kind = _string(reader, "tokenizer.ggml.model")
    tokens = _list(reader, "tokenizer.ggml.tokens", str, None)
    if kind is None or tokens is None:
        raise ExportError("the GGUF carries no tokenizer (tokenizer.ggml.model / tokens)")
    if not tokens:
        raise ExportError("the GGUF's tokenizer has an empty vocabulary (tokenizer.ggml.tokens)")
    types = _list(reader, "tokenizer.ggml.token_type", int, len(tokens)) or [_NORMAL] * len(tokens)
    if kind == "llama":
        tok = _spm(reader, tokens)
    elif kind == "gpt2":
        tok = _byte_level_bpe(reader, tokens)
    else:
        raise ExportError(f"the GGUF's tokenizer model {kind[:40]!r} is not supported (llama, gpt2)")
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                            for i, t in enumerate(types) if t == _CONTROL])
    # user-defined pieces are matched whole in the raw text, as llama.cpp does: Gemma's runs of
    # spaces, stored as spaces, are found before spaces become "▁"
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                    for i, t in enumerate(types) if t == _USER_DEFINED])
    return tok, types, tokens


@dataclass
class _Added:
    content: str
    special: bool


class GGUFTokenizer:
    """The tokenizer of a GGUF source, with the transformers-tokenizer surface the exporter uses."""

    def __init__(self, reader) -> None:
        self._tok, types, tokens = build_tokenizer(reader)
        self._tokens = list(tokens)
        ids = {k: _token_id(reader, f"tokenizer.ggml.{k}_token_id", len(tokens))
               for k in ("bos", "eos", "padding", "unknown")}
        self.bos_token_id, self.eos_token_id = ids["bos"], ids["eos"]
        self.pad_token_id, self.unk_token_id = ids["padding"], ids["unknown"]
        self.add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", default_add_bos(reader)))
        if _field(reader, "tokenizer.ggml.add_eos_token", False):
            # llama.cpp would end every prompt with EOS; a prompt to continue must not end there
            logger.warning("the GGUF asks for EOS after each text (tokenizer.ggml.add_eos_token); edgespec "
                           "does not add it to prompts")
        self.chat_template = _string(reader, "tokenizer.chat_template")
        added = set(self._tok.get_added_tokens_decoder())
        self.added_tokens_decoder = {i: _Added(self._tokens[i], t == _CONTROL)
                                     for i, t in enumerate(types) if i in added}
        self.all_special_ids = sorted({i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id,
                                                   self.unk_token_id) if i is not None}
                                      | {i for i, a in self.added_tokens_decoder.items() if a.special})

    @property
    def backend_tokenizer(self):
        return self._tok

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return SimpleNamespace(input_ids=ids)

    def get_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self._tokens)}

    def convert_ids_to_tokens(self, i: int) -> str:
        return self._tokens[i]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def bos_token(self) -> str:
        return self._tokens[self.bos_token_id] if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._tokens[self.eos_token_id] if self.eos_token_id is not None else ""

    def apply_chat_template(self, messages: list[dict], *, chat_template: str | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str | list[int]:
        """As transformers' method, rendered with a time and memory limit (models/templates.py)."""
        from ...models.templates import TemplateRenderer
        from ..vocabtrim import chat_text

        template = chat_template or self.chat_template
        if not template:
            raise ExportError("the GGUF has no chat template")
        with TemplateRenderer() as renderer:
            text = chat_text(renderer, self, messages, template, add_generation_prompt=add_generation_prompt)
        return self(text, add_special_tokens=False).input_ids if tokenize else text

    def save_pretrained(self, folder) -> None:
        """Write tokenizer.json (all the runtime reads)."""
        Path(folder, "tokenizer.json").write_text(compact_merges(self._tok.to_str()), encoding="utf-8")
