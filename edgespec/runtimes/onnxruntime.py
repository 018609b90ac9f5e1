"""onnxruntime backend for edgespec's decoder graphs (see exporters/onnx_graph.py).

Graphs exported with the "append" KV layout (every current export) run on fixed buffers:
one preallocated (capacity, kv_heads, head_dim) array per layer for K and one for V. Each
forward binds the filled prefix of every buffer as the past input and the rows right after
it as the output for the new positions (IOBinding on raw pointers), so the cache never
grows, is never copied, and a rollback just lowers n_past. Logits go into a reused buffer
as well: a step allocates nothing per candidate, accepted or rejected.

Older bundles ("present" layout) still run: the cache is then the list of `present_*`
OrtValues the last run returned, bound back as the next past (it grows by reallocation
every step; rolling back copies the kept prefix). This is also the naive baseline that
benchmarks/bench_memory.py compares against.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import BackendError, ContextFullError
from .base import Capabilities, Runtime
from .heap import trim_heap
from .onnx_graphs import import_ort as _import_ort

__all__ = ["OnnxRuntime", "available_devices", "DEFAULT_KV_CAPACITY"]

logger = logging.getLogger(__name__)

# positions preallocated when no capacity is planned; numpy's zeroed buffers are committed
# page by page as they fill, so an unused tail costs address space, not memory
DEFAULT_KV_CAPACITY = 4096
_LOGIT_ROWS = 17  # logits buffer rows kept ready: verify width for drafts up to 16 tokens


def available_devices() -> list[str]:
    """edgespec runs onnxruntime on the CPU execution provider only."""
    return ["CPU"]


class OnnxRuntime(Runtime):
    """One edgespec decoder graph in an onnxruntime InferenceSession."""

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None, device: str | None = None,
                 kv_capacity: int | None = None, kv_dtype: str | None = None, spin: bool = True,
                 pad_rows: bool = False, output: str = "logits", initializers: dict | None = None) -> None:
        """spin: idle intra-op threads spin-wait for the next run (onnxruntime's default). A session
        that alternates with another model's forwards (a draft and its target) should not: its
        spinning threads hold the cores the other needs (default bundle, 2 threads, speculative
        decoding 1.11x faster without; a plain decode alone 0.89x).
        pad_rows: compute every forward one row wider (its last token again) and drop that row, so
        no MatMul multiplies one row: the exact mode where a one-row kernel rounds unlike a taller
        one (MatMulNBits with int8 activations does, by whole logits), chosen by the exactness
        probe (runtimes/exactness.py). The fixed-buffer layout only; a decode then costs a
        two-row forward.
        output: "logits", or "hidden": the graph cut before its head (runtimes/onnxruntime_split.py),
        whose forward returns final hidden rows (n_logits, hidden) instead of logits: the body a
        draft shares with its target. initializers: name -> OrtValue the session uses instead of
        the file's (a tied table the head's session holds too); with output="hidden" only.

        The tables a Gather reads (the input embedding) are mapped from the file, not loaded: a
        forward reads the rows of its tokens, and a tied head prepacks its own copy at load, so
        the rest of the table never stays resident (Gemma 3 270M: 188 MB of 297 as GGUF blocks,
        671 MB as fp32)."""
        ort = _import_ort()
        if device not in (None, "CPU", "cpu"):
            raise BackendError(f"onnxruntime: device '{device}' is not available (available: "
                               f"{', '.join(available_devices())})")
        if kv_dtype not in (None, *self.kv_dtypes):
            raise BackendError(f"onnxruntime: KV dtype {kv_dtype!r} is not available (available: "
                               f"{', '.join(self.kv_dtypes)})")
        if kv_capacity is not None and kv_capacity < 1:
            raise BackendError(f"kv_capacity must be >= 1, got {kv_capacity}")
        if output not in ("logits", "hidden"):
            raise BackendError(f"onnxruntime: output must be 'logits' or 'hidden', got {output!r}")
        path = Path(model_path)
        if not path.is_file():
            raise BackendError(f"ONNX model not found: {path}")
        trim_heap()  # what earlier loads freed (a tokenizer's parse) goes back first: a lower peak
        self.spin = spin
        self._output = output
        self._initializers = dict(initializers or {})  # OrtValues the session reads: kept alive with it
        if output == "hidden":
            from .onnx_graphs import body_model, session

            self._sess = session(body_model(path), path.parent, threads=threads, spin=spin,
                                 initializers=self._initializers)
        else:
            from .onnx_graphs import MappedTables, gathered_tables, load_proto, ort_values

            # tables a Gather reads rows of are mapped from the file and let go once loaded (a tied
            # head prepacks its own copy): only the rows of the tokens seen are then resident
            try:
                proto = load_proto(path)
            except ImportError:  # no `onnx` package: the session loads every weight itself
                proto = None
            tables = MappedTables(proto, path.parent, gathered_tables(proto)) if proto is not None else None
            del proto
            self._initializers = ort_values(tables.arrays) if tables is not None else {}
            self._sess = self._open(ort, path, threads, spin, self._initializers)
            if tables is not None:
                tables.drop_pages()
        self._ort = ort
        trim_heap()  # onnxruntime's freed read buffers of the external weights
        names = [i.name for i in self._sess.get_inputs()]
        if names[:3] != ["input_ids", "n_logits", "past_key_0"]:
            raise BackendError(f"{path.name} is not an edgespec decoder graph (inputs: {', '.join(names[:4])})")
        self._n_layers = sum(1 for n in names if n.startswith("past_key_"))
        self._append = any(o.name == "new_key_0" for o in self._sess.get_outputs())
        kv = self._sess.get_inputs()[2].shape  # present: (1, kvh, P, hd); append: (1, P, kvh, hd)
        self._kv_heads, self._head_dim = (int(kv[2]), int(kv[3])) if self._append else (int(kv[1]), int(kv[3]))
        vocab = self._sess.get_outputs()[0].shape[2]  # (1, n_logits, vocab or hidden)
        if not isinstance(vocab, int):
            raise BackendError(f"{path.name} is not an edgespec decoder graph (no fixed vocabulary size)")
        self.vocab_size = vocab
        self._weight_bytes = _file_bytes(path)
        self.kv_bytes_per_token = 2 * self._n_layers * self._kv_heads * self._head_dim * 4
        self._n_past = 0
        self._past: list = []
        self._pad = int(pad_rows and self._append)  # rows added to every forward
        if self._append:
            self.kv_capacity = int(kv_capacity or DEFAULT_KV_CAPACITY)
            # the padding row's K/V lands one slot past the sequence: room for it at capacity
            shape = (self.kv_capacity + self._pad, self._kv_heads, self._head_dim)
            # zeroed pages are committed as they are written: RSS follows the context actually used
            self._kv = [np.zeros(shape, dtype=np.float32) for _ in range(2 * self._n_layers)]
            self._logits = np.zeros((_LOGIT_ROWS, vocab), dtype=np.float32)
            self._ids = np.zeros((1, self.kv_capacity + self._pad), dtype=np.int64)
            self._n_logits = np.zeros(1, dtype=np.int64)
            self._binding = self._sess.io_binding()
        else:
            logger.info("%s uses the old growing KV layout; export the bundle again for fixed KV buffers", path.name)
            self.kv_capacity = kv_capacity  # enforced as a limit only
        self.capabilities = Capabilities(backend="onnxruntime", can_trim=True, devices=("CPU",),
                                         fixed_kv=self._append, extra={"pad_rows": bool(self._pad)})
        self.reset()

    @staticmethod
    def _open(ort, path: Path, threads: int | None, spin: bool, initializers: dict):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        if not spin:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        for name, value in initializers.items():
            opts.add_initializer(name, value)
        try:
            return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types; keep one line
            raise BackendError(f"cannot load {path.name}: {str(e).splitlines()[0]}") from e

    @property
    def n_past(self) -> int:
        return self._n_past

    def reset(self) -> None:
        if not self._append:
            empty = np.zeros((1, self._kv_heads, 0, self._head_dim), dtype=np.float32)
            self._past = [self._ort.OrtValue.ortvalue_from_numpy(empty) for _ in range(2 * self._n_layers)]
        self._n_past = 0

    def forward(self, token_ids: Sequence[int], n_logits: int = 1) -> np.ndarray:
        if not token_ids:
            raise ValueError("forward needs at least one token")
        n_logits = min(n_logits, len(token_ids))
        if self.kv_capacity is not None and self._n_past + len(token_ids) > self.kv_capacity:
            raise ContextFullError(f"the context is full: {self._n_past} + {len(token_ids)} positions exceed "
                                   f"the KV capacity of {self.kv_capacity}")
        if self._append:
            return self._forward_fixed(token_ids, n_logits)
        return self._forward_growing(token_ids, n_logits)

    def _forward_fixed(self, token_ids: Sequence[int], n_logits: int) -> np.ndarray:
        p, real = self._n_past, len(token_ids)
        # with padding, the graph also returns the padding row's logits (it returns the last rows)
        s, rows = real + self._pad, n_logits + self._pad
        if rows > len(self._logits):  # a wider verify than planned: grow once, keep it
            self._logits = np.zeros((rows, self.vocab_size), dtype=np.float32)
        b, f32, i64 = self._binding, np.float32, np.int64
        ids = self._ids[:, :s]
        ids[0, :real] = token_ids
        ids[0, real:] = token_ids[-1]
        self._n_logits[0] = rows
        b.bind_input("input_ids", "cpu", 0, i64, [1, s], ids.ctypes.data)
        b.bind_input("n_logits", "cpu", 0, i64, [1], self._n_logits.ctypes.data)
        row = self._kv_heads * self._head_dim * 4
        for i, (kind, buf) in enumerate(zip(("key", "value") * self._n_layers, self._kv)):
            j, base = i // 2, buf.ctypes.data
            b.bind_input(f"past_{kind}_{j}", "cpu", 0, f32, [1, p, self._kv_heads, self._head_dim], base)
            b.bind_output(f"new_{kind}_{j}", "cpu", 0, f32, [1, s, self._kv_heads, self._head_dim], base + p * row)
        b.bind_output(self._output, "cpu", 0, f32, [1, rows, self.vocab_size], self._logits.ctypes.data)
        self._sess.run_with_iobinding(b)
        self._n_past = p + real
        return self._logits[:n_logits]

    def _forward_growing(self, token_ids: Sequence[int], n_logits: int) -> np.ndarray:
        binding = self._sess.io_binding()
        binding.bind_cpu_input("input_ids", np.asarray([token_ids], dtype=np.int64))
        binding.bind_cpu_input("n_logits", np.asarray([n_logits], dtype=np.int64))
        for j in range(self._n_layers):
            binding.bind_ortvalue_input(f"past_key_{j}", self._past[2 * j])
            binding.bind_ortvalue_input(f"past_value_{j}", self._past[2 * j + 1])
        binding.bind_output(self._output)
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
        if self._append:  # rows past n_past are simply overwritten by the next forward
            self._n_past = n_past
            return
        OrtValue = self._ort.OrtValue
        # copy: with one KV head the slice is contiguous, and a view would outlive the buffer it
        # points into once the OrtValue that owns it is dropped (garbage after a second trim)
        self._past = [OrtValue.ortvalue_from_numpy(v.numpy()[:, :, :n_past].copy()) for v in self._past]
        self._n_past = n_past

    def probe_scratch(self, n_new: int, n_ctx: int) -> bool:
        if not self._append or n_new < 1 or n_ctx > self.kv_capacity:
            return False
        # the buffers' prefix stands in for a cached context: its contents do not matter here
        self._n_past = max(0, n_ctx - n_new)
        try:
            self._forward_fixed([0] * min(n_new, n_ctx), 1)
        finally:
            self.reset()
        return True

    def model_sizes(self) -> dict[str, int]:
        meta = self._sess.get_modelmeta().custom_metadata_map if self._sess is not None else {}
        keys = ("hidden_size", "n_heads", "intermediate_size")
        if not all(f"edgespec.{k}" in meta for k in keys):  # bundles exported before the sizes were recorded
            return {}
        hidden, heads, inter = (int(meta[f"edgespec.{k}"]) for k in keys)
        return {"hidden": hidden, "n_heads": heads, "intermediate": inter, "n_layers": self._n_layers,
                "n_kv_heads": self._kv_heads, "head_dim": self._head_dim, "vocab": self.vocab_size}

    def mapped_weight_bytes(self) -> int:
        """Bytes of weight files this runtime maps that may become resident after load (memory
        planning adds them to what the load allocated): none whole. onnxruntime reads the weights
        into its own memory, and the Gather tables mapped here come back a page per distinct token."""
        return 0

    def kv_buffers(self) -> list[np.ndarray]:
        """The preallocated K/V arrays (empty for the growing layout): for tests and reports."""
        return list(self._kv) if self._append else []

    def memory_bytes(self) -> dict[str, int]:
        if self._append:
            return {"weights": self._weight_bytes, "kv": sum(a.nbytes for a in self._kv),
                    "kv_used": self.kv_bytes_per_token * self._n_past, "logits": self._logits.nbytes}
        return {"weights": self._weight_bytes, "kv": self.kv_bytes_per_token * self._n_past}

    def close(self) -> None:
        self._past = []
        if self._append:
            self._binding = None
            self._kv = []
        self._sess = None
        self._initializers = {}


def _file_bytes(path: Path) -> int:
    data = [p for p in path.parent.glob(path.name + "*") if p.is_file()]
    return sum(p.stat().st_size for p in data)
