"""GGUF quantized blocks → onnxruntime's MatMulNBits weights, without an fp32 round-trip.

MatMulNBits (com.microsoft) stores a (N, K) weight as integer codes in blocks along K, one
scale per block and an optional zero point (uint8, or a float of the scale's type), and
dequantizes w = scale * (q - zero_point). Every GGUF block type below maps onto that exactly
(the codes are the GGUF's own codes, repacked, or for IQ4 the codebook values they index) or
within float32 rounding of the scale arithmetic (4-bit K-quant mins as float zero points):

  Q4_0  w = d (q - 8)                    4-bit, block 32, zero point 8 (MatMulNBits' default)
  Q4_1  w = d q + m                      4-bit, block 32, float zero point -m / d
  Q5_0  w = d (q - 16), q in 0..31       8-bit, block 32 (no 5-bit MatMulNBits), zero point 16
  Q5_1  w = d q + m                      8-bit, block 32, zero point 0, min -m (below)
  Q8_0  w = d q, q int8                  8-bit, block 32, codes q + 128, zero point 128 (default)
  Q4_K  w = d sc q - dmin m              4-bit, block 32, scale d sc, float zero point dmin m / (d sc)
  Q5_K  same, q in 0..31                 8-bit, block 32, zero point 0, min dmin m (below)
  Q6_K  w = d sc (q - 32), q in 0..63    8-bit, block 16, zero point 32
  Q3_K  w = d (sc - 32) q, q in -4..3     4-bit, block 16, codes q + 8, zero point 8 (default)
  Q2_K  w = d sc q - dmin m, q in 0..3    4-bit, block 16, codes q + 8, zero point 8, min dmin m
  IQ4_NL w = d kv[q], kv a 16-entry       8-bit, block 32, codes kv[q] + 128, zero point 128
        int8 codebook (-127 .. 113)
  IQ4_XS w = d (ls - 32) kv[q]            8-bit, block 32, the same codes, scale d (ls - 32)
  F32/F16/BF16                           kept as float arrays (norms, small tensors)

Q3_K and Q2_K are exact at 4 bits: their codes fit a nibble once shifted by MatMulNBits' default
zero point, their 6-bit / 4-bit sub-block scales become one float32 scale per 16 weights (block
16 is the smallest MatMulNBits takes, and what their sub-blocks are), and Q2_K's sub-block offset
is the per-block min below. The two IQ4 types are exact at 8 bits only: MatMulNBits dequantizes
linearly and has no codebook input, and no zero point and scale map the non-linear codebook's
sixteen values onto sixteen evenly spaced ones; its values are int8, so 8-bit codes hold them
as they are (the weight costs 9 bits where the GGUF spends 4.25-4.5). A Gather through the
codebook in the graph would keep 4-bit codes but dequantize every matrix on every forward.

onnxruntime's CPU MatMulNBits rejects float zero points with 8-bit codes, so an 8-bit affine
type keeps its per-block min apart: w = scale * q - min, and the graph subtracts
(block sums of x) @ min^T from the MatMulNBits product (onnx/graph), the same identity.

A 4-bit block whose scale is 0 but whose offset is not (w constant = offset) is written with
codes 1, zero point 0 and the offset as its scale, which is the same weight exactly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...errors import ExportError

__all__ = ["BlockWeight", "transcode", "check_transcodable", "TRANSCODABLE", "dequantize_blockweight",
           "quant_type_name", "fold_mins"]

logger = logging.getLogger(__name__)

_QK_K = 256


@dataclass(frozen=True)
class BlockWeight:
    """A (N, K) weight in MatMulNBits' layout.

    codes: uint8 (N, K // block_size, block_size * bits // 8), 4-bit codes packed low nibble first;
    scales: float32 (N, K // block_size); zero_points: None (the op's default 2^(bits-1)),
    uint8 (N, K // block_size) unpacked, or float32 (N, K // block_size); mins: None or float32
    (N, K // block_size), subtracted from every weight of its block."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    bits: int
    block_size: int
    source_type: str  # the GGUF block type it came from, e.g. "Q4_K"
    mins: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, kb, _ = self.codes.shape
        return n, kb * self.block_size

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in (self.zero_points, self.mins) if a is not None)
        return self.codes.nbytes + self.scales.nbytes + extra

    def rows(self, index: np.ndarray) -> BlockWeight:
        """The weight of output rows `index` (a trimmed head): the same blocks, no requantization."""
        index = np.asarray(index)
        pick = lambda a: None if a is None else np.ascontiguousarray(a[index])  # noqa: E731
        return BlockWeight(pick(self.codes), pick(self.scales), pick(self.zero_points), self.bits,
                           self.block_size, self.source_type, pick(self.mins))

    def unpacked_codes(self) -> np.ndarray:
        """uint8 (N, K // block_size, block_size) codes."""
        if self.bits == 8:
            return self.codes
        lo, hi = self.codes & np.uint8(0x0F), self.codes >> np.uint8(4)
        return np.stack([lo, hi], axis=-1).reshape(*self.codes.shape[:2], self.block_size)

    def dequantize(self) -> np.ndarray:
        return dequantize_blockweight(self)


def dequantize_blockweight(w: BlockWeight) -> np.ndarray:
    """float32 (N, K): a numpy reimplementation of MatMulNBits' dequantization, (q - zp) * scale,
    minus the block's min where it has one."""
    q = w.unpacked_codes().astype(np.float32)
    if w.zero_points is None:
        zp = np.float32(1 << (w.bits - 1))
    else:
        zp = w.zero_points.astype(np.float32)[..., None]
    out = (q - zp) * w.scales[..., None]
    if w.mins is not None:
        out = out - w.mins[..., None]
    return out.reshape(w.shape).astype(np.float32, copy=False)


def fold_mins(w: BlockWeight) -> BlockWeight:
    """The same weight with its block mins folded into float zero points, w = scale (q - min / scale),
    for consumers that take zero points of any type with any bit width (OpenVINO's compressed
    constants); exact up to float32 rounding of min / scale, as 4-bit K-quants already are. A block
    whose scale is 0 keeps its constant value -min as codes 1, zero point 0, scale -min."""
    if w.mins is None:
        return w
    zero = w.scales == 0
    # scale (q - zp) - min = scale (q - (zp + min / scale)); zp is the op's default when absent
    base = np.float32(1 << (w.bits - 1)) if w.zero_points is None else w.zero_points.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        zp = np.where(zero, 0.0, base + w.mins / np.where(zero, 1.0, w.scales)).astype(np.float32)
    codes, scales = w.codes, w.scales
    if zero.any():
        codes = codes.copy()
        codes[zero] = 1 if w.bits == 8 else 0x11  # 8-bit codes are unpacked; 4-bit two per byte
        scales = np.where(zero, -w.mins, w.scales).astype(np.float32)
    return BlockWeight(codes, scales, zp, w.bits, w.block_size, w.source_type)


def _pack4(q: np.ndarray) -> np.ndarray:
    """(..., 2m) codes 0..15 → (..., m) bytes, element 2i in the low nibble (MatMulNBits' order)."""
    return (q[..., 0::2] | (q[..., 1::2] << np.uint8(4))).astype(np.uint8)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _affine(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int):
    """w = scale * q + offset (per block): 4-bit as codes, scales and float zero points
    zp = -offset / scale; 8-bit as zero point 0 and min -offset (see the module docstring).

    q: uint8 (nb, sub, bs); scale, offset: float32 (nb, sub). Returns (q, scales, zp, bits, mins)."""
    if bits == 8:
        return q, scale, np.zeros(scale.shape, np.uint8), 8, (-offset).astype(np.float32)
    zero = scale == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        zp = np.where(zero, 0.0, -offset / np.where(zero, 1.0, scale)).astype(np.float32)
    if zero.any():  # constant block: codes 1, zero point 0, scale = the offset
        q = q.copy()
        q[zero] = 1
        scale = np.where(zero, offset, scale).astype(np.float32)
    return q, scale.astype(np.float32), zp, 4, None


# each returns (codes uint8 (nb, sub, bs) unpacked, scales (nb, sub), zero points or None, bits, mins)
def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q5_0 order: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of a little-endian uint32 is element j's fifth bit."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return ((bits & np.uint32(1)).astype(np.uint8)) << np.uint8(4)


def _q4_0(blocks: np.ndarray):
    return _nibbles(blocks[:, 2:])[:, None, :], _f16(blocks[:, :2]), None, 4, None


def _q4_1(blocks: np.ndarray):
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return _affine(_nibbles(blocks[:, 4:])[:, None, :], d, m, 4)


def _q5_0(blocks: np.ndarray):
    q = _nibbles(blocks[:, 6:]) | _high_bits(blocks[:, 2:6])
    zp = np.full((len(blocks), 1), 16, np.uint8)
    return q[:, None, :], _f16(blocks[:, :2]), zp, 8, None


def _q5_1(blocks: np.ndarray):
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 8:]) | _high_bits(blocks[:, 4:8])
    return _affine(q[:, None, :], d, m, 8)


def _q8_0(blocks: np.ndarray):
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:] ^ np.uint8(0x80)  # int8 q + 128 as a byte: flipping the sign bit, no wider temporary
    return q[:, None, :], d, None, 8, None


