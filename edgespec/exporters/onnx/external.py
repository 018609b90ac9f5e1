"""Initializers written to the model's external data file as the graph is built.

`onnx.save_model(..., save_as_external_data=True)` needs every initializer in memory at once, as
TensorProto bytes (a copy of the weights), before it writes any: building a 270M model's graph
that way held the source's weights and the proto's copy together. The graph builder
(onnx/ops._G) hands each initializer to an `ExternalData` instead, which appends its bytes to
`<model>.data` at once and keeps only a reference, so the builder's memory is the tensor being
written. The files are those `save_model` writes: the same order, offsets and size threshold.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["ExternalData", "SIZE_THRESHOLD", "save_streamed"]

# onnx's save_model default: a tensor whose raw bytes (as Python measures a bytes object) reach
# this many stays in the data file, smaller ones in the graph
SIZE_THRESHOLD = 1024
_BYTES_OVERHEAD = sys.getsizeof(b"")


class ExternalData:
    """Appends initializers to one data file beside `model_path` (`<name>.data`); a context manager."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = Path(model_path)
        self.location = self.model_path.name + ".data"
        self.model_path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = (self.model_path.parent / self.location).open("wb")

    def tensor(self, arr: np.ndarray, name: str) -> TensorProto:
        """`arr` as an initializer named `name`: its bytes in the data file (or, below the size
        threshold, in the graph, as save_model would leave them)."""
        arr = np.asarray(arr)
        if arr.nbytes + _BYTES_OVERHEAD < SIZE_THRESHOLD or arr.dtype == object or not arr.dtype.isnative:
            return numpy_helper.from_array(arr, name)
        t = TensorProto()
        t.name = name
        t.dims.extend(arr.shape)
        t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        offset = self._fh.tell()
        self._fh.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
        for key, value in (("location", self.location), ("offset", offset), ("length", arr.nbytes)):
            entry = t.external_data.add()
            entry.key, entry.value = key, str(value)
        t.data_location = TensorProto.EXTERNAL
        return t

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> ExternalData:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_streamed(model: onnx.ModelProto, path: Path) -> None:
    """Write the graph of a model whose large initializers are already in its data file."""
    onnx.save_model(model, str(path))
