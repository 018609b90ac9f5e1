"""An edgespec ONNX decoder split at its final hidden state, for a draft on the target's body.

The exporter (exporters/onnx/graph.py) ends every decoder graph the same way, in every bundle
written so far (fp32, fp16, int8 quantized, GGUF-transcoded MatMulNBits; the append KV layout):
the final norm, `Slice(x, -n_logits)` (the rows that reach the head), then the head
(Reshape, MatMul / Gemm / MatMulNBits, an optional softcap) into `logits`. Cutting at that Slice's
output (runtimes/onnxruntime/graphs.py) gives
  - the body: the graph with `hidden` (1, N, hidden) as its first output instead of `logits`
    (runtimes/onnxruntime/runtime.py opens it with `output="hidden"`), and
  - a head: the nodes from the Slice's output to `logits`, alone (`OnnxHead`).
Both are rebuilt at load from the bundle's own .onnx (no file is written): the protos are read
without their external data, and onnxruntime reads each session's weights from the bundle's
folder (`session.model_external_initializers_file_folder_path`).

A tied head (the input embedding's table, also the target's head: a Gather and a Gemm, or a
GatherBlockQuantized-style Gather and a MatMulNBits on the same GGUF blocks) is mapped from the
file once and handed to both sessions with `SessionOptions.add_initializer`, so the table is in
memory once, as in the fused graph (each session still prepacks what its kernels prepack there).

`open_shared_pair` joins the target's body to the target's head and to the draft's (VocabTrim)
head through runtimes/shared_body.py; the draft's body and KV cache are never loaded. With
`draft_head` (a bundle's trained head, training/draft_head.py), the draft also holds that head
(`OnnxFeatureHead`), which decoding/head_drafter.py runs instead of the body.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ...errors import BackendError
from ..base import Streamed
from ..heap import lazy_zeros, trim_heap
from ..shared_body import SharedBodyRuntime, check_feature_head, check_heads, shared_pair
from .graphs import (
    HIDDEN,
    LOGITS,
    MappedTables,
    OnnxModel,
    body_model,
    gathered_tables,
    head_model,
    initializer_bytes,
    load_proto,
    ort_values,
    session,
    shared_names,
    streamed_of,
)
from .head_rows import HeadRows, head_rows
from .kv import F32, RawBinding, kv_kind
from .runtime import OnnxRuntime

__all__ = ["OnnxFeatureHead", "OnnxHead", "open_shared_pair"]

logger = logging.getLogger(__name__)

# rows a head's buffers hold from the start (a verify of up to HEAD_ROWS - 1 drafts); only the
# rows written are committed
HEAD_ROWS = 16


class OnnxHead:
    """`head(hidden)`: logits (R, V) of hidden rows (R, H), a view valid until the next call.

    The head's rows do not depend on how many rows share its call (a MatMul, Gemm or MatMulNBits
    per row) except where a one-row kernel rounds unlike a taller one: `pad_rows` then multiplies
    a lone row twice, as the fused graph's padded mode does (runtimes/onnxruntime/runtime.py)."""

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None, pad_rows: bool = False,
                 initializers: dict | None = None, in_body: bool = False, source: OnnxModel | None = None) -> None:
        """initializers: name -> OrtValue shared with the body's session (a tied table).
        source: the file's model already read (load_proto), not read again.
        in_body: the file is also loaded as the body, which reports it whole, so this head reports
        no weights of its own (the memory report would count them twice)."""
        path = Path(model_path)
        model = head_model(path if source is None else source)
        self._values = dict(initializers or {})  # kept alive as long as the session
        self._sess = session(model, path.parent, threads=threads, spin=False, initializers=self._values)
        out = self._sess.get_outputs()[0].shape  # (1, N, V)
        if not isinstance(out[2], int):
            raise BackendError(f"{path.name}'s head has no fixed vocabulary size")
        self.vocab_size = int(out[2])
        self.hidden_size = int(self._sess.get_inputs()[0].shape[2])
        shared = {t.name for t in model.initializers} & set(self._values)
        self.weight_bytes = 0 if in_body else initializer_bytes(model, exclude=shared)
        self._streamed = streamed_of(model)
        self.pad_rows = pad_rows
        self._in, self._out = self._buffers(HEAD_ROWS)
        self._binding = RawBinding(self._sess)
        self._bound = (0, 0)  # (rows, input address) bound: a call binds again only when they change

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        rows = len(hidden)
        n = rows + int(self.pad_rows and rows == 1)
        if n > len(self._in):  # a wider read than before: grow once, keep it
            self._in, self._out = self._buffers(max(n, 2 * len(self._in)))
        x = self._in[:n]
        x[:rows] = hidden
        x[rows:] = hidden[-1]
        b = self._binding
        if (n, self._in.ctypes.data) != self._bound:
            b.bind_input(HIDDEN, b.device, F32, [1, n, self.hidden_size], self._in.ctypes.data)
            b.bind_output(LOGITS, b.device, F32, [1, n, self.vocab_size], self._out.ctypes.data)
            self._bound = (n, self._in.ctypes.data)
        b.run()
        return self._out[:rows]

    def streamed(self) -> Streamed:
        return self._streamed

    def _buffers(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Input and logits buffers of `rows` rows, committed a page at a time as rows are written
        (lazy_zeros) and given back whole when replaced: from glibc's heap, a grown buffer left its
        predecessor there as a free block (a MiB per row at Gemma 3's 262,144 logits)."""
        return lazy_zeros((rows, self.hidden_size)), lazy_zeros((rows, self.vocab_size))

    def close(self) -> None:
        self._binding = None
        self._sess = None
        self._values = {}


class OnnxFeatureHead:
    """A trained draft head's session (training/draft_head.py): `head(hidden, tokens)` -> the
    next features (R, H) of hidden rows (R, H) and draft-vocabulary token indices (R,)."""

    def __init__(self, model_path: str | os.PathLike, *, threads: int | None = None) -> None:
        path = Path(model_path)
        model = load_proto(path)
        self._sess = session(model, path.parent, threads=threads, spin=False, initializers={})
        self.hidden_size = int(self._sess.get_inputs()[0].shape[1])
        self.weight_bytes = initializer_bytes(model, exclude=set())

    def __call__(self, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        feed = {HIDDEN: np.ascontiguousarray(hidden, dtype=np.float32),
                "token": np.ascontiguousarray(tokens, dtype=np.int64)}
        return self._sess.run(None, feed)[0]

    def close(self) -> None:
        self._sess = None


def open_shared_pair(target_path: str | os.PathLike, draft_path: str | os.PathLike, *, threads: int | None = None,
                     device: str | None = None, kv_capacity: int | None = None, pad_rows: bool = False,
                     draft_head: str | os.PathLike | None = None, **kw) -> tuple[SharedBodyRuntime, SharedBodyRuntime]:
    """(target, draft): the target graph's body with its own head, and with the draft graph's head.
    The draft graph's body is never loaded. pad_rows: body and heads never multiply one row
    (OnnxRuntime), the exact mode where one-row kernels round apart. kw: OnnxRuntime's options
    (kv_dtype, spin). The body's threads do not spin-wait by default: its forwards alternate with
    the heads' runs, which need the cores (2 threads, lean default: a 4-draft step 1.1-1.9x
    faster without). draft_head: a trained head's .onnx, which the draft then holds."""
    trim_heap()  # what earlier loads freed (a tokenizer's parse) goes back first: a lower peak
    target_path, draft_path = Path(target_path), Path(draft_path)
    source = load_proto(target_path)  # read once, cut twice
    body_proto, head_proto = body_model(source), head_model(source)
    # the tied table (embedding and head) mapped once, handed to the head's and the body's sessions
    names = sorted({*shared_names(body_proto, head_proto), *gathered_tables(body_proto)})
    tables = MappedTables(body_proto, target_path.parent, names)
    tied = ort_values(tables.arrays)
    # the heads pad a lone row where the body's KV holder pads its forwards (runtimes/onnxruntime/kv.py),
    # so they multiply the rows the fused graph's head would; an old layout is refused here, before any session
    pad_rows = pad_rows and kv_kind([o.name for o in body_proto.outputs], "/".join(target_path.parts[-2:])).pads
    heads: list = []
    body = None
    try:
        # the head first: it prepacks its own copy of the table while the body's weights are not
        # loaded yet (the peak), then the table's pages go, and only gathered rows come back
        heads.append(OnnxHead(target_path, threads=threads, pad_rows=pad_rows, initializers=tied, in_body=True,
                              source=source))
        tables.drop_pages()
        body = OnnxRuntime(target_path, threads=threads, device=device, kv_capacity=kv_capacity, pad_rows=pad_rows,
                           output=HIDDEN, initializers=tied, **{"spin": False, **kw})
        heads.append(OnnxHead(draft_path, threads=threads, pad_rows=pad_rows))
        check_heads(heads[0], heads[1])
        if draft_head is not None:
            # one thread: a one-row pass over a small head gains nothing from a hand-off (it is
            # slower on two threads than on one)
            heads.append(OnnxFeatureHead(draft_head, threads=1))
            check_feature_head(heads[1], heads[2])
    except BaseException:
        for h in heads:
            h.close()
        if body is not None:
            body.close()
        raise
    trim_heap()  # the draft head's read buffers
    rows = _target_rows(head_proto, tables, target_path.parent, heads[0].hidden_size)
    return shared_pair(body, heads[0], heads[1], heads[2] if draft_head is not None else None, vocab_rows=rows)


def _target_rows(head_proto: OnnxModel, tables: MappedTables, folder: Path, hidden: int) -> HeadRows | None:
    """The target head's weight rows for any token (head_rows.py): from the tied table mapped for
    the sessions, or from the head's own tensors mapped here (their pages read only as rows are)."""
    own = [t.name for t in head_proto.initializers if t.name not in tables.arrays]
    mapped = MappedTables(head_proto, folder, own) if own else None
    if mapped is not None:
        mapped.drop_pages()
    arrays = {**tables.arrays, **(mapped.arrays if mapped is not None else {})}
    rows = head_rows(head_proto, arrays.get, hidden)
    if rows is None:
        logger.debug("the target's head has no plain weight rows: the draft keeps its trimmed vocabulary")
    return rows
