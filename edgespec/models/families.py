"""Per-family facts, as data: what differs between decoder-only families.

Everything the exporter, the GGUF reader and writer, the tokenizer and the chat front end need to
know about a family lives in its row here: looked up by the Hugging Face `model_type`
(`family_for`) or by llama.cpp's architecture name (`family_for_arch`), so adding a family is
adding a row (docs/adding-a-family.md walks through it; tests/test_adding_a_family.py follows it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from ..errors import ExportError

__all__ = ["ArchFacts", "Family", "FAMILIES", "GGUF_ARCHS", "family_for", "family_for_arch", "register",
           "unregister", "CHATML_TEMPLATE", "GEMMA_CHAT_TEMPLATE", "merges_by_position"]

# Gemma's turn markers (the instruction-tuned Gemma template, minus tool calling). Kept in the
# bundle of a Gemma checkpoint that carries no template of its own (e.g. the base GGUF), for
# `--chat-format template`; a base model chats through its transcript by default.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class ArchFacts:
    """A family's GGUF side: llama.cpp's architecture name and what llama.cpp's code hard-codes for it
    rather than storing in the file (gguf/source.py reads a GGUF with them, gguf/export.py writes one)."""

    arch: str  # llama.cpp's `general.architecture`
    activation: str = "silu"  # the MLP's activation llama.cpp runs for the architecture
    writes: bool = False  # gguf/export.py writes this family's HF folders as `arch` (else: refused by name)
    reads: bool = True  # a GGUF of `arch` is read as this family (one reading row per architecture)
    permute_qk: bool = False  # llama.cpp's LLAMA rope pairs adjacent dims: q/k rows reordered (written, undone on read)
    rope_freqs: bool = False  # the architecture reads a `rope_freqs.weight` (Llama 3's RoPE scaling)
    swa_period: int | None = None  # every Nth layer is full attention, the rest sliding (Gemma 3: 6)
    swa_base: float | None = None  # rope base of sliding layers when the file does not say
    swa_window: int | None = None  # the window when the file gives no `attention.sliding_window` (Gemma 2: 4096)
    # soft-caps llama.cpp applies when the file has no `<arch>.attn_logit_softcapping` /
    # `<arch>.final_logit_softcapping` key (Gemma 2: 50 and 30); None: no cap unless the file gives one
    attn_softcap: float | None = None
    final_softcap: float | None = None
    nope_period: int | None = None  # every Nth layer has no RoPE (SmolLM3: 4; no GGUF key says so)
    fused_up: bool = False  # `ffn_up` holds the gate rows, then the up rows (Phi-3)
    # the block count at which llama.cpp scales queries by 1/sqrt(hidden / heads), not 1/sqrt(head_dim)
    # (Gemma 2 27B)
    hidden_query_scale_layers: int | None = None
    # a mixture of experts: a router (`ffn_gate_inp`) and 3-D expert tensors (`ffn_*_exps`), the top
    # `expert_used_count` softmax weights renormalised (Qwen 3 MoE; onnx/moe.py)
    moe: bool = False
    # a SentencePiece vocabulary whose merge order is its token order, not its scores (Gemma's;
    # transformers' gemma_tokenizer does the same): gguf/tokenizer.py
    merges_by_position: bool = False


@dataclass(frozen=True)
class Family:
    """How one family's decoder differs from the Llama baseline, and how llama.cpp names and runs it."""

    name: str
    # the HF `model_type` values this row serves, the first being what a GGUF of the family reports;
    # empty: `name` alone
    model_types: tuple[str, ...] = ()
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight); Gemma stores weight - 1
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    sandwich_norm: bool = False  # extra norms after attention and around the MLP (Gemma 2/3)
    fallback_chat_template: str | None = None  # for checkpoints that ship none (`--chat-format template`)
    chat_transcript: str | None = None  # base models chat through this transcript (models/chat_formats.py)
    stop_tokens: tuple[str, ...] = ()  # end-of-turn tokens besides EOS
    reserved_token_pattern: str | None = None  # placeholder specials never emitted (not kept by VocabTrim)
    gguf: ArchFacts | None = None  # the GGUF side (None: no GGUF is read or written as this family)
    # config keys of a tiny random model of the family besides the shared sizes (exporters/tiny.py,
    # the tests' zoo); None: no tiny model. `tie_word_embeddings` is the tiny model's default
    tiny: Mapping[str, object] | None = field(default=None, compare=False, hash=False)

    @property
    def model_type(self) -> str:
        """The HF `model_type` a GGUF of this family reads back as."""
        return self.model_types[0] if self.model_types else self.name

    @property
    def gguf_arch(self) -> str | None:
        """llama.cpp's architecture name the GGUF writer uses (None: it cannot write the family)."""
        return self.gguf.arch if self.gguf is not None and self.gguf.writes else None


# the rows, by HF model_type and by llama.cpp architecture; read through the views below, changed
# only by register/unregister (a family added by a plugin or a test)
_BY_TYPE: dict[str, Family] = {}
_BY_ARCH: dict[str, Family] = {}
FAMILIES: Mapping[str, Family] = MappingProxyType(_BY_TYPE)
GGUF_ARCHS: Mapping[str, Family] = MappingProxyType(_BY_ARCH)  # the architectures a GGUF source may have


