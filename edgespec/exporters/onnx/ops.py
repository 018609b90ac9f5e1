"""The small ONNX building blocks the decoder graph is written with: a node and initializer
accumulator (`_G`), RMSNorm (plain or onnxruntime's fused kernel), linear layers (float or
GGUF-block MatMulNBits, fused where they share a format), activations and rotary embeddings.
graph.py assembles them into a decoder; attention lives there too."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..gguf.transcode import BlockWeight
from ..spec import ModelSpec
from .blocks import BlockOps
from .external import ExternalData
from .fused import fast_gelu, fused_add_rms_norm, fused_rms_norm, linear_group

__all__ = ["_G", "_activation", "_add_norm", "_linear", "_linears", "_norm", "_rms_norm", "_rope", "_softcap"]


class _G(BlockOps):
    """Tiny node/initializer accumulator with unique names."""

    def __init__(self, weight_dtype: str = "fp32", data: ExternalData | None = None) -> None:
        self.half = weight_dtype == "fp16"
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.data = data  # where initializers' bytes go as they are made (None: kept in the protos)
        self._n = 0
        self.nbits_accuracy = 0
        self.float_zero_points = False
        self.fused = False
        self._blocks: dict[str, tuple[str, ...]] = {}  # BlockWeight initializers, shared by name

    def init(self, arr: np.ndarray, name: str) -> None:
        """Add initializer `name` holding `arr` (written to the data file at once, where there is one)."""
        self.inits.append(numpy_helper.from_array(arr, name) if self.data is None else self.data.tensor(arr, name))

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def op(self, op_type: str, inputs: Sequence[str], hint: str | None = None, n_out: int = 1, out: str | None = None,
           **attrs):
        outs = [out] if out else [self.name(hint or op_type) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.name("n"), **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, hint: str = "c", dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype)
        name = self.name(hint)
        self.init(arr, name)
        return name

    def weight(self, arr: np.ndarray, name: str) -> str:
        if not self.half:
            self.init(np.ascontiguousarray(arr, dtype=np.float32), name)
            return name
        # fp16 halves the file; onnxruntime's CPU kernels are fp32, so cast once at load
        self.init(np.ascontiguousarray(arr, dtype=np.float16), name + ".fp16")
        return self.op("Cast", [name + ".fp16"], hint=name, to=TensorProto.FLOAT)


def _rms_norm(g: _G, x: str, w: np.ndarray, name: str, eps: float, offset: float) -> str:
    """x / sqrt(mean(x^2) + eps) * (offset + w), over the last axis. Written as the pattern that
    onnxruntime's SimplifiedLayerNormFusion and OpenVINO's RMSFusion turn into one kernel (Pow,
    ReduceMean, Add, Sqrt, Div, Mul): six kernel launches per norm less, ~110 norms per Gemma 3
    forward."""
    sq = g.op("Pow", [x, g.const(2.0, dtype=np.float32)])
    mean = g.op("ReduceMean", [sq, g.const([-1], dtype=np.int64)], keepdims=1)
    root = g.op("Sqrt", [g.op("Add", [mean, g.const(eps, dtype=np.float32)])])
    return g.op("Mul", [g.op("Div", [x, root]), g.weight(w + offset, name)])


def _norm(g: _G, spec: ModelSpec, x: str, w: np.ndarray, name: str, fused: bool, scale: float = 1.0) -> str:
    """RMSNorm of x, times `scale` (folded into the fused kernel's weight)."""
    if fused:
        return fused_rms_norm(g, x, w, name, spec.rms_eps, spec.family.norm_offset, scale)
    y = _rms_norm(g, x, w, name, spec.rms_eps, spec.family.norm_offset)
    return y if scale == 1.0 else g.op("Mul", [y, g.const(scale, dtype=np.float32)])


def _add_norm(g: _G, spec: ModelSpec, x: str, y: str | None, w: np.ndarray, name: str, fused: bool):
    """(RMSNorm(x + y), x + y): the residual add and the norm that reads it (y None: no add)."""
    if y is None:
        return _norm(g, spec, x, w, name, fused), x
    if fused:
        return fused_add_rms_norm(g, x, y, w, name, spec.rms_eps, spec.family.norm_offset)
    total = g.op("Add", [x, y])
    return _rms_norm(g, total, w, name, spec.rms_eps, spec.family.norm_offset), total


def _linears(g: _G, x: str, w, names: Sequence[str], p: str, fused_name: str | None) -> list[str]:
    """x @ w.T for each weight `p + name + ".weight"` (and bias): one fused MatMulNBits and a Split
    under `fused_name` when they share a block format and have no bias, else one product each."""
    ws = [w[p + n + ".weight"] for n in names]
    biases = [w.get(p + n + ".bias") for n in names]
    if fused_name and all(b is None for b in biases):
        outs = linear_group(g, x, ws, p + fused_name)
        if outs is not None:
            return list(outs)
    return [_linear(g, x, wt, p + n.split(".")[-1], b) for wt, n, b in zip(ws, names, biases)]


def _activation(g: _G, x: str, kind: str, fused: bool = False) -> str:
    if fused and kind == "gelu_tanh":
        return fast_gelu(g, x)
    if kind == "silu":
        return g.op("Mul", [x, g.op("Sigmoid", [x])])
    # ONNX's Gelu (opset 20): one op for OpenVINO; onnxruntime 1.32 expands it into eight kernels
    # (the fused graph has FastGelu)
    return g.op("Gelu", [x], approximate="tanh" if kind == "gelu_tanh" else "none")


def _linear(g: _G, x: str, w: np.ndarray, name: str, bias: np.ndarray | None = None) -> str:
    """x @ w.T (+ b); weights stored (in, out) so MatMul-based quantizers recognise them."""
    if isinstance(w, BlockWeight):
        y = g.matmul_nbits(x, w, name)
    else:
        y = g.op("MatMul", [x, g.weight(w.T, name)])
    return g.op("Add", [y, g.weight(bias, name + ".bias")]) if bias is not None else y


def _rope(g: _G, x: str, cos: str, sin: str, half: int) -> str:
    """x * cos + rotate_half(x) * sin, x: (1, heads, S, hd)."""
    x1, x2 = g.op("Split", [x, g.const([half, half], dtype=np.int64)], n_out=2, axis=-1)
    rot = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rot, sin])])


def _softcap(g: _G, x: str, cap: float | None) -> str:
    """cap * tanh(x / cap) (Gemma 2's attention scores), or x itself when there is no cap."""
    if not cap:
        return x
    c = g.const(cap, dtype=np.float32)
    return g.op("Mul", [g.op("Tanh", [g.op("Div", [x, c])]), c])