def _k_scales(blocks: np.ndarray):
    from gguf.quants import Q4_K

    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    # the products gguf's own dequantizer forms, in float32
    return d * sc.astype(np.float32), dmin * m.astype(np.float32)


def _q4_k(blocks: np.ndarray):
    n = blocks.shape[0]
    scale, dm = _k_scales(blocks)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(n, 8, 32)
    return _affine(q, scale, -dm, 4)


def _q5_k(blocks: np.ndarray):
    n = blocks.shape[0]
    scale, dm = _k_scales(blocks)
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    ql = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = qh.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = ((ql & np.uint8(0x0F)).reshape(n, 8, 32) | ((qh & np.uint8(0x01)).reshape(n, 8, 32) << np.uint8(4)))
    return _affine(q, scale, -dm, 8)


def _q6_k(blocks: np.ndarray):
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    ql = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(n, 8, 32)
    qh = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(n, 8, 32)
    q = (ql | (qh << np.uint8(4))).reshape(n, 16, 16)
    zp = np.full((n, 16), 32, dtype=np.uint8)
    return q, d * sc, zp, 8, None


def _q3_k(blocks: np.ndarray):
    n = blocks.shape[0]
    hmask, qs, sc, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _f16(blocks[:, 108:110])
    # 6-bit scales: low nibbles in bytes 0..7 (two per byte), high bit pairs in bytes 8..11
    lo = (sc[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hi = (sc[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    scales = ((lo & np.uint8(0x0F)) | ((hi & np.uint8(0x03)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    # element 32 s + b of each 128-element half is bits 2s..2s+1 of byte b; its hmask bit set means
    # no -4 offset
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    q = ql.reshape(n, 16, 16) + (qh.reshape(n, 16, 16) << np.uint8(2)) + np.uint8(4)  # q + 8 in 4..11
    return q, d * scales.astype(np.float32), None, 4, None


def _q2_k(blocks: np.ndarray):
    n = blocks.shape[0]
    sc, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    # the products gguf's own dequantizer forms, in float32
    scale = d * (sc & np.uint8(0x0F)).astype(np.float32)
    low = dmin * (sc >> np.uint8(4)).astype(np.float32)
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    return q.reshape(n, 16, 16) + np.uint8(8), scale, None, 4, low


# IQ4_NL's codebook (gguf-py's IQ4_NL.kvalues, llama.cpp's kvalues_iq4nl) as 8-bit codes around 128
_IQ4_CODES = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                       dtype=np.int16) + 128).astype(np.uint8)


def _iq4_nl(blocks: np.ndarray):
    q = _IQ4_CODES[_nibbles(blocks[:, 2:])]
    return q[:, None, :], _f16(blocks[:, :2]), None, 8, None


def _iq4_xs(blocks: np.ndarray):
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    high = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))
    low = (blocks[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(n, 8) & np.uint8(0x0F)
    ls = (low | ((high & np.uint16(3)).astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(32)
    q = _IQ4_CODES[_nibbles(blocks[:, 8:].reshape(n, 8, 16))]
    return q, d * ls.astype(np.float32), None, 8, None


# GGUF block type name -> (elements per GGUF block, bytes per GGUF block, decoder)
_DECODERS: dict[str, tuple[int, int, Callable]] = {
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "Q4_K": (_QK_K, 144, _q4_k),
    "Q5_K": (_QK_K, 176, _q5_k),
    "Q6_K": (_QK_K, 210, _q6_k),
    "Q3_K": (_QK_K, 110, _q3_k),
    "Q2_K": (_QK_K, 84, _q2_k),
    "IQ4_NL": (32, 18, _iq4_nl),
    "IQ4_XS": (_QK_K, 136, _iq4_xs),
}
_FLOATS = ("F32", "F16", "BF16")
TRANSCODABLE = tuple(_DECODERS) + _FLOATS


def quant_type_name(qtype) -> str:
    """'Q4_K' for a gguf.GGMLQuantizationType (or its int value)."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return f"type {int(qtype)}"


def check_transcodable(qtype, shape: tuple[int, ...], name: str) -> str:
    """The block type's name if `transcode` takes a tensor of this type and shape, else a one-line
    ExportError naming the tensor: checked when a GGUF is read, before any tensor is decoded."""
    tname = quant_type_name(qtype)
    if tname in _FLOATS:
        return tname
    if tname not in _DECODERS:
        raise ExportError(f"tensor {name} has GGUF block type {tname}, which edgespec cannot transcode "
                          f"(supported: {', '.join(TRANSCODABLE)})")
    if len(shape) != 2:
        raise ExportError(f"tensor {name}: a quantized {tname} tensor of shape {tuple(shape)} is not a matrix")
    if shape[1] % _DECODERS[tname][0]:
        raise ExportError(f"tensor {name}: row length {shape[1]} is not a multiple of the {tname} block "
                          f"({_DECODERS[tname][0]})")
    return tname


def transcode(raw: np.ndarray, qtype, shape: tuple[int, ...], name: str) -> BlockWeight | np.ndarray:
    """One GGUF tensor (`raw`: its bytes or its float array as gguf's reader returns them; `shape`:
    numpy order, rows last-but-one) as a BlockWeight (2-D quantized) or a float32 array.

    A block type not listed in TRANSCODABLE is a one-line ExportError naming it and the tensor."""
    tname = check_transcodable(qtype, shape, name)
    if tname in _FLOATS:
        if tname == "BF16":
            arr = (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.asarray(raw).astype(np.float32)
        return arr.reshape(shape)
    n, k = shape
    per, nbytes, decode = _DECODERS[tname]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    if blocks.shape[0] != n * k // per:
        raise ExportError(f"tensor {name}: {blocks.shape[0]} {tname} blocks for shape {tuple(shape)}")
    q, scales, zp, bits, mins = decode(blocks)
    bs = q.shape[-1]
    kb = k // bs
    q = q.reshape(n, kb, bs)
    codes = _pack4(q) if bits == 4 else np.ascontiguousarray(q)
    flat = lambda a, dt=None: None if a is None else np.ascontiguousarray(a, dtype=dt).reshape(n, kb)  # noqa: E731
    return BlockWeight(codes=codes, scales=flat(scales, np.float32), zero_points=flat(zp), bits=bits,
                       block_size=bs, source_type=tname, mins=flat(mins, np.float32))
