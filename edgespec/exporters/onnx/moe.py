"""A mixture-of-experts MLP (Qwen 3 MoE) in the decoder graph, routed as llama.cpp's build_moe_ffn
routes it: softmax over the router's logits, the top k experts, their k weights renormalised to sum
to 1 (llama.cpp's qwen3moe always renormalises), each chosen expert's SwiGLU MLP weighted by its
weight and summed. Two experts whose logits tie exactly at the k-th place may be chosen apart
from llama.cpp (its argsort's order against TopK's).

Computed densely: every expert runs on every row, and the routing weights (zero for the experts a
row did not choose) scale each expert's intermediate activations before one down projection over
all experts' columns. Stacked, the E experts are one MLP of E times the intermediate size, so the
graph has the dense MLP's shape (one MatMulNBits for gate and up, one for down, on the GGUF's own
blocks) and needs no gather, loop or kernel of its own; sum_e w_e down_e(a_e) = down([w_e a_e]_e)
is the same sum, rounded in another order. It costs E / k times the work of the experts a row
uses, which is reasonable for a model with few experts only: a model with more than
MAX_DENSE_EXPERTS is refused by name (gguf/experts.py, before its weights are decoded).
onnxruntime's com.microsoft MoE op, which runs the chosen experts only, has a CPU kernel but is
not used: it takes float weights (or QMoE's own quantization), not the
GGUF's blocks, so a quantized model would be dequantized or requantized; the dense graph keeps the
blocks and is the one graph onnxruntime and OpenVINO both run.
"""
from __future__ import annotations

import logging

import numpy as np
from onnx import TensorProto, helper

from ...errors import ExportError
from ..gguf.experts import MAX_DENSE_EXPERTS, check_dense_experts, expert_name
from ..gguf.transcode import BlockWeight
from ..spec import ModelSpec
from .ops import _G, _activation, _linear, _linears

__all__ = ["MAX_DENSE_EXPERTS", "is_moe", "moe_mlp", "stack_experts"]

logger = logging.getLogger(__name__)


def is_moe(w, p: str) -> bool:
    """Whether layer prefix `p` (model.layers.N.) has a router, i.e. a mixture of experts."""
    return p + "mlp.gate.weight" in w


def stack_experts(ws: list, axis: int):
    """The experts' matrices as one: along the output rows (axis 0: gate, up) or along the input
    columns (axis 1: down). BlockWeights keep their blocks (the experts of one GGUF tensor share
    its block type, so their layouts match); float arrays are concatenated."""
    if not all(isinstance(w, BlockWeight) for w in ws):
        return np.concatenate([np.asarray(w.dequantize() if isinstance(w, BlockWeight) else w, np.float32)
                               for w in ws], axis=axis)
    first = ws[0]
    if any((w.bits, w.block_size, w.source_type, w.zero_points is None, w.mins is None)
           != (first.bits, first.block_size, first.source_type, first.zero_points is None, first.mins is None)
           for w in ws):
        raise ExportError("the experts of one layer have different GGUF block types")

    def cat(field: str):
        parts = [getattr(w, field) for w in ws]
        return None if parts[0] is None else np.ascontiguousarray(np.concatenate(parts, axis=axis))

    return BlockWeight(cat("codes"), cat("scales"), cat("zero_points"), first.bits, first.block_size,
                       first.source_type, cat("mins"))


def _layer_experts(w, p: str, n_experts: int) -> dict[str, object]:
    """Layer `p`'s experts stacked: gate and up (E * ff, hidden), down (hidden, E * ff)."""
    layer = int(p.split(".")[2])
    out = {}
    for proj, axis in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        names = [expert_name(layer, e, proj) for e in range(n_experts)]
        missing = [n for n in names if n not in w]
        if missing:
            raise ExportError(f"the mixture of experts has no {missing[0]}")
        out[f"{p}mlp.experts_{proj}.weight"] = stack_experts([w[n] for n in names], axis)
    return out


def _routing(g: _G, spec: ModelSpec, logits: str) -> str:
    """(1, S, E) routing weights from the router's logits: llama.cpp's softmax over all experts, top
    k, divided by their sum, is the softmax over the top k logits alone (the other experts' terms
    cancel), zero for the experts not chosen. The softmax is written w_i = 1 / sum_j exp(l_j - l_i),
    not as Softmax nor as exp / sum: OpenVINO's converter fuses the latter into a Softmax, and its
    runtime's load-time rewrites take every Softmax for an attention's (runtimes/openvino/graph.py)."""
    i64 = dict(dtype=np.int64)
    top, idx = g.op("TopK", [logits, g.const([spec.experts_used], **i64)], n_out=2, axis=-1)  # (1, S, k)
    diff = g.op("Sub", [g.op("Unsqueeze", [top, g.const([-2], **i64)]),
                        g.op("Unsqueeze", [top, g.const([-1], **i64)])])  # (1, S, k, k): l_j - l_i
    weights = g.op("Reciprocal", [g.op("ReduceSum", [g.op("Exp", [diff]), g.const([-1], **i64)], keepdims=0)])
    zeros = g.op("ConstantOfShape", [g.op("Shape", [logits])],
                 value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
    return g.op("ScatterElements", [zeros, idx, weights], axis=-1)


def moe_mlp(g: _G, spec: ModelSpec, w, p: str, h: str, fused: bool) -> str:
    """The mixture of experts of layer prefix `p` on the normed rows `h` (1, S, hidden)."""
    router = w[p + "mlp.gate.weight"]  # (E, hidden), float: llama.cpp keeps the router unquantized
    n_experts = router.shape[0]
    if not spec.experts_used:
        raise ExportError("the model has a router (mlp.gate) but no count of experts used per token")
    check_dense_experts(spec.model_type, n_experts, spec.experts_used)
    stacked = _layer_experts(w, p, n_experts)
    ff = stacked[p + "mlp.experts_gate_proj.weight"].shape[0] // n_experts
    weights = _routing(g, spec, _linear(g, h, router, p + "router"))  # (1, S, E)
    gate, up = _linears(g, h, stacked, ["mlp.experts_gate_proj", "mlp.experts_up_proj"], p,
                        "experts_gate_up" if fused else None)  # (1, S, E * ff) each
    act = g.op("Mul", [_activation(g, gate, spec.activation, fused), up])
    i64 = dict(dtype=np.int64)
    act = g.op("Reshape", [act, g.const([1, -1, n_experts, ff], **i64)])
    act = g.op("Mul", [act, g.op("Unsqueeze", [weights, g.const([-1], **i64)])])  # each expert's rows by its weight
    act = g.op("Reshape", [act, g.const([1, -1, n_experts * ff], **i64)])
    return _linear(g, act, stacked[p + "mlp.experts_down_proj.weight"], p + "experts_down")