def register(family: Family) -> Family:
    """Add a row: it serves each of its model types and, when it reads GGUFs, its architecture.
    A model type or a read architecture another row serves is a ValueError (rows never shadow)."""
    types = family.model_types or (family.name,)
    taken = [t for t in types if t in _BY_TYPE]
    reads = family.gguf is not None and family.gguf.reads
    if reads and family.gguf.arch in _BY_ARCH:
        taken.append(f"GGUF architecture {family.gguf.arch}")
    if taken:
        raise ValueError(f"family {family.name!r}: {', '.join(taken)} already served by another row")
    _BY_TYPE.update(dict.fromkeys(types, family))
    if reads:
        _BY_ARCH[family.gguf.arch] = family
    return family


def unregister(family: Family) -> None:
    """Remove a row `register` added (a test's family, once it is done)."""
    for table in (_BY_TYPE, _BY_ARCH):
        for key in [k for k, row in table.items() if row is family]:
            del table[key]


def family_for(model_type: str) -> Family:
    """The family row for a HF `model_type`, or a clear error listing the supported ones."""
    try:
        return _BY_TYPE[model_type]
    except KeyError:
        supported = ", ".join(sorted(_BY_TYPE))
        raise ExportError(f"model type '{model_type}' is not supported (supported: {supported})") from None


def family_for_arch(arch: str) -> Family:
    """The family row a GGUF of llama.cpp architecture `arch` is read as, or a one-line ExportError."""
    try:
        return _BY_ARCH[arch]
    except KeyError:
        supported = ", ".join(sorted(_BY_ARCH))
        raise ExportError(f"GGUF architecture {arch[:40]!r} is not supported (supported: {supported})") from None


# Gemma 1 (`gemma`) has no row (its GGUFs are refused as models) but Gemma's vocabulary order: its
# tokenizer, asked for alone, merges as Gemma 2/3's do
_MERGES_BY_POSITION_WITHOUT_ROW = ("gemma",)


def merges_by_position(arch: str) -> bool:
    """Whether a SentencePiece GGUF of `arch` merges in token order rather than by score."""
    row = _BY_ARCH.get(arch)
    return row.gguf.merges_by_position if row is not None else arch in _MERGES_BY_POSITION_WITHOUT_ROW


_CHATML = dict(fallback_chat_template=CHATML_TEMPLATE, stop_tokens=("<|im_end|>",))
_GEMMA = dict(norm_offset=1.0, embed_scale=True, sandwich_norm=True, fallback_chat_template=GEMMA_CHAT_TEMPLATE,
              stop_tokens=("<end_of_turn>",), reserved_token_pattern=r"<unused\d+>")
# llama.cpp's LLAMA layout: q/k rows reordered, Llama 3's scaling as `rope_freqs.weight`
_LLAMA_GGUF = ArchFacts("llama", writes=True, permute_qk=True, rope_freqs=True)
# the tiny models' shared head counts (exporters/tiny.py adds the sizes)
_TINY_KV2 = {"num_key_value_heads": 2}

register(Family("llama", reserved_token_pattern=r"<\|reserved_special_token_\d+\|>", gguf=_LLAMA_GGUF,
                tiny=MappingProxyType({**_TINY_KV2, "tie_word_embeddings": False})))
# Mistral is written as llama.cpp's `llama`; a `llama` GGUF reads back as the llama row
register(Family("mistral", gguf=replace(_LLAMA_GGUF, reads=False)))
register(Family("qwen2", **_CHATML, gguf=ArchFacts("qwen2", writes=True),
                tiny=MappingProxyType({**_TINY_KV2, "tie_word_embeddings": True})))
register(Family("qwen3", **_CHATML, gguf=ArchFacts("qwen3", writes=True)))
# Qwen 3's mixture of experts (read from GGUF only; onnx/moe.py): Qwen 3's turns
register(Family("qwen3_moe", **_CHATML, gguf=ArchFacts("qwen3moe", moe=True)))
# Phi-3's fused qkv_proj / gate_up_proj matrices are split into the Llama names where the weights are
# read (gguf/source.split_fused, for a HF folder and a GGUF alike). llama.cpp disables Phi-3's sliding
# window (it reads the key and attends to every position)
register(Family("phi3", stop_tokens=("<|end|>",), gguf=ArchFacts("phi3", fused_up=True)))
# SmolLM3: Llama's layout (llama.cpp reorders its q/k rows), ChatML turns, every 4th layer without RoPE
register(Family("smollm3", **_CHATML, gguf=ArchFacts("smollm3", permute_qk=True, nope_period=4)))
# Gemma 2: Gemma 3's norms and embedding scale, soft-capped attention and logits, no q/k norms
register(Family("gemma2", **_GEMMA, gguf=ArchFacts(
    "gemma2", "gelu_tanh", swa_period=2, swa_window=4096, attn_softcap=50.0, final_softcap=30.0,
    hidden_query_scale_layers=46, merges_by_position=True)))
register(Family(
    "gemma3", model_types=("gemma3_text", "gemma3"), **_GEMMA,
    chat_transcript="qa",  # measured on Gemma 3 270M: docs/chat-formats.md
    gguf=ArchFacts("gemma3", "gelu_tanh", writes=True, swa_period=6, swa_base=10000.0, merges_by_position=True),
    tiny=MappingProxyType({"num_key_value_heads": 1, "head_dim": 32, "sliding_window": 16, "query_pre_attn_scalar": 32,
                           "layer_types": ("sliding_attention", "full_attention"), "tie_word_embeddings": True}),
))
