"""Rows of a head's weight for chosen token ids, read from the bundle's own tensors.

A draft on the target's body scores its VocabTrim vocabulary with its trimmed head. The tokens a
reply takes from its conversation (names, a document's words) are often outside that vocabulary,
and a draft that cannot propose them is rejected there. The target's head holds every token's
row: `HeadRows(ids)` returns those rows (M, H) as float32, dequantized in numpy from the tensors
the head multiplies (MatMulNBits blocks, or a float MatMul / Gemm weight), so the draft can score
a few hundred extra tokens for the cost of a small matrix product (decoding/context_vocab.py).

The rows are the head's weights, not its kernel: a MatMulNBits head that quantizes its input
(accuracy level 4) scores a token a little differently. That is harmless: they only shape the
draft's proposal, and the verify judges every drafted token by the target's own logits.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .graphs import LOGITS

__all__ = ["HeadRows", "head_rows"]

logger = logging.getLogger(__name__)

# ops between the product and `logits` that only reshape it
_RESHAPES = frozenset({"Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten"})


@dataclass(frozen=True)
class HeadRows:
    """`rows(ids)`: the head's weight rows (M, hidden_size) float32 for target ids (M,)."""

    vocab_size: int
    hidden_size: int
    read: Callable[[np.ndarray], np.ndarray]

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids outside the head's vocabulary [0, {self.vocab_size})")
        return np.ascontiguousarray(self.read(ids), dtype=np.float32)


def nbits_rows(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, hidden: int,
               bits: int) -> Callable[[np.ndarray], np.ndarray]:
    """MatMulNBits' B (N, blocks, blob) dequantized row by row: (code - zero point) * scale, the
    codes packed low bits first, the zero point 2^(bits-1) unless given (uint8, packed the same way)."""
    n, blocks, blob = codes.shape
    per_byte = 8 // bits
    block = blob * per_byte
    scale = scales.reshape(n, blocks)

    def unpack(packed: np.ndarray) -> np.ndarray:
        if bits == 8:
            return packed.astype(np.float32)
        low, high = packed & 0x0F, packed >> 4
        return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.float32)

    zp_bytes = None if zero_points is None else zero_points.reshape(n, -1)

    def read(ids: np.ndarray) -> np.ndarray:
        vals = unpack(codes[ids]).reshape(len(ids), blocks, block)
        zp = (np.float32(1 << (bits - 1)) if zp_bytes is None
              else unpack(zp_bytes[ids])[:, :blocks].reshape(len(ids), blocks, 1))
        w = (vals - zp) * scale[ids][:, :, None]
        return w.reshape(len(ids), blocks * block)[:, :hidden]
    return read


def _product(model):
    """The node whose product reaches `logits` through reshapes only ((1, N, V) from a 2-D Gemm's
    (N, V)), or None."""
    producer = {out: n for n in model.nodes for out in n.outputs}
    node = producer.get(LOGITS)
    while node is not None and node.op_type in _RESHAPES:
        node = producer.get(node.inputs[0])
    return node


def _nbits(codes: np.ndarray, hidden: int) -> int | None:
    """The bits of MatMulNBits codes (N, blocks, blob): ceil(hidden / block) blocks of blob bytes."""
    _, blocks, blob = codes.shape
    return next((b for b in (4, 8) if -(-hidden // (blob * 8 // b)) == blocks), None)


@dataclass(frozen=True)
class _NBitsTensors:
    """The initializers a MatMulNBits without group index or bias reads."""

    codes: np.ndarray  # (N, blocks, blob) uint8, the codes packed low bits first
    scales: np.ndarray  # one per block
    zero_points: np.ndarray | None  # uint8, packed as the codes; None: 2^(bits-1)


def _nbits_tensors(inputs: tuple[str, ...], arrays: Callable[[str], np.ndarray | None]) -> _NBitsTensors | None:
    """The tensors a MatMulNBits without group index or bias reads; None where one of them is not
    a mapped initializer, or the zero points are not uint8."""
    if len(inputs) > 4 and any(inputs[4:]) or len(inputs) < 3:
        return None
    codes, scales = arrays(inputs[1]), arrays(inputs[2])
    zp_name = inputs[3] if len(inputs) > 3 else ""
    zp = arrays(zp_name) if zp_name else None
    if codes is None or scales is None or (zp_name and zp is None):
        return None
    return None if zp is not None and zp.dtype != np.uint8 else _NBitsTensors(codes, scales, zp)


def _nbits_head(node, arrays: Callable[[str], np.ndarray | None], hidden: int) -> HeadRows | None:
    """A MatMulNBits head: codes (N, blocks, blob) of 4 or 8 bits, one scale per block."""
    t = _nbits_tensors(tuple(node.inputs), arrays)
    if t is None or t.codes.ndim != 3:
        return None
    bits = _nbits(t.codes, hidden)
    n, blocks, _ = t.codes.shape
    if bits is None or t.scales.size != n * blocks:
        return None
    return HeadRows(n, hidden, nbits_rows(t.codes, t.scales, t.zero_points, hidden, bits))


def _float_head(node, arrays: Callable[[str], np.ndarray | None], hidden: int) -> HeadRows | None:
    """A MatMul or Gemm over a 2-D weight initializer."""
    if len(node.inputs) != 2:
        return None
    w = arrays(node.inputs[1])
    if w is None or w.ndim != 2 or hidden not in w.shape:
        return None
    # (hidden, vocab) as MatMul reads it, or (vocab, hidden) as a tied Gemm with transB holds it
    if node.op_type == "MatMul" or w.shape[0] == hidden and w.shape[1] != hidden:
        return HeadRows(int(w.shape[1]), hidden, lambda ids, w=w: w[:, ids].T)
    return HeadRows(int(w.shape[0]), hidden, lambda ids, w=w: w[ids])


# the head products whose weight rows can be read, by op type
_HEADS = {"MatMulNBits": _nbits_head, "MatMul": _float_head, "Gemm": _float_head}


def head_rows(model, arrays: Callable[[str], np.ndarray | None], hidden: int) -> HeadRows | None:
    """HeadRows of a head graph (runtimes/onnxruntime/graphs.head_model) whose logits come straight
    from one MatMulNBits (4 or 8 bits, no group index or bias), MatMul or Gemm over a weight
    initializer; None for any other head (a soft-capped one, a quantized MatMulInteger), which then
    drafts from its trimmed vocabulary alone; reshapes between the product and the logits are
    passed over. arrays(name): the initializer's values (mapped)."""
    node = _product(model)
    read = _HEADS.get(node.op_type) if node is not None else None
    return read(node, arrays, hidden) if read is not None else None
