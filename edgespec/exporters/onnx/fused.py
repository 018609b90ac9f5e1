"""onnxruntime's fused kernels for the decoder graph (exporters/onnx/graph.py with
GraphOptions.fused_ops): fewer, larger kernels per forward.

A small model's decode step ran about a hundred kernels a layer per one-token forward, where its
body's 4-bit weights are read in a few milliseconds: onnxruntime's per-kernel cost was most of the
body (BENCHMARKS.md has the figures). Its CPU graph optimizer fuses none of what the plain graph
spells out (opset 21 ReduceMean takes its axes as an input, which SimplifiedLayerNormFusion does
not match; ONNX's Gelu-20 is expanded into eight kernels), so the graph names the fused kernels
itself: RMSNorm is one SimplifiedLayerNormalization, a residual add and the norm after it one
SkipSimplifiedLayerNormalization, gelu_tanh one FastGelu, RoPE one RotaryEmbedding reading cos/sin
computed once per forward, and the projections that read the same input (q/k/v, gate/up) one
MatMulNBits over their rows concatenated (the same GGUF blocks, so the transcode stays
bit-faithful). These are com.microsoft / onnxruntime-only ops: OpenVINO's ONNX frontend does not
read them, so its export keeps the plain graph.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from onnx import helper

from ..gguf.transcode import BlockWeight
from .blocks import kernel_form

__all__ = ["concat_rows", "fused_rms_norm", "fused_add_rms_norm", "fast_gelu", "rotary", "linear_group",
           "once_per_forward"]

MS = "com.microsoft"


def fused_rms_norm(g, x: str, w: np.ndarray, name: str, eps: float, offset: float, scale: float = 1.0) -> str:
    """x / sqrt(mean(x^2) + eps) * (offset + w) * scale over the last axis, one kernel. `scale`
    folds a constant factor that follows the norm (the query scale) into its weight."""
    gamma = g.weight((np.asarray(w, np.float32) + np.float32(offset)) * np.float32(scale), name)
    return g.op("SimplifiedLayerNormalization", [x, gamma], hint=name, axis=-1, epsilon=float(eps))


def fused_add_rms_norm(g, x: str, y: str, w: np.ndarray, name: str, eps: float, offset: float) -> tuple[str, str]:
    """(rms_norm(x + y), x + y) in one kernel: the residual stream's add and the norm that reads it."""
    gamma = g.weight(np.asarray(w, np.float32) + np.float32(offset), name)
    out, total = g.name(name), g.name(name + ".sum")
    g.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [y, x, gamma], [out, "", "", total],
                                    name=g.name("n"), domain=MS, epsilon=float(eps)))
    return out, total


def fast_gelu(g, x: str) -> str:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), one kernel."""
    return g.op("FastGelu", [x], domain=MS)


def rotary(g, x: str, positions: str, cos: str, sin: str) -> str:
    """RoPE (rotate-half form) of x (1, heads, S, hd); cos/sin (S, hd/2) already hold the
    attention scaling, and `positions` (1, S) index their rows."""
    return g.op("RotaryEmbedding", [x, positions, cos, sin], domain=MS)


def once_per_forward(g, spec, s_len: str, masks: dict[str, str]) -> dict:
    """What every layer of the fused graph reads, computed once: `rope_positions` (1, S), the rows
    of the (S, hd/2) cos/sin caches RotaryEmbedding reads (row j: query j's position), and per layer
    type `row_mask` (1, 1, R * S, T), the additive mask (1, 1, 1, S, T) of every score row of
    onnx/graph._attention_rows (head-major: row r * S + s is position s), so the scores need no
    reshape around the mask in each layer."""
    i64 = dict(dtype=np.int64)
    rep = spec.n_heads // spec.n_kv_heads
    tiles = g.const([2 if rep == 1 else rep, 1], **i64)  # rows per position: rep, or 2 copies when rep = 1
    rows = {lt: g.op("Tile", [g.op("Squeeze", [m, g.const([0, 1, 2], **i64)]), tiles]) for lt, m in masks.items()}
    return {"rope_positions": g.op("Unsqueeze", [g.op("Range", [g.const(0, **i64), s_len, g.const(1, **i64)]),
                                                 g.const([0], **i64)]),
            "row_mask": {lt: g.op("Unsqueeze", [m, g.const([0, 1], **i64)]) for lt, m in rows.items()}}


def concat_rows(ws: Sequence[BlockWeight]) -> BlockWeight | None:
    """The weights stacked along their output rows as one BlockWeight (the same blocks, nothing
    requantized), or None when their block formats differ (bits, block size, zero-point kind).
    A weight without zero points gets the op's default (2^(bits-1)) written out, and one without
    block mins zeros, where the others have them: the products are unchanged."""
    ws = _one_format([kernel_form(w) for w in ws])
    if ws is None:
        return None
    first = ws[0]
    zps = None if first.zero_points is None else np.concatenate([w.zero_points for w in ws])
    return BlockWeight(np.concatenate([w.codes for w in ws]), np.concatenate([w.scales for w in ws]), zps,
                       first.bits, first.block_size, "+".join(sorted({w.source_type for w in ws})), _stacked_mins(ws))


def _one_format(ws: list[BlockWeight]) -> list[BlockWeight] | None:
    """`ws` in one block format: as they are when they share it; with the default zero points
    written out when only some have them (8-bit codes); None when they cannot share one."""
    kinds = {(w.bits, w.block_size, w.shape[1], _zero_kind(w)) for w in ws}
    if len(kinds) == 1:
        return ws
    kinds = {(b, bs, k, z if z != "none" else "uint8") for b, bs, k, z in kinds}
    if len(kinds) > 1 or any(w.bits == 4 for w in ws):  # 4-bit zero points are packed: keep apart
        return None
    return [w if w.zero_points is not None else replace(
        w, zero_points=np.full(w.scales.shape, 1 << (w.bits - 1), np.uint8)) for w in ws]


def _stacked_mins(ws: list[BlockWeight]) -> np.ndarray | None:
    """The block mins of the stacked weight: zeros for a weight without (None when none has them)."""
    if all(w.mins is None for w in ws):
        return None
    return np.concatenate([w.mins if w.mins is not None else np.zeros_like(w.scales) for w in ws])


def _zero_kind(w: BlockWeight) -> str:
    return "none" if w.zero_points is None else str(w.zero_points.dtype)


def linear_group(g, x: str, ws: Sequence, name: str) -> list[str] | None:
    """x @ w.T for each of `ws` through one MatMulNBits and a Split, when they are BlockWeights of
    one block format; None otherwise (the caller multiplies them apart)."""
    if len(ws) < 2 or not all(isinstance(w, BlockWeight) for w in ws):
        return None
    joined = concat_rows(ws)
    if joined is None:
        return None
    y = g.matmul_nbits(x, joined, name)
    sizes = g.const([w.shape[0] for w in ws], dtype=np.int64)
    return g.op("Split", [y, sizes], hint=name, n_out=len(ws), axis=-1)
