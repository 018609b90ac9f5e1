"""Read a GGUF source without torch or transformers: weights, config and tokenizer from gguf-py.

Weights keep their GGUF blocks (gguf/transcode.BlockWeight) under transformers' state-dict names,
so the ONNX writer can emit them as MatMulNBits as they are; `dequantized()` gives float32
arrays (gguf-py's own dequantizer) for formats and precisions that re-encode.

The config becomes a ModelSpec from the `<arch>.*` metadata keys, with the facts llama.cpp itself
hard-codes per architecture (activation, sliding-window patterns, Gemma 2's soft-caps, SmolLM3's layers
without RoPE, Phi-3's fused matrices, Qwen 3 MoE's experts) in the family's row (models/families.py,
`ArchFacts`; `ARCHS` is its view by architecture). RoPE tables
are computed as llama.cpp rotates: the linear scale factor and Llama 3's `rope_freqs.weight` divisors
applied, any other `<arch>.rope.*` key refused by name. The tokenizer becomes a `tokenizers`
tokenizer.json (gguf/tokenizer.py).
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ... import checks
from ...errors import ExportError
from ...models.families import GGUF_ARCHS, ArchFacts, Family, family_for_arch
from ..spec import ModelSpec
from .deferred import LazyTensors, deferring
from .experts import check_dense_experts, expert_tensors, is_expert_tensor
from .reader import check_layout, open_gguf
from .reader import field as _field
from .transcode import BlockWeight, quant_type_name, transcode

__all__ = ["GGUFModel", "check_layout", "open_gguf", "read_gguf", "ArchFacts", "ARCHS", "split_fused"]

logger = logging.getLogger(__name__)


# the family rows a GGUF source may have, by llama.cpp architecture (models/families.py registers them)
ARCHS = GGUF_ARCHS
NOPE = "full_attention_nope"  # the layer type of a full-attention layer without RoPE (an identity table)
# tensors llama.cpp reads for a RoPE edgespec does not compute: refused by name rather than dropped
_UNSUPPORTED_TENSORS = {"rope_factors_long.weight": "Phi-3's LongRoPE factors",
                        "rope_factors_short.weight": "Phi-3's LongRoPE factors"}

# GGUF tensor name (after "blk.N.") -> transformers name (after "model.layers.N."); "ffn_norm" is the
# pre-MLP norm, which transformers calls post_attention_layernorm unless the family has sandwich norms
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class GGUFModel:
    """A GGUF file read into edgespec's terms."""

    spec: ModelSpec
    config: SimpleNamespace  # max_position_embeddings, intermediate_size (what gguf/export reads)
    # transformers names -> the file's own blocks (BlockWeight) or float arrays, large ones read
    # from the file when asked for (gguf/deferred.LazyTensors)
    tensors: MutableMapping[str, BlockWeight | np.ndarray]
    block_types: dict[str, int] = field(default_factory=dict)  # GGUF type -> tensor count
    file_type: str = "unknown"  # llama.cpp's name, e.g. Q4_K_M
    precision: str | None = None  # edgespec's name when it has one (int4 for Q4_K_M)

    @property
    def generation_config(self) -> SimpleNamespace:  # what tokenizer_export reads off a model
        return SimpleNamespace(eos_token_id=self.config.eos_token_id)

    def dequantized(self) -> dict[str, np.ndarray]:
        """float32 weights under the same names (gguf-py's dequantizer for quantized ones)."""
        return {k: v.dequantize() if isinstance(v, BlockWeight) else v for k, v in self.tensors.items()}




def _require(reader, key: str):
    value = _field(reader, key)
    if value is None:
        raise ExportError(f"the GGUF has no '{key}' metadata; cannot read its configuration")
    return value


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _size(reader, key: str, default=None) -> int:
    """A count or size from the metadata: an integer >= 1 (a zero head count divides by zero, a
    per-layer array or a string is no count), else a one-line ExportError naming the key."""
    value = _field(reader, key, default)
    if value is None:
        raise ExportError(f"the GGUF has no '{key}' metadata; cannot read its configuration")
    if not checks.is_int(value) or value < 1:
        raise ExportError(f"the GGUF's '{key}' must be an integer >= 1, got {_show(value)}")
    return int(value)


def _number(reader, key: str, default=None, *, positive: bool = False) -> float:
    """A finite real number from the metadata (> 0 where `positive`), else a one-line ExportError."""
    value = _field(reader, key, default)
    if value is None:
        raise ExportError(f"the GGUF has no '{key}' metadata; cannot read its configuration")
    ok = checks.is_number(value) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise ExportError(f"the GGUF's '{key}' must be a finite number{' > 0' if positive else ''}, got {_show(value)}")
    return float(value)


