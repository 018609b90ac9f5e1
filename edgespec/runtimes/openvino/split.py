"""An edgespec OpenVINO IR split at its final hidden state, for a draft on the target's body.

`OpenVinoRuntime(output="hidden")` is the body (openvino/graph.cut_head) and `OpenVinoHead` the
head alone (openvino/graph.head_model); `open_shared_pair` joins the target's body to the
target's head and to the draft IR's (trimmed) head through runtimes/shared_body.py; with
`draft_head` (a bundle's trained head, the same ONNX file onnxruntime runs), the draft also
holds that head (`OpenVinoFeatureHead`) for decoding/head_drafter.py.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ...errors import BackendError
from ..shared_body import SharedBodyRuntime, check_feature_head, check_heads, shared_pair
from .graph import HIDDEN, head_model
from .runtime import OpenVinoRuntime, compile_model, import_ov, model_precision, ov_reason, read_ir, streamed_of

__all__ = ["OpenVinoFeatureHead", "OpenVinoHead", "open_shared_pair"]

logger = logging.getLogger(__name__)


class OpenVinoHead:
    """`head(hidden)`: logits (R, V) of hidden rows (R, H), a view valid until the next call.

    A head is a norm and a FullyConnected, whose CPU kernels give each row the same bits whatever
    the row count (dynamic int8 activations included; see openvino/graph.py), so a one-row call
    and a verify's rows agree with the fused IR's."""

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None, device: str | None = None,
                 precision: str | None = None, in_body: bool = False, pad_rows: bool = False) -> None:
        """in_body: the IR is also loaded as a body runtime, which reports its whole file, so this
        head reports no weights of its own (the memory report would count them twice).
        pad_rows: a one-row call multiplies two rows (the row twice), as the body does with the
        option (OpenVinoRuntime): where one-row kernels round unlike taller ones."""
        path = Path(model_path)
        core, model, device = read_ir(path, device)
        self.precision = model_precision(model, device, precision, threads)
        head = head_model(model)
        # the head's weights: what this half holds of the IR (a tied table is shared with the body's file)
        self.weight_bytes = 0 if in_body else \
            int(sum(op.get_byte_size() for op in head.get_ops() if op.get_type_name() == "Constant"))
        self.hidden_size = head.input(0).get_partial_shape()[2].get_length()
        self.vocab_size = head.output(0).get_partial_shape()[2].get_length()
        self._compiled = compile_model(core, head, path, device, self.precision, threads, True)
        self._req = self._compiled.create_infer_request()
        self._streamed = streamed_of(head, self._compiled)
        self._tensor = import_ov().Tensor
        self.pad_rows = pad_rows
        # the input rows go into a kept buffer, wrapped in a Tensor once and reshaped per call
        self._in, self._in_tensor = np.zeros((1, 0, self.hidden_size), dtype=np.float32), None

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        rows = len(hidden)
        n = rows + int(self.pad_rows and rows == 1)
        if n > self._in.shape[1]:  # a wider call than before: grow once, keep it
            self._in = np.zeros((1, max(n, 17), self.hidden_size), dtype=np.float32)
            self._in_tensor = self._tensor(self._in, shared_memory=True)
            self._req.set_input_tensor(0, self._in_tensor)
        self._in[0, :rows] = hidden
        self._in[0, rows:n] = hidden[-1]
        self._in_tensor.shape = (1, n, self.hidden_size)
        try:
            # views of the output (share_outputs): the logits, a full vocabulary a row, are not copied
            logits = self._req.infer(share_outputs=True).to_tuple()[0]
        except Exception as e:
            raise BackendError(f"OpenVINO head inference failed: {ov_reason(e)}") from e
        return logits[0][:rows]

    def streamed(self):
        return self._streamed

    def close(self) -> None:
        self._req = None
        self._compiled = None


class OpenVinoFeatureHead:
    """A trained draft head (its ONNX file, read by OpenVINO): `head(hidden, tokens)` -> the next
    features (R, H) of hidden rows (R, H) and draft-vocabulary token indices (R,). Compiled in
    f32: a few small matmuls, where a lower precision would only move the features."""

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None, device: str | None = None) -> None:
        path = Path(model_path)
        core, model, device = read_ir(path, device)
        self.hidden_size = model.input(0).get_partial_shape()[1].get_length()
        self.weight_bytes = int(sum(op.get_byte_size() for op in model.get_ops() if op.get_type_name() == "Constant"))
        self._compiled = compile_model(core, model, path, device, "f32", threads, True)
        self._req = self._compiled.create_infer_request()

    def __call__(self, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        try:
            self._req.infer([np.ascontiguousarray(hidden, dtype=np.float32),
                             np.ascontiguousarray(tokens, dtype=np.int64)])
        except Exception as e:
            raise BackendError(f"OpenVINO draft head inference failed: {ov_reason(e)}") from e
        return self._req.get_output_tensor(0).data

    def close(self) -> None:
        self._req = None
        self._compiled = None


def open_shared_pair(target_path: str | os.PathLike, draft_path: str | os.PathLike, *, threads: int | None = None,
                     device: str | None = None, kv_capacity: int | None = None, wide: bool = True,
                     pad_rows: bool = False, draft_head: str | os.PathLike | None = None
                     ) -> tuple[SharedBodyRuntime, SharedBodyRuntime]:
    """(target, draft): the target IR's body with its own head, and with the draft IR's head.
    The draft IR's body is never loaded. wide: the body runs its one-token forwards (drafts, plain
    steps) and its wider ones (verifies) on two compiled copies (OpenVinoRuntime), which on CPU
    saves the replanning at each change of width for a second copy of the repacked weights.
    pad_rows: body and heads never multiply one row (OpenVinoRuntime), the exact mode on CPUs whose
    one-row kernels round apart.
    draft_head: a trained head's .onnx, which the draft then holds."""
    body = OpenVinoRuntime(target_path, threads=threads, device=device, kv_capacity=kv_capacity, output=HIDDEN,
                           wide=wide, pad_rows=pad_rows)
    heads: list = []
    try:
        for path, in_body in ((target_path, True), (draft_path, False)):
            heads.append(OpenVinoHead(path, threads=threads, device=device, precision=body.precision,
                                      in_body=in_body, pad_rows=pad_rows))
        check_heads(heads[0], heads[1])
        if draft_head is not None:
            heads.append(OpenVinoFeatureHead(draft_head, threads=threads, device=device))
            check_feature_head(heads[1], heads[2])
    except BaseException:
        for h in heads:
            h.close()
        body.close()
        raise
    return shared_pair(body, heads[0], heads[1], heads[2] if draft_head is not None else None)
