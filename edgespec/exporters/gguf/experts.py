"""A GGUF mixture of experts' tensors for the ONNX/OpenVINO graph, which computes every expert densely
(onnx/moe.py): the bound on the experts it takes, transformers' name of each expert's matrix, and
a 3-D `blk.N.ffn_*_exps` tensor split into one matrix per expert."""
from __future__ import annotations

import numpy as np

from ...errors import ExportError

__all__ = ["MAX_DENSE_EXPERTS", "check_dense_experts", "expert_name", "expert_tensors", "is_expert_tensor"]

# a mixture of experts' 3-D tensors (experts, rows, row length) -> each expert's matrix (onnx/moe.expert_name)
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

# the most experts the ONNX/OpenVINO graph computes densely, every expert on every row (onnx/moe.py)
MAX_DENSE_EXPERTS = 16


def expert_name(layer: int, expert: int, proj: str) -> str:
    """transformers' name of one expert's matrix (Qwen3MoeSparseMoeBlock): proj is gate_proj, up_proj or down_proj."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def check_dense_experts(arch: str, n_experts: int, n_used: int) -> None:
    """A one-line ExportError unless the graph can compute `n_experts` densely (onnx/moe.py)."""
    if not 1 <= n_used <= n_experts:
        raise ExportError(f"the GGUF's {arch} uses {n_used} of {n_experts} experts per token; expected 1 to "
                          f"{n_experts}")
    if n_experts > MAX_DENSE_EXPERTS:
        raise ExportError(f"{arch} with {n_experts} experts is not supported by --format onnx/openvino: edgespec "
                          f"runs every expert on every token (up to {MAX_DENSE_EXPERTS} experts); use --format gguf")


def is_expert_tensor(name: str) -> bool:
    """Whether `name` is a mixture of experts' 3-D `blk.N.ffn_*_exps.weight` tensor."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[1].isascii() and parts[1].isdigit() \
        and parts[2] in _EXPERT_NAMES and parts[3] == "weight"


def expert_tensors(t, load) -> dict:
    """A 3-D `blk.N.ffn_*_exps` tensor as one matrix per expert (each expert's rows are whole blocks)."""
    shape = tuple(int(x) for x in reversed(t.shape))  # (experts, rows, row length)
    if len(shape) != 3:
        raise ExportError(f"GGUF tensor {t.name} has shape {shape}; a mixture of experts' tensor is 3-D")
    _, layer, part, _ = t.name.split(".")
    layer, proj = int(layer), _EXPERT_NAMES[part]
    raw = np.asarray(t.data).reshape(shape[0], -1)
    return {expert_name(layer, e, proj): load(raw[e], t.tensor_type, shape[1:], f"{t.name}[{e}]")
            for e in range(shape[0])}
