"""onnxruntime backend for edgespec's decoder graphs (see exporters/onnx_graph.py).

The KV cache is the list of `present_*` OrtValues the last run returned; they stay in
onnxruntime's memory and are bound straight back as the next run's `past_*` inputs
(IOBinding), so the host never copies the cache. Rolling back slices them on the
sequence axis, which is one copy of the kept prefix, done only after a rejection.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import BackendError
from .base import Capabilities, Runtime

__all__ = ["OnnxRuntime", "available_devices"]

logger = logging.getLogger(__name__)


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError as e:  # edge installs may pick another backend
        raise BackendError("onnxruntime is not installed: pip install 'edgespec[onnx]'") from e
    return ort


def available_devices() -> list[str]:
    """edgespec runs onnxruntime on the CPU execution provider only."""
    return ["CPU"]


class OnnxRuntime(Runtime):
    """One edgespec decoder graph in an onnxruntime InferenceSession."""

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None, device: str | None = None) -> None:
        ort = _import_ort()
        if device not in (None, "CPU", "cpu"):
            raise BackendError(f"onnxruntime: device '{device}' is not available (available: "
                               f"{', '.join(available_devices())})")
        path = Path(model_path)
        if not path.is_file():
            raise BackendError(f"ONNX model not found: {path}")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        try:
            self._sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types; keep one line
            raise BackendError(f"cannot load {path.name}: {str(e).splitlines()[0]}") from e
        self._ort = ort
        names = [i.name for i in self._sess.get_inputs()]
        if names[:3] != ["input_ids", "n_logits", "past_key_0"]:
            raise BackendError(f"{path.name} is not an edgespec decoder graph (inputs: {', '.join(names[:4])})")
        self._n_layers = sum(1 for n in names if n.startswith("past_key_"))
        kv = self._sess.get_inputs()[2].shape  # (1, kvh, P, hd)
        self._kv_heads, self._head_dim = int(kv[1]), int(kv[3])
        vocab = self._sess.get_outputs()[0].shape[2]  # (1, n_logits, vocab)
        if not isinstance(vocab, int):
            raise BackendError(f"{path.name} is not an edgespec decoder graph (no fixed vocabulary size)")
        self.vocab_size = vocab
        self._weight_bytes = _file_bytes(path)
        self._past: list = []
        self._n_past = 0
        self.capabilities = Capabilities(backend="onnxruntime", can_trim=True, devices=("CPU",))
        self.reset()

    @property
    def n_past(self) -> int:
        return self._n_past

    def reset(self) -> None:
        empty = np.zeros((1, self._kv_heads, 0, self._head_dim), dtype=np.float32)
        self._past = [self._ort.OrtValue.ortvalue_from_numpy(empty) for _ in range(2 * self._n_layers)]
        self._n_past = 0

    def forward(self, token_ids: Sequence[int], n_logits: int = 1) -> np.ndarray:
        if not token_ids:
            raise ValueError("forward needs at least one token")
        n_logits = min(n_logits, len(token_ids))
        binding = self._sess.io_binding()
        binding.bind_cpu_input("input_ids", np.asarray([token_ids], dtype=np.int64))
        binding.bind_cpu_input("n_logits", np.asarray([n_logits], dtype=np.int64))
        for j in range(self._n_layers):
            binding.bind_ortvalue_input(f"past_key_{j}", self._past[2 * j])
            binding.bind_ortvalue_input(f"past_value_{j}", self._past[2 * j + 1])
        binding.bind_output("logits")
        for j in range(self._n_layers):
            binding.bind_output(f"present_key_{j}")
            binding.bind_output(f"present_value_{j}")
        self._sess.run_with_iobinding(binding)
        outs = binding.get_outputs()
        self._past = list(outs[1:])
        self._n_past += len(token_ids)
        return outs[0].numpy()[0]  # (n_logits, V)

    def trim(self, n_past: int) -> None:
        if n_past >= self._n_past:
            return
        if n_past <= 0:
            self.reset()
            return
        OrtValue = self._ort.OrtValue
        # copy: with one KV head the slice is contiguous, and a view would outlive the buffer it
        # points into once the OrtValue that owns it is dropped (garbage after a second trim)
        self._past = [OrtValue.ortvalue_from_numpy(v.numpy()[:, :, :n_past].copy()) for v in self._past]
        self._n_past = n_past

    def memory_bytes(self) -> dict[str, int]:
        kv = 2 * self._n_layers * self._kv_heads * self._head_dim * 4 * self._n_past
        return {"weights": self._weight_bytes, "kv": kv}

    def close(self) -> None:
        self._past = []
        self._sess = None


def _file_bytes(path: Path) -> int:
    data = [p for p in path.parent.glob(path.name + "*") if p.is_file()]
    return sum(p.stat().st_size for p in data)