def _softcap(reader, key: str, default: float | None) -> float | None:
    """A soft-cap from the metadata (or llama.cpp's default for the architecture); None: no cap."""
    if _field(reader, key, default) is None:
        return None
    return _number(reader, key, default, positive=True)


def _heads(reader, arch: str) -> tuple[int, int, int, int]:
    """(hidden, heads, kv heads, head dim), each >= 1, the heads divisible by the kv heads and the
    head dim even (RoPE rotates pairs): what the attention graph divides by."""
    hidden = _size(reader, f"{arch}.embedding_length")
    n_heads = _size(reader, f"{arch}.attention.head_count")
    n_kv = _size(reader, f"{arch}.attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise ExportError(f"the GGUF's '{arch}.attention.head_count' ({n_heads}) is not a multiple of "
                          f"'{arch}.attention.head_count_kv' ({n_kv})")
    if _field(reader, f"{arch}.attention.key_length") is None and hidden % n_heads:
        raise ExportError(f"the GGUF's '{arch}.embedding_length' ({hidden}) is not a multiple of "
                          f"'{arch}.attention.head_count' ({n_heads}), and it has no '{arch}.attention.key_length'")
    head_dim = _size(reader, f"{arch}.attention.key_length", hidden // n_heads)
    value_dim = _size(reader, f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim or head_dim % 2:
        raise ExportError(f"the GGUF's attention head size (key {head_dim}, value {value_dim}) is not supported: "
                          "keys and values of one even size")
    return hidden, n_heads, n_kv, head_dim


def _inv_freq(base: float, dim: int) -> np.ndarray:
    # as transformers computes it: float32 arange / dim, float32 power
    exp = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(base) ** exp)).astype(np.float32)


def _periodic(n_layers: int, period: int, every: str, other: str) -> tuple[str, ...]:
    """`every` on each `period`-th layer (layer il where (il + 1) % period == 0, as llama.cpp
    counts), `other` elsewhere."""
    return tuple(every if (i + 1) % period == 0 else other for i in range(n_layers))


def _swa_period(key: str, pattern, facts: ArchFacts) -> int | None:
    """The sliding-window period the file gives (an integer >= 0), else the architecture's."""
    if pattern is None:
        return facts.swa_period
    if not checks.is_int(pattern) or pattern < 0:
        raise ExportError(f"the GGUF's '{key}' must be an integer >= 0 or a list per layer, got {_show(pattern)}")
    return int(pattern)


def _layer_types(reader, arch: str, facts: ArchFacts, n_layers: int) -> tuple[str, ...]:
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = _field(reader, key)
    if isinstance(pattern, list):  # per layer: True = sliding (what edgespec's GGUF writer stores)
        if len(pattern) != n_layers:
            raise ExportError(f"the GGUF's '{key}' has {len(pattern)} entries for {n_layers} layers")
        return tuple("sliding_attention" if p else "full_attention" for p in pattern)
    period = _swa_period(key, pattern, facts)
    if period and (facts.swa_window or _field(reader, f"{arch}.attention.sliding_window") is not None):
        return _periodic(n_layers, period, "full_attention", "sliding_attention")
    if facts.nope_period:  # llama.cpp skips the rotation of q and k on these layers
        return _periodic(n_layers, facts.nope_period, NOPE, "full_attention")
    return ("full_attention",) * n_layers


# `<arch>.rope.*` keys this reader turns into the RoPE tables; any other one is refused by name, so no
# scaling the file asks for is dropped silently
_ROPE_KEYS = ("dimension_count", "freq_base", "freq_base_swa", "scaling.type", "scaling.factor", "scale_linear",
              "scaling.original_context_length", "scaling.finetuned", "scaling.attn_factor")


def _rope_scale(reader, arch: str) -> float:
    """llama.cpp's linear frequency scale factor (1.0: none); any other scaling is refused by key."""
    for key in reader.fields:
        if key.startswith(f"{arch}.rope.") and key[len(arch) + 6:] not in _ROPE_KEYS:
            raise ExportError(f"the GGUF's RoPE key '{key}' is not supported")
    kind = str(_field(reader, f"{arch}.rope.scaling.type", "none"))[:40]
    # llama.cpp divides the frequencies by the factor whatever the type, reading the older
    # `rope.scale_linear` when `rope.scaling.factor` is absent or 0
    factor = _number(reader, f"{arch}.rope.scaling.factor", 0.0)
    factor = factor or _number(reader, f"{arch}.rope.scale_linear", 1.0) or 1.0
    if factor < 0:
        raise ExportError(f"the GGUF's RoPE scaling factor must be > 0, got {factor}")
    # yarn at factor 1 ramps between two equal tables with no magnitude change: the plain table
    if kind not in ("none", "linear") and not (kind == "yarn" and factor == 1.0):
        raise ExportError(f"the GGUF's '{arch}.rope.scaling.type' = '{kind}' is not supported (none, linear)")
    attn = _number(reader, f"{arch}.rope.scaling.attn_factor", 1.0) or 1.0
    if attn != 1.0:  # llama.cpp multiplies cos/sin by it; no source edgespec reads sets it
        raise ExportError(f"the GGUF's '{arch}.rope.scaling.attn_factor' = {attn} is not supported")
    return factor


