"""Weight-only quantization of an edgespec ONNX decoder with onnxruntime's MatMulNBits quantizer."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import onnx

from ...errors import ExportError

__all__ = ["QuantScheme", "SCHEMES", "quantize_model"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantScheme:
    """One weight-only scheme: MatMul weights (and the embedding Gather) in `bits` per block."""

    name: str
    bits: int
    block_size: int = 32
    symmetric: bool = True
    # accuracy_level 4 lets MatMulNBits run int8 x int-N kernels on CPU (fastest path here)
    accuracy_level: int = 4
    quantize_embedding: bool = True

    def describe(self) -> dict:
        return {"method": "onnxruntime.MatMulNBits", "bits": self.bits, "block_size": self.block_size,
                "symmetric": self.symmetric, "accuracy_level": self.accuracy_level,
                "embedding": self.quantize_embedding}


SCHEMES: dict[str, QuantScheme] = {
    # onnxruntime's GatherBlockQuantized takes only 4-bit tables: int8 keeps an fp32 embedding
    "int8": QuantScheme("int8", bits=8, quantize_embedding=False),
    # asymmetric: agrees with the target's top-1 more often than symmetric, at the same cost
    # (dev/quant_agreement.py, docs/speculative-decoding.md); int8 agrees more still, which is why
    # it is the default
    "int4": QuantScheme("int4", bits=4, symmetric=False),
}


def _import_quantizer():
    """Import onnxruntime's quantizer, undoing the root-logger setup it does at import time
    (only the CLI configures logging)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as e:
        raise ExportError("quantizing needs onnxruntime and onnx-ir: pip install 'edgespec[export]'") from e
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
    return MatMulNBitsQuantizer


def quantize_model(model: onnx.ModelProto, scheme: QuantScheme) -> onnx.ModelProto:
    """Return `model` with its MatMul (and optionally Gather) weights quantized."""
    MatMulNBitsQuantizer = _import_quantizer()
    ops = ("MatMul", "Gather") if scheme.quantize_embedding else ("MatMul",)
    quant = MatMulNBitsQuantizer(
        model,
        bits=scheme.bits,
        block_size=scheme.block_size,
        is_symmetric=scheme.symmetric,
        accuracy_level=scheme.accuracy_level,
        op_types_to_quantize=ops,
        quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    # the quantizer logs every skipped node at INFO; keep the user's log readable
    qlog = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = qlog.level
    qlog.setLevel(logging.ERROR)
    try:
        quant.process()
    finally:
        qlog.setLevel(level)
    return quant.model.model
