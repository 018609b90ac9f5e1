"""The shape of a decoder, read off a Hugging Face config: everything the graph builder needs."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import ExportError
from ..models.families import Family, family_for

__all__ = ["ModelSpec", "spec_from_hf"]

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    family: Family
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    activation: str
    query_scale: float
    layer_types: tuple[str, ...]
    sliding_window: int | None
    # per layer type: (inv_freq (head_dim/2,), attention_scaling) taken from transformers' rope init
    rope: dict[str, tuple[np.ndarray, float]] = field(default_factory=dict)
    final_logit_softcap: float | None = None
    tie_embeddings: bool = False
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    experts_used: int | None = None  # a mixture of experts: how many experts each token takes (onnx/moe.py)

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return self.n_layers * self.n_kv_heads * self.head_dim * 2 * dtype_bytes


def _rope_tables(model, layer_types: tuple[str, ...]) -> dict[str, tuple[np.ndarray, float]]:
    """inv_freq and attention scaling per layer type, as transformers itself computed them
    (so llama3/yarn/linear scaling come for free instead of being re-implemented)."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None:
        raise ExportError("model has no rotary embedding module; only RoPE decoders are supported")
    tables = {}
    for lt in set(layer_types):
        inv = getattr(rotary, f"{lt}_inv_freq", None)
        scale = getattr(rotary, f"{lt}_attention_scaling", None)
        if inv is None:
            inv, scale = rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0)
        tables[lt] = (inv.detach().float().cpu().numpy(), float(scale if scale is not None else 1.0))
    return tables


def spec_from_hf(model) -> ModelSpec:
    """Build a ModelSpec from a loaded transformers causal LM."""
    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    family = family_for(cfg.model_type)
    act_name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act_name not in _ACTIVATIONS:
        raise ExportError(f"activation '{act_name}' is not supported")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_layers = cfg.num_hidden_layers
    layer_types = tuple(getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers)
    sliding = getattr(cfg, "sliding_window", None) if "sliding_attention" in layer_types else None
    qpas = getattr(cfg, "query_pre_attn_scalar", None)
    if getattr(cfg, "attn_logit_softcapping", None):
        raise ExportError("attention logit soft-capping (Gemma 2) is not supported")
    return ModelSpec(
        model_type=cfg.model_type,
        family=family,
        hidden_size=cfg.hidden_size,
        n_layers=n_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        rms_eps=float(cfg.rms_norm_eps),
        activation=_ACTIVATIONS[act_name],
        query_scale=float((qpas or head_dim) ** -0.5),
        layer_types=layer_types,
        sliding_window=sliding,
        rope=_rope_tables(model, layer_types),
        final_logit_softcap=getattr(cfg, "final_logit_softcapping", None),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )
