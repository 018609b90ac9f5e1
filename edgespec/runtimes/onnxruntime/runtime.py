"""onnxruntime backend for edgespec's decoder graphs (see exporters/onnx/graph.py).

`OnnxRuntime` opens one graph in an InferenceSession on the CPU; how its KV cache is held is a
holder of runtimes/onnxruntime/kv.py, chosen once from the graph's inputs and outputs (`plan_kv`): fixed
buffers written in place through IOBinding (the "append" layout: no per-token allocation, no copy, a
rollback lowers a counter). A graph of the first exporter's growing layout is refused with the fix.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...checks import integer, one_of
from ...errors import BackendError
from ..base import Capabilities, Runtime, Streamed
from ..heap import drop_file_pages, trim_heap
from .graphs import (
    HIDDEN,
    LOGITS,
    MappedTables,
    body_model,
    fused_model,
    gathered_tables,
    ort_values,
    session,
    session_options,
    streamed_of,
)
from .graphs import import_ort as _import_ort
from .kv import DEFAULT_KV_CAPACITY, TreeRows, graph_io, plan_kv

__all__ = ["OnnxRuntime", "available_devices", "DEFAULT_KV_CAPACITY", "OUTPUTS"]

logger = logging.getLogger(__name__)

# what a forward returns: logits, or the final hidden rows the head would read (a body whose
# head runs apart, runtimes/onnxruntime/split.py)
OUTPUTS = (LOGITS, HIDDEN)


def available_devices() -> list[str]:
    """edgespec runs onnxruntime on the CPU execution provider only."""
    return ["CPU"]


def _check_options(device: str | None, kv_dtype: str | None, kv_dtypes: tuple[str, ...], kv_capacity: int | None,
                   output: str) -> None:
    if device not in (None, "CPU", "cpu"):
        raise BackendError(f"onnxruntime: device '{device}' is not available (available: "
                           f"{', '.join(available_devices())})")
    if kv_dtype not in (None, *kv_dtypes):
        raise BackendError(f"onnxruntime: KV dtype {kv_dtype!r} is not available (available: "
                           f"{', '.join(kv_dtypes)})")
    if kv_capacity is not None:
        integer(kv_capacity, "kv_capacity", least=1, error=BackendError)
    one_of(output, "onnxruntime: output", OUTPUTS, error=BackendError)


def _open_session(ort, path: Path, threads: int | None, spin: bool, output: str,
                  initializers: dict | None) -> tuple[object, dict]:
    """(session, initializers it reads): the body cut before its head for output="hidden", with the
    given initializers (a tied table the head's session holds too); else the whole graph."""
    if output == HIDDEN:
        values = dict(initializers or {})
        return session(body_model(path), path.parent, threads=threads, spin=spin, initializers=values), values
    return _open_fused(ort, path, threads, spin)


def _open_fused(ort, path: Path, threads: int | None, spin: bool) -> tuple[object, dict]:
    """(session, initializers it reads) of the whole graph, its head's product written straight
    into the bound logits (onnxruntime/graphs.fused_model). The tables a Gather reads rows of are mapped
    from the file and let go once loaded (a tied head prepacks its own copy): only the rows of the
    tokens seen are then resident."""
    model = fused_model(path)  # the graph alone, read without the `onnx` package (runtimes/onnxruntime/wire.py)
    tables = MappedTables(model, path.parent, gathered_tables(model))
    values = ort_values(tables.arrays)
    sess = _session(ort, path, model, threads, spin, values)
    tables.drop_pages()
    return sess, values


def _session(ort, path: Path, model, threads: int | None, spin: bool, initializers: dict):
    """A session of `model` (read from `path`, maybe rewritten) whose external data lies next to `path`."""
    opts = session_options(threads, spin)
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    for name, value in initializers.items():
        opts.add_initializer(name, value)
    try:
        return ort.InferenceSession(model.to_bytes(), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types; keep one line
        raise BackendError(f"cannot load {path.name}: {str(e).splitlines()[0]}") from e


def _output_width(sess, name: str) -> int:
    width = sess.get_outputs()[0].shape[2]  # (1, n_logits, vocab or hidden)
    if not isinstance(width, int):
        raise BackendError(f"{name} is not an edgespec decoder graph (no fixed vocabulary size)")
    return width


class OnnxRuntime(Runtime):
    """One edgespec decoder graph in an onnxruntime InferenceSession, with its KV holder (kv.py)."""

    # its KV buffers commit memory only as they fill (and sliding layers' are window-sized), so an
    # engine may give it the model's trained context by default (engine/assembly.py)
    lazy_kv = True

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None, device: str | None = None,
                 kv_capacity: int | None = None, kv_dtype: str | None = None, spin: bool = True,
                 pad_rows: bool = False, output: str = "logits", initializers: dict | None = None) -> None:
        """spin: idle intra-op threads spin-wait for the next run (onnxruntime's default). A session
        that alternates with another model's forwards (a draft and its target) should not: its
        spinning threads hold the cores the other needs (speculative decoding is faster without;
        a plain decode alone is slower). Where the process allows
        onnxruntime's process-wide pool (runtimes/onnxruntime/pool.py), every session runs on it and
        spins, and `spin` and `threads` no longer apply.
        pad_rows: compute every forward one row wider (its last token again) and drop that row, so
        no MatMul multiplies one row: the exact mode where a one-row kernel rounds unlike a taller
        one (MatMulNBits with int8 activations does, by whole logits), chosen by the exactness
        probe (runtimes/exactness.py). The fixed-buffer layout only; a decode then costs a
        two-row forward.
        output: "logits", or "hidden": the graph cut before its head (runtimes/onnxruntime/split.py),
        whose forward returns final hidden rows (n_logits, hidden) instead of logits: the body a
        draft shares with its target. initializers: name -> OrtValue the session uses instead of
        the file's (a tied table the head's session holds too); with output="hidden" only.

        The tables a Gather reads (the input embedding) are mapped from the file, not loaded: a
        forward reads the rows of its tokens, and a tied head prepacks its own copy at load, so
        the rest of the table never stays resident (on Gemma 3 270M the embedding is most of the
        weights)."""
        ort = _import_ort()
        _check_options(device, kv_dtype, self.kv_dtypes, kv_capacity, output)
        path = Path(model_path)
        if not path.is_file():
            raise BackendError(f"ONNX model not found: {path}")
        trim_heap()  # what earlier loads freed (a tokenizer's parse) goes back first: a lower peak
        self.spin, self.output, self._path = spin, output, path
        # the initializers (OrtValues the session reads) are kept alive as long as it
        self._sess, self._initializers = _open_session(ort, path, threads, spin, output, initializers)
        trim_heap()  # onnxruntime's freed read buffers of the external weights
        drop_file_pages(_data_files(path))  # what loading read of the weights onnxruntime keeps mapped
        # named with its folder: a bundle's target/ and draft/ hold a model.onnx each
        plan = plan_kv(*graph_io(self._sess), capacity=kv_capacity, pad_rows=pad_rows,
                       name="/".join(path.parts[-2:]), meta=self._sess.get_modelmeta().custom_metadata_map)
        self.vocab_size = _output_width(self._sess, path.name)
        self.kv = plan.kind(plan, self._sess, ort, output, self.vocab_size)
        self._weight_bytes = _file_bytes(path)
        self.kv_bytes_per_token, self.kv_capacity = plan.layout.bytes_per_token, plan.capacity
        # (share of kv_bytes_per_token on window-sized buffers, rows they hold): the memory planner's
        # footprint counts those layers' KV once, not per position
        self.kv_sliding = plan.sliding_kv()
        self.capabilities = Capabilities(backend="onnxruntime", can_trim=True, devices=("CPU",),
                                         fixed_kv=plan.kind.fixed, trees=plan.tree and not plan.pad,
                                         extra={"pad_rows": bool(plan.pad)})

    @property
    def n_past(self) -> int:
        return self.kv.n_past

    @property
    def _logits(self) -> np.ndarray:
        """The fixed-buffer holder's reused output buffer (forward returns views of it)."""
        return self.kv.logits

    def reset(self) -> None:
        self.kv.reset()

    def forward(self, token_ids: Sequence[int], n_logits: int = 1) -> np.ndarray:
        if not token_ids:
            raise ValueError("forward needs at least one token")
        return self.kv.forward(token_ids, min(n_logits, len(token_ids)))

    def trim(self, n_past: int) -> None:
        self.kv.trim(n_past)

    def forward_tree(self, token_ids: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        if len(parents) != len(token_ids) or not token_ids:
            raise ValueError(f"need one parent per token, got {len(parents)} for {len(token_ids)}")
        return self.kv.forward(token_ids, len(token_ids), TreeRows.from_parents(parents))

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        self.kv.keep_rows(start, rows)

    def probe_scratch(self, n_new: int, n_ctx: int) -> bool:
        return self.kv.probe(n_new, n_ctx)

    def model_sizes(self) -> dict[str, int]:
        meta = self._sess.get_modelmeta().custom_metadata_map if self._sess is not None else {}
        keys = ("hidden_size", "n_heads", "intermediate_size")
        if not all(f"edgespec.{k}" in meta for k in keys):  # bundles exported before the sizes were recorded
            return {}
        hidden, heads, inter = (int(meta[f"edgespec.{k}"]) for k in keys)
        lay = self.kv.plan.layout
        return {"hidden": hidden, "n_heads": heads, "intermediate": inter, "n_layers": lay.n_layers,
                "n_kv_heads": lay.kv_heads, "head_dim": lay.head_dim, "vocab": self.vocab_size}

    def streamed(self) -> Streamed:
        # the graph this session runs, read again without its weights (a fraction of a millisecond)
        return streamed_of(body_model(self._path) if self.output == HIDDEN else fused_model(self._path))

    def mapped_weight_bytes(self) -> int:
        """Bytes of weight files this runtime maps that may become resident after load (memory
        planning adds them to what the load allocated): none whole. onnxruntime reads the weights
        into its own memory, and the Gather tables mapped here come back a page per distinct token."""
        return 0

    def kv_buffers(self) -> list[np.ndarray]:
        """The preallocated K/V arrays: for tests and reports."""
        return self.kv.buffers()

    def memory_bytes(self) -> dict[str, int]:
        return {"weights": self._weight_bytes, **self.kv.memory()}

    def close(self) -> None:
        self.kv.close()
        self._sess = None
        self._initializers = {}


def _data_files(path: Path) -> list[Path]:
    """The model file and its external data files (exported as `<model>.onnx.data`)."""
    return [p for p in path.parent.glob(path.name + "*") if p.is_file()]


def _file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in _data_files(path))
