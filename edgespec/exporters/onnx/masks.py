"""Positions, additive attention masks and RoPE tables of one decoder forward, as ONNX nodes on
the graph builder `g` (onnx/graph._G): computed once per forward and shared by every layer."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ..spec import ModelSpec
from .fused import once_per_forward

__all__ = ["window_align", "positions_and_masks", "buffer_positions_and_masks", "masks_and_rope"]

_NEG = float(np.finfo(np.float32).min)


def positions_and_masks(g, spec: ModelSpec, past0: str, ids: str, fused: bool = False,
                        window_past: str | None = None) -> dict:
    """Positions P..P+S-1, RoPE cos/sin per layer type, additive causal (and sliding) masks; `fused`:
    cos/sin as RotaryEmbedding reads them, and onnx/fused.once_per_forward. `past0` is the append
    layout's sequence-major past (1, P, kvh, hd), a full-attention layer's. `window_past`: a sliding
    layer's past, which may hold only the last positions (the caller binds the part of the cache a
    window can see, from kv_start = P - its length on): the sliding mask then has those key
    columns only."""
    i64 = dict(dtype=np.int64)
    p_len = g.op("Gather", [g.op("Shape", [past0]), g.const(1, **i64)])  # scalar P
    s_len = g.op("Gather", [g.op("Shape", [ids]), g.const(1, **i64)])  # scalar S
    t_len = g.op("Add", [p_len, s_len])
    qpos = g.op("Range", [p_len, t_len, g.const(1, **i64)])  # (S,)
    kpos = g.op("Range", [g.const(0, **i64), t_len, g.const(1, **i64)])  # (T,)
    qcol = g.op("Unsqueeze", [qpos, g.const([1], **i64)])  # (S, 1)
    krow = g.op("Unsqueeze", [kpos, g.const([0], **i64)])  # (1, T)
    ctx = masks_and_rope(g, spec, qcol, krow, g.op("LessOrEqual", [krow, qcol]), fused)
    if window_past and "sliding_attention" in ctx["mask"]:
        kv_start = g.op("Sub", [g.op("Unsqueeze", [p_len, g.const([0], **i64)]),
                                g.op("Shape", [window_past], start=1, end=2)])  # (1,)
        mask = ctx["mask"]["sliding_attention"]  # (1, 1, 1, S, T) -> (1, 1, 1, S, T - kv_start)
        ctx["mask"]["sliding_attention"] = g.op("Slice", [mask, kv_start, g.const([np.iinfo(np.int64).max], **i64),
                                                          g.const([4], **i64)])
    return {**ctx, **once_per_forward(g, spec, s_len, ctx["mask"])} if fused else ctx


def buffer_positions_and_masks(g, spec: ModelSpec, past0: str) -> dict:
    """As `positions_and_masks`, for the buffer layout: query positions come from position_ids,
    buffer slot j holds position j, and attention_mask says which keys exist."""
    i64 = dict(dtype=np.int64)
    p_len = g.op("Gather", [g.op("Shape", [past0]), g.const(2, **i64)])
    qpos = g.op("Squeeze", ["position_ids", g.const([0], **i64)])  # (S,)
    kpos = g.op("Concat", [g.op("Range", [g.const(0, **i64), p_len, g.const(1, **i64)]), qpos], axis=0)  # (T,)
    qcol = g.op("Unsqueeze", [qpos, g.const([1], **i64)])  # (S, 1)
    krow = g.op("Unsqueeze", [kpos, g.const([0], **i64)])  # (1, T)
    present = g.op("Unsqueeze", [g.op("Cast", [g.op("Squeeze", ["attention_mask", g.const([0], **i64)])],
                                               to=TensorProto.BOOL), g.const([0], **i64)])  # (1, T)
    return masks_and_rope(g, spec, qcol, krow, g.op("And", [g.op("LessOrEqual", [krow, qcol]), present]))


def masks_and_rope(g, spec: ModelSpec, qcol: str, krow: str, causal: str, fused: bool = False) -> dict:
    """Additive masks (causal, and sliding where a layer type has a window) and RoPE cos/sin per
    layer type, from query positions (S, 1), key positions (1, T) and the causal pattern (S, T)."""
    i64 = dict(dtype=np.int64)
    zero, neg = g.const(0.0, dtype=np.float32), g.const(_NEG, dtype=np.float32)
    masks, rope = {}, {}
    qf = g.op("Cast", [qcol], to=TensorProto.FLOAT)
    for lt in sorted(set(spec.layer_types)):
        allowed = causal
        if lt == "sliding_attention" and spec.sliding_window:
            near = g.op("Less", [g.op("Sub", [qcol, krow]), g.const(spec.sliding_window, **i64)])
            allowed = g.op("And", [causal, near])
        m = g.op("Where", [allowed, zero, neg])
        masks[lt] = g.op("Unsqueeze", [m, g.const([0, 1, 2], **i64)])  # (1, 1, 1, S, T)
        inv_freq, scale = spec.rope[lt]
        freqs = g.op("Mul", [qf, g.const(inv_freq[None, :], dtype=np.float32)])  # (S, hd/2)
        if fused:  # RotaryEmbedding's caches: (S, hd/2)
            rope[lt] = tuple(g.op("Mul", [g.op(f, [freqs]), g.const(scale, dtype=np.float32)]) for f in ("Cos", "Sin"))
            continue
        emb = g.op("Concat", [freqs, freqs], axis=-1)  # (S, hd)
        cos = g.op("Mul", [g.op("Cos", [emb]), g.const(scale, dtype=np.float32)])
        sin = g.op("Mul", [g.op("Sin", [emb]), g.const(scale, dtype=np.float32)])
        rope[lt] = tuple(g.op("Unsqueeze", [t, g.const([0, 1], **i64)]) for t in (cos, sin))  # (1,1,S,hd)
    return {"mask": masks, "rope": rope}


def window_align(head_dim: int) -> int:
    """The default alignment of a sliding layer's first bound key (the runtime's window start,
    runtimes/onnxruntime/kv.window_start): a multiple of every depth slice onnxruntime's SGEMM
    takes for P @ V on this head size with up to four threads sharing its output columns (a slice
    is 128 * 128 / columns per thread deep, at most 1024)."""
    return min(1024, max(256, 4 * 128 * 128 // max(1, head_dim)))
