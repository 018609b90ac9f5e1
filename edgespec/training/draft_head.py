"""A trained light draft head: its weights, its ONNX graph and a numpy reference of it.

EAGLE-style (Li et al., 2024; FastDraft and Kangaroo train similar small heads): from the target's
final hidden row h_t and the embedding of the next token x_{t+1}, one fuse layer and one gated
MLP block predict the feature h_{t+1} the target would compute there; the draft's own VocabTrim
head (already in the bundle, the target's head rows for the K kept tokens) turns that feature
into logits over K tokens. The predicted feature feeds the head again with the token drafted
from it, so a chain of drafts costs the head, never a body forward.

    e   = table[x]                                   # (K+1, H) fp16, frozen: the VocabTrim head's rows
    z   = concat(rms(h) * g_h, rms(e) * g_e) @ W_fuse + b_fuse
    n   = rms(z) * g_mlp
    z   = z + (silu(n @ W_gate) * (n @ W_up)) @ W_down
    f   = rms(z) * g_out                             # the feature: what the target's final norm gives

Token indices are in the draft vocabulary (the id map's order); index K stands for any target
token outside it (a zero row). The graph takes `hidden` (R, H) float32 and `token` (R,) int64 and
gives `feature` (R, H); OpenVINO reads the same file.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..decoding.head_drafter import draft_index

__all__ = ["HEAD_DIR", "HEAD_FILE", "FEATURE_LAYER", "HeadWeights", "build_onnx", "reference", "draft_index"]

HEAD_DIR = "draft_head"
HEAD_FILE = f"{HEAD_DIR}/head.onnx"
FEATURE_LAYER = "final_norm"  # the hidden rows the head reads and writes: after the target's final norm
EPS = 1e-6


@dataclass(frozen=True)
class HeadWeights:
    """Everything the head computes with, float32 numpy (the table is stored fp16)."""

    table: np.ndarray  # (K+1, H) token embeddings, last row zero (a token outside the K)
    g_h: np.ndarray  # (H,)
    g_e: np.ndarray  # (H,)
    w_fuse: np.ndarray  # (2H, H)
    b_fuse: np.ndarray  # (H,)
    g_mlp: np.ndarray  # (H,)
    w_gate: np.ndarray  # (H, I)
    w_up: np.ndarray  # (H, I)
    w_down: np.ndarray  # (I, H)
    g_out: np.ndarray  # (H,)

    @property
    def hidden_size(self) -> int:
        return int(self.w_fuse.shape[1])

    @property
    def k(self) -> int:
        return int(self.table.shape[0]) - 1


def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)


def reference(w: HeadWeights, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The head in numpy (what the ONNX graph computes): features (R, H)."""
    e = w.table.astype(np.float32)[tokens]
    z = np.concatenate([_rms(hidden) * w.g_h, _rms(e) * w.g_e], axis=-1) @ w.w_fuse + w.b_fuse
    n = _rms(z) * w.g_mlp
    gate = n @ w.w_gate
    z = z + (gate / (1 + np.exp(-gate)) * (n @ w.w_up)) @ w.w_down
    return _rms(z) * w.g_out


def build_onnx(w: HeadWeights):
    """The head as an ONNX model (opset 17, standard operators only, weights inline)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits = [], []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    def op(kind: str, inputs: list[str], out: str, **attrs) -> str:
        nodes.append(helper.make_node(kind, inputs, [out], name=out, **attrs))
        return out

    eps = const("eps", np.array(EPS, dtype=np.float32))

    def rms(x: str, g: str, tag: str) -> str:
        sq = op("Mul", [x, x], f"{tag}_sq")
        mean = op("ReduceMean", [sq], f"{tag}_mean", axes=[-1], keepdims=1)
        root = op("Sqrt", [op("Add", [mean, eps], f"{tag}_eps")], f"{tag}_root")
        return op("Mul", [op("Div", [x, root], f"{tag}_unit"), g], f"{tag}_out")

    for f in fields(HeadWeights):  # initializers named as the fields; the table in fp16 (half the file)
        const(f.name, getattr(w, f.name).astype(np.float16 if f.name == "table" else np.float32))
    e = op("Cast", [op("Gather", ["table", "token"], "embed16", axis=0)], "embed", to=TensorProto.FLOAT)
    x = op("Concat", [rms("hidden", "g_h", "in_h"), rms(e, "g_e", "in_e")], "fused_in", axis=-1)
    z = op("Add", [op("MatMul", [x, "w_fuse"], "fuse_mm"), "b_fuse"], "fused")
    n = rms(z, "g_mlp", "mlp")
    gate = op("MatMul", [n, "w_gate"], "gate")
    act = op("Mul", [gate, op("Sigmoid", [gate], "gate_sig")], "gate_act")
    up = op("Mul", [act, op("MatMul", [n, "w_up"], "up")], "gated")
    z = op("Add", [z, op("MatMul", [up, "w_down"], "down")], "block")
    out = rms(z, "g_out", "final")
    nodes.append(helper.make_node("Identity", [out], ["feature"], name="feature"))
    h = w.hidden_size
    graph = helper.make_graph(
        nodes, "edgespec_draft_head",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["rows", h]),
         helper.make_tensor_value_info("token", TensorProto.INT64, ["rows"])],
        [helper.make_tensor_value_info("feature", TensorProto.FLOAT, ["rows", h])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="edgespec")
    model.ir_version = 8
    return model
