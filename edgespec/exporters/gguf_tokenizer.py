"""A GGUF's own tokenizer as a `tokenizers` tokenizer, without transformers.

SentencePiece-style vocabularies (`tokenizer.ggml.model = llama`: Gemma, Llama 2) carry tokens and
scores but no merges; llama.cpp merges the adjacent pair whose joined piece scores highest. A BPE
whose merges are ordered by the joined piece's score does the same, so the merges are generated
from the vocabulary, as transformers' GGUF converter does, with its two Gemma fixes: tokens of
several spaces are stored as spaces but looked up as "▁" runs, and Gemma's merge order is its
token order, not its scores. Byte-level BPE vocabularies
(`gpt2`: Qwen, Llama 3) carry their merges. Control tokens are special added tokens and
user-defined tokens plain added tokens, both matched before the model, as llama.cpp does.

`GGUFTokenizer` answers the part of a transformers tokenizer that the exporter uses
(tokenizer_export, vocabtrim), so both kinds of source take the same path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ..errors import ExportError

__all__ = ["GGUFTokenizer", "build_tokenizer", "compact_merges", "spm_merges"]

logger = logging.getLogger(__name__)

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


# architectures whose SentencePiece merge order is the token order (transformers' gemma_tokenizer)
_MERGE_BY_POSITION = ("gemma", "gemma2", "gemma3")


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
    half the memory and leaves the heap far less fragmented (Gemma 3, 514,906 merges: 353 -> 180
    MiB at peak while parsing, and the models loaded after it ~80 MiB smaller). Unchanged where a
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


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def build_tokenizer(reader):
    """(tokenizers.Tokenizer, token types, token strings as the tokenizer spells them) from a
    GGUFReader's tokenizer.* metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    kind = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ExportError("the GGUF carries no tokenizer (tokenizer.ggml.model / tokens)")
    types = _field(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    arch = _field(reader, "general.architecture", "")
    if kind == "llama" and arch in _MERGE_BY_POSITION:
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    elif kind == "llama":
        scores = _field(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise ExportError("the GGUF's SentencePiece tokenizer has no scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "llama":
        unk = tokens[unk_id] if unk_id is not None else None
        tok = Tokenizer(BPE(vocab, spm_merges(tokens, scores), unk_token=unk, fuse_unk=True, byte_fallback=True))
        norms = [normalizers.Replace(" ", "▁")]
        if _field(reader, "tokenizer.ggml.add_space_prefix", False):
            norms.insert(0, normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(norms)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    elif kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]
        tok = Tokenizer(BPE(vocab, merges, unk_token=None, fuse_unk=False, byte_fallback=False))
        pre = _field(reader, "tokenizer.ggml.pre", "default")
        if pre not in ("default", "gpt2", "qwen2", "llama-bpe", "llama3"):
            raise ExportError(f"the GGUF's BPE pre-tokenizer '{pre}' is not supported yet")
        split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+") if pre != "default" else None
        seq = [pre_tokenizers.Split(Regex(split), behavior="isolated")] if split else []
        tok.pre_tokenizer = pre_tokenizers.Sequence(seq + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=split is None)])
        tok.decoder = decoders.ByteLevel()
    else:
        raise ExportError(f"the GGUF's tokenizer model '{kind}' is not supported (llama, gpt2)")
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                            for i, t in enumerate(types) if t == _CONTROL])
    # user-defined pieces are matched whole, as llama.cpp does (a respelled "▁" run is not one)
    raw = _field(reader, "tokenizer.ggml.tokens")
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                    for i, t in enumerate(types) if t == _USER_DEFINED and tokens[i] == raw[i]])
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
        ids = {k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding", "unknown")}
        self.bos_token_id = None if ids["bos"] is None else int(ids["bos"])
        self.eos_token_id = None if ids["eos"] is None else int(ids["eos"])
        self.pad_token_id = None if ids["padding"] is None else int(ids["padding"])
        self.unk_token_id = None if ids["unknown"] is None else int(ids["unknown"])
        self.add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", self.bos_token_id is not None))
        self.chat_template = _field(reader, "tokenizer.chat_template")
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

    def apply_chat_template(self, messages: list[dict], *, chat_template: str | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = chat_template or self.chat_template
        if not template:
            raise ExportError("the GGUF has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        tok = lambda i: self._tokens[i] if i is not None else ""  # noqa: E731
        text = env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token=tok(self.bos_token_id), eos_token=tok(self.eos_token_id))
        return self(text, add_special_tokens=False).input_ids if tokenize else text

    def save_pretrained(self, folder) -> None:
        """Write tokenizer.json (all the runtime reads)."""
        Path(folder, "tokenizer.json").write_text(compact_merges(self._tok.to_str()), encoding="utf-8")