def _rope(reader, arch: str, facts: ArchFacts, head_dim: int, layer_types, freqs: np.ndarray | None) -> dict:
    """inv_freq per layer type as llama.cpp rotates: base^(-2i/d), divided by the linear scale factor
    and by `rope_freqs` (Llama 3's per-dimension divisors, ggml_rope_ext's freq_factors)."""
    dim = _size(reader, f"{arch}.rope.dimension_count", head_dim)
    if dim != head_dim:
        raise ExportError(f"the GGUF's '{arch}.rope.dimension_count' = {dim} (partial rotary over {head_dim} "
                          "head dims) is not supported")
    base = _number(reader, f"{arch}.rope.freq_base", 10000.0, positive=True)
    factor = _rope_scale(reader, arch)
    if freqs is not None and freqs.shape != (dim // 2,):
        raise ExportError(f"the GGUF's rope_freqs.weight has shape {freqs.shape}; expected ({dim // 2},)")
    tables = {}
    if "full_attention" in layer_types:
        inv = _inv_freq(base, dim) / np.float32(factor)
        if freqs is not None:  # in float64, rounded once: the table llama.cpp's theta / freq_factor gives
            inv = (inv.astype(np.float64) / freqs.astype(np.float64)).astype(np.float32)
        tables["full_attention"] = (inv, 1.0)
    if "sliding_attention" in layer_types:
        if freqs is not None:
            raise ExportError("rope_freqs.weight on a model with sliding-window layers is not supported")
        swa = _number(reader, f"{arch}.rope.freq_base_swa", facts.swa_base or base, positive=True)
        tables["sliding_attention"] = (_inv_freq(swa, dim), 1.0)
    if NOPE in layer_types:  # a zero frequency: cos 1, sin 0, the rotation is the identity
        tables[NOPE] = (np.zeros(dim // 2, dtype=np.float32), 1.0)
    return tables


def _spec(reader, family: Family, vocab: int, tied: bool,
          freqs: np.ndarray | None) -> tuple[ModelSpec, SimpleNamespace]:
    facts = family.gguf
    arch = facts.arch
    hidden, n_heads, n_kv, head_dim = _heads(reader, arch)
    n_layers = _size(reader, f"{arch}.block_count")
    # every layer has tensors of its own: a count past the file's tensors is refused before any
    # work per layer (a corrupt count would otherwise cost time in proportion to it)
    if n_layers > len(reader.tensors):
        raise ExportError(f"the GGUF's '{arch}.block_count' is {n_layers}, more layers than the file has tensors "
                          f"({len(reader.tensors)})")
    layer_types = _layer_types(reader, arch, facts, n_layers)
    window = _field(reader, f"{arch}.attention.sliding_window", facts.swa_window)
    if window is not None:
        window = _size(reader, f"{arch}.attention.sliding_window", facts.swa_window)
    softcap = _softcap(reader, f"{arch}.final_logit_softcapping", facts.final_softcap)
    query_dim = hidden // n_heads if n_layers == facts.hidden_query_scale_layers else head_dim
    experts = _experts(reader, arch) if facts.moe else None
    spec = ModelSpec(
        model_type=family.model_type,
        family=family,
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        rms_eps=_number(reader, f"{arch}.attention.layer_norm_rms_epsilon", positive=True),
        activation=facts.activation,
        # llama.cpp scales queries by 1/sqrt(head_dim) for every architecture read here but Gemma 2 27B
        query_scale=float(query_dim ** -0.5),
        layer_types=layer_types,
        sliding_window=int(window) if window is not None and "sliding_attention" in layer_types else None,
        rope=_rope(reader, arch, facts, head_dim, layer_types, freqs),
        final_logit_softcap=softcap,
        tie_embeddings=tied,
        attn_logit_softcap=_softcap(reader, f"{arch}.attn_logit_softcapping", facts.attn_softcap),
        experts_used=experts[1] if experts else None,
    )
    config = SimpleNamespace(
        max_position_embeddings=_size(reader, f"{arch}.context_length", 4096),
        # an expert's own size in a mixture of experts (llama.cpp's n_ff_exp)
        intermediate_size=_size(reader, f"{arch}.expert_feed_forward_length" if facts.moe else
                                f"{arch}.feed_forward_length"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        # what gguf/export writes back as freq_base beside rope_freqs when it re-encodes this model
        rope_theta=_number(reader, f"{arch}.rope.freq_base", 10000.0, positive=True),
    )
    return spec, config


def _experts(reader, arch: str) -> tuple[int, int]:
    """(experts, experts used per token) of a mixture of experts, from the metadata."""
    return _size(reader, f"{arch}.expert_count"), _size(reader, f"{arch}.expert_used_count")


def _hf_name(gguf_name: str, sandwich: bool) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk.") and base.count(".") >= 2:
        _, idx, part = base.split(".", 2)
        if not (idx.isascii() and idx.isdigit()):
            return None
        if part == "ffn_norm":
            part_hf = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
        else:
            part_hf = _LAYER_NAMES.get(part)
        return f"model.layers.{idx}.{part_hf}.{suffix}" if part_hf else None
    top = _TOP_NAMES.get(base)
    return f"{top}.{suffix}" if top else None


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (gguf/export._permute) on a (rows, K) weight."""
    perm = np.arange(n_rows).reshape(n_head, 2, n_rows // n_head // 2).swapaxes(1, 2).reshape(-1)
    return np.argsort(perm)


def split_fused(tensors: MutableMapping, spec: ModelSpec, layer: int) -> None:
    """Phi-3's fused matrices of `layer` into the Llama names, by rows (a BlockWeight keeps its own
    blocks): qkv is q's rows, then k's, then v's; gate_up the gate's rows, then up's (llama.cpp's
    fused SwiGLU gates with the first half). The one home of the split: the ONNX graph calls it on a
    HF folder's weights, the GGUF reader on a file's."""
    def take(w, start: int, stop: int):
        return w.rows(np.arange(start, stop)) if isinstance(w, BlockWeight) else w[start:stop]

    q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    p = f"model.layers.{layer}."
    qkv = tensors.pop(p + "self_attn.qkv_proj.weight", None)
    if qkv is not None:
        if qkv.shape[0] != q + 2 * kv:
            raise ExportError(f"layer {layer}'s fused qkv weight has {qkv.shape[0]} rows, but the metadata's "
                              f"head counts give {q + 2 * kv}")
        for name, (a, b) in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
            tensors[f"{p}self_attn.{name}.weight"] = take(qkv, a, b)
    gate_up = tensors.pop(p + "mlp.gate_up_proj.weight", None)
    if gate_up is not None:
        half = gate_up.shape[0] // 2
        tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"] = (
            take(gate_up, 0, half), take(gate_up, half, 2 * half))


def _check_tensors(spec: ModelSpec, tensors: dict) -> None:
    """The attention weights every layer must have, in the shapes the metadata's head counts
    give, and no layer past block_count: a one-line ExportError instead of a reshape error."""
    hidden, q_rows, kv_rows = spec.hidden_size, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    want = {"q_proj": (q_rows, hidden), "k_proj": (kv_rows, hidden), "v_proj": (kv_rows, hidden),
            "o_proj": (hidden, q_rows)}
    for name in tensors:
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= spec.n_layers:
            raise ExportError(f"GGUF tensor {name} is past the {spec.n_layers} layers its block_count says")
    embed = tensors["model.embed_tokens.weight"].shape
    if len(embed) != 2 or embed[1] != hidden:
        raise ExportError(f"the GGUF's token embedding has shape {tuple(embed)}; its embedding_length is {hidden}")
    for i in range(spec.n_layers):
        for proj, shape in want.items():
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            if key not in tensors:
                raise ExportError(f"the GGUF has no {proj} weight for layer {i}")
            if tuple(tensors[key].shape) != shape:
                raise ExportError(f"layer {i}'s {proj} weight has shape {tuple(tensors[key].shape)}, but the "
                                  f"metadata's head counts give {shape}")


def _loader(path: Path, reader, load):
    """(read_gguf's `load`, whether it decodes weights): None leaves matrices in the file (deferred)."""
    if load is None:
        return deferring(path, reader), True
    return load, load is transcode


def _rope_freqs(t) -> np.ndarray:
    """The rope frequency factors a GGUF stores (llama 3's long-context scaling): every rotation
    divides by them, so each must be a finite number > 0 (a NaN would make every logit NaN)."""
    freqs = np.asarray(transcode(t.data, t.tensor_type, (int(t.n_elements),), t.name), dtype=np.float32)
    bad = ~(np.isfinite(freqs) & (freqs > 0))
    if bad.any():
        raise ExportError(f"the GGUF's {t.name} must hold finite factors > 0, got {freqs[bad][0]}")
    return freqs


def _tensor_name(gguf_name: str, family: Family) -> str:
    """transformers' name of a (non-expert) GGUF tensor, or a one-line ExportError."""
    name = _hf_name(gguf_name, family.sandwich_norm)
    if name is None:
        raise ExportError(f"GGUF tensor {gguf_name} has no counterpart in edgespec's {family.gguf.arch} graph")
    if family.gguf.fused_up and name.endswith(".mlp.up_proj.weight"):  # split by split_fused
        return name.replace(".mlp.up_proj.", ".mlp.gate_up_proj.")
    return name


def _weight(t, name: str, family: Family, load):
    """One tensor as `load` takes it, a norm's stored offset undone."""
    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists ne0 (the row length) first
    w = load(t.data, t.tensor_type, shape, t.name)  # transcode, or reader.lazy_tensor
    if isinstance(w, np.ndarray) and name.endswith("norm.weight") and family.norm_offset:
        # llama.cpp stores Gemma's (1 + w), transformers w; in float64 the graph's w + 1 gives the
        # GGUF's float32 value back exactly (float32 arithmetic would round some of them)
        w = w.astype(np.float64) - family.norm_offset
    return w


@dataclass(frozen=True)
class _Tensors:
    """The file's tensors under transformers' names, with what was read beside them."""

    tensors: dict[str, BlockWeight | np.ndarray]
    types: Counter  # GGUF type -> tensor count
    freqs: np.ndarray | None  # Llama 3's rope_freqs divisors


def _read_tensors(reader, family: Family, load) -> _Tensors:
    tensors: dict[str, BlockWeight | np.ndarray] = {}
    types: Counter = Counter()
    freqs = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight" and family.gguf.rope_freqs:
            freqs = _rope_freqs(t)
            continue
        if t.name in _UNSUPPORTED_TENSORS:
            raise ExportError(f"GGUF tensor {t.name} ({_UNSUPPORTED_TENSORS[t.name]}) is not supported")
        if family.gguf.moe and is_expert_tensor(t.name):
            tensors.update(expert_tensors(t, load))
        else:
            name = _tensor_name(t.name, family)
            tensors[name] = _weight(t, name, family, load)
        types[quant_type_name(t.tensor_type)] += 1
    return _Tensors(tensors, types, freqs)


def _unpermute_qk(spec: ModelSpec, tensors: dict) -> None:
    """Undo llama.cpp's q/k row order (gguf/export._permute) in place."""
    for i in range(spec.n_layers):
        for proj, heads in (("q_proj", spec.n_heads), ("k_proj", spec.n_kv_heads)):
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            w = tensors[key]
            order = _unpermute_rows(w.shape[0], heads)
            tensors[key] = w.rows(order) if isinstance(w, BlockWeight) else w[order]


def read_gguf(path: Path, reader=None, load=None) -> GGUFModel:
    """Read `path`'s config and weights; every unsupported feature is a one-line ExportError.

    load: how a tensor is taken from the file, (raw, qtype, shape, name) -> weight. None: matrices
    stay in the file until a writer reads them (gguf/deferred.py), norms and biases are transcoded
    now; `transcode` decodes everything now; reader.lazy_tensor only describes them."""
    reader = reader or open_gguf(path)
    arch = str(_field(reader, "general.architecture", ""))
    family = family_for_arch(arch)
    load, decodes = _loader(path, reader, load)
    if family.gguf.moe and decodes:  # before any weight is decoded: a graph computes every expert
        check_dense_experts(arch, *_experts(reader, arch))
    read = _read_tensors(reader, family, load)
    tensors = read.tensors
    if "model.embed_tokens.weight" not in tensors:
        raise ExportError(f"{path.name} has no token embedding (token_embd.weight)")
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    spec, config = _spec(reader, family, vocab, "lm_head.weight" not in tensors, read.freqs)
    for i in range(spec.n_layers):
        split_fused(tensors, spec, i)
    _check_tensors(spec, tensors)
    if family.gguf.permute_qk:
        _unpermute_qk(spec, tensors)
    from .export import precision_of_gguf

    have, ftype = precision_of_gguf(path, reader)
    return GGUFModel(spec=spec, config=config, tensors=LazyTensors(tensors), block_types=dict(read.types),
                     file_type=ftype, precision=have or ftype.lower())
