"""BlockWeight (GGUF blocks transcoded by gguf/transcode) as onnxruntime graph pieces: MatMulNBits
products and embedding gathers that read the same initializers, so a tied table is stored once."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
from onnx import TensorProto, helper

from ..gguf.transcode import BlockWeight

__all__ = ["BlockOps", "kernel_form"]


class BlockOps:
    """Mixin of the graph builder (onnx/graph._G) for BlockWeight weights; expects its `op`,
    `const`, `name`, `nodes`, `init`, `nbits_accuracy`, `float_zero_points`, `fused` and a `_blocks` dict."""

    def blocks(self, w: BlockWeight, name: str) -> tuple[str, ...]:
        """(codes, scales[, zero points]) initializer names of a BlockWeight, written once per name."""
        if name in self._blocks:
            return self._blocks[name]
        n, k = w.shape
        names = [name + ".codes", name + ".scales"]
        self.init(np.ascontiguousarray(w.codes), names[0])
        self.init(w.scales.reshape(-1), names[1])  # (N * k_blocks,)
        if w.zero_points is not None:
            zp = w.zero_points
            if zp.dtype == np.uint8 and w.bits == 4:  # two per byte, each row padded to whole bytes
                if zp.shape[1] % 2:
                    zp = np.concatenate([zp, np.full((n, 1), 8, np.uint8)], axis=1)
                zp = zp[:, 0::2] | (zp[:, 1::2] << np.uint8(4))
            names.append(name + ".zero_points")
            self.init(np.ascontiguousarray(zp).reshape(-1), names[2])
        self._blocks[name] = tuple(names)
        return self._blocks[name]

    def matmul_nbits(self, x: str, w: BlockWeight, name: str) -> str:
        """x @ w.T with onnxruntime's MatMulNBits on the weight's own blocks."""
        w = w if self.float_zero_points else kernel_form(w)
        n, k = w.shape
        out = self.name(name)
        self.nodes.append(helper.make_node(
            "MatMulNBits", [x, *self.blocks(w, name)], [out], name=self.name("n"), domain="com.microsoft",
            K=k, N=n, bits=w.bits, block_size=w.block_size, accuracy_level=self.nbits_accuracy))
        if w.mins is None:
            return out
        # w = scale * q - min per block: x @ w^T = MatMulNBits(x) - (block sums of x) @ min^T
        i64 = dict(dtype=np.int64)
        kb = k // w.block_size
        sums = self.op("ReduceSum", [self.op("Reshape", [x, self.const([-1, kb, w.block_size], **i64)]),
                                     self.const([-1], **i64)], keepdims=0)  # (rows, kb)
        if self.fused:  # four kernels, not six: (rows, N) broadcasts against (1, rows, N)
            return self.op("Sub", [out, self.op("MatMul", [sums, self._mins(w, name)])])
        corr = self.op("MatMul", [sums, self._mins(w, name)])
        return self.op("Sub", [out, self.op("Reshape", [corr, self.op("Shape", [out])])])

    def gather_blocks(self, w: BlockWeight, name: str, ids: str) -> str:
        """Rows `ids` of a BlockWeight, dequantized in the graph: (1, S, K). Reads the same
        initializers as a tied head's MatMulNBits, so the table is stored once."""
        w = w if self.float_zero_points else kernel_form(w)
        i64 = dict(dtype=np.int64)
        n, k = w.shape
        kb = k // w.block_size
        names = self.blocks(w, name)
        rows = self.op("Gather", [names[0], ids], axis=0)  # (1, S, kb, bytes)
        if w.bits == 4:
            lo = self.op("BitwiseAnd", [rows, self.const(np.uint8(0x0F))])
            hi = self.op("BitShift", [rows, self.const(np.uint8(4))], direction="RIGHT")
            pair = self.op("Concat", [self.op("Unsqueeze", [t, self.const([-1], **i64)]) for t in (lo, hi)], axis=-1)
            rows = self.op("Reshape", [pair, self.const([1, -1, kb, w.block_size], **i64)])
        q = self.op("Cast", [rows], to=TensorProto.FLOAT)
        # block j of row r is element r * kb + j of the flat scales and zero points
        flat = self.op("Add", [self.op("Mul", [self.op("Unsqueeze", [ids, self.const([-1], **i64)]),
                                               self.const(kb, **i64)]),
                               self.const(np.arange(kb), **i64)])  # (1, S, kb)
        col = lambda t: self.op("Unsqueeze", [t, self.const([-1], **i64)])  # noqa: E731
        if w.zero_points is None:
            q = self.op("Sub", [q, self.const(np.float32(1 << (w.bits - 1)))])
        elif w.zero_points.dtype == np.uint8 and w.bits == 8:
            zero = self.op("Cast", [self.op("Gather", [names[2], flat], axis=0)], to=TensorProto.FLOAT)
            q = self.op("Sub", [q, col(zero)])
        elif w.zero_points.dtype == np.float32:
            q = self.op("Sub", [q, col(self.op("Gather", [names[2], flat], axis=0))])
        else:
            raise ValueError("packed 4-bit zero points are not gathered (no GGUF type produces them)")
        x = self.op("Mul", [q, col(self.op("Gather", [names[1], flat], axis=0))])
        if w.mins is not None:
            x = self.op("Sub", [x, col(self.op("Gather", [self._flat_mins(w, name), flat], axis=0))])
        return self.op("Reshape", [x, self.const([1, -1, k], **i64)])

    def _mins(self, w: BlockWeight, name: str) -> str:
        """The block mins as a (kb, N) initializer, written once per name."""
        if name + ".mins" not in self._blocks:
            self.init(np.ascontiguousarray(w.mins.T), name + ".mins")
            self._blocks[name + ".mins"] = (name + ".mins",)
        return name + ".mins"

    def _flat_mins(self, w: BlockWeight, name: str) -> str:
        key = name + ".mins_rows"
        if key not in self._blocks:
            self.init(w.mins.reshape(-1), key)  # (N * k_blocks,)
            self._blocks[key] = (key,)
        return key


def kernel_form(w: BlockWeight) -> BlockWeight:
    """A 4-bit weight with float zero points (Q4_K, Q4_1: w = s (q - z) - min) rewritten for
    onnxruntime's fast kernels: symmetric codes (zero point 8, no zero-point input) and the rest in
    the per-block min, w = s (q - 8) - (min + s (z - 8)), exact up to float32 rounding of s (z - 8).
    MatMulNBits with float zero points takes a reference path many times slower than with none:
    on a Q4_K_M model those weights were half of a decode step."""
    if w.bits != 4 or w.zero_points is None or w.zero_points.dtype != np.float32:
        return w
    shift = w.scales * (w.zero_points - np.float32(8))
    return replace(w, zero_points=None, mins=shift if w.mins is None else w.mins + shift)
