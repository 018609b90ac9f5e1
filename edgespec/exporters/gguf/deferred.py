"""GGUF tensors left in the file until a writer reads them: the export's memory is one tensor.

read_gguf used to transcode every tensor up front and hold the whole model while the writers ran;
with the ONNX writer streaming each initializer to its data file (onnx/external.py), that held
copy was the whole model twice over, and the first run of `edgespec chat` peaked far above what a
1 GB board has. Here a matrix is a `Deferred`: where its bytes lie in the file, its block
type and shape, and which of its rows a consumer wants (q/k reordering, fused-weight splits, a
VocabTrim head). `LazyTensors` maps transformers' names to them and transcodes one when it is
read, from the file (never through the reader's memory map, whose touched pages would stay in the
process's resident set), in row chunks, so a read costs the tensor's transcoded size and a chunk.
Nothing is cached: a writer that reads a tensor twice (a tied embedding) transcodes it twice.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ...errors import ExportError
from .reader import read_span
from .transcode import BlockWeight, check_transcodable, quant_type_name, transcode

__all__ = ["Deferred", "LazyTensors", "CHUNK_BYTES", "deferring", "pick_rows", "shallow_copy"]

# GGUF bytes transcoded at a time: a chunk's scratch (decoded codes, float scales) is a few times this
CHUNK_BYTES = 8 << 20
_FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16}


@dataclass(frozen=True)
class Deferred:
    """A 2-D GGUF tensor in `path` at `offset` (`nbytes` long, `shape` in numpy order, rows first),
    transcoded when `load`ed. `index`: the rows kept, in their new order (None: all, in order)."""

    path: Path
    offset: int
    nbytes: int
    qtype: int
    shape_in_file: tuple[int, ...]
    name: str
    index: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        rows = self.shape_in_file[0] if self.index is None else len(self.index)
        return (rows, *self.shape_in_file[1:])

    def rows(self, index) -> Deferred:
        """Rows `index` of this tensor (as BlockWeight.rows and numpy indexing give them)."""
        picked = np.arange(self.shape[0])[index]
        base = picked if self.index is None else self.index[picked]
        return replace(self, index=np.asarray(base, dtype=np.int64))

    __getitem__ = rows

    def loaded_bytes(self) -> int:
        """Bytes the tensor takes once loaded: one row transcoded, times the rows."""
        one = self.rows([0]).load()
        return one.nbytes * self.shape[0]

    def load(self, chunk_bytes: int = CHUNK_BYTES) -> BlockWeight | np.ndarray:
        """The tensor transcoded (gguf/transcode.transcode), its wanted rows only, read about
        `chunk_bytes` of the file at a time (at least a row)."""
        n_rows = self.shape_in_file[0]
        row_bytes = self.nbytes // n_rows
        wanted = np.arange(n_rows) if self.index is None else self.index
        order = np.argsort(wanted, kind="stable")  # read the file front to back
        ranked = wanted[order]
        step = max(1, chunk_bytes // max(row_bytes, 1))
        out, i = None, 0
        with self.path.open("rb") as fh:
            while i < len(order):
                # the wanted rows within `step` rows of the file from here: one read of at most a chunk,
                # however sparse the rows are (a trimmed head keeps one row in sixteen)
                j = int(np.searchsorted(ranked, ranked[i] + step, side="left"))
                out = _place(out, self._read_rows(fh, ranked[i:j], row_bytes), order[i:j], len(wanted))
                i = j
        return out

    def _read_rows(self, fh, rows: np.ndarray, row_bytes: int) -> BlockWeight | np.ndarray:
        """Rows `rows` (ascending) transcoded: one read spanning them, the others dropped."""
        first, last = int(rows[0]), int(rows[-1])
        span = last - first + 1
        raw = read_span(fh, self.offset + first * row_bytes, span * row_bytes, self.name).reshape(span, row_bytes)
        if span != len(rows):
            raw = raw[rows - first]
        raw = np.ascontiguousarray(raw).reshape(-1)
        view = _FLOAT_VIEWS.get(quant_type_name(self.qtype))  # float types come typed from gguf's reader
        return transcode(raw if view is None else raw.view(view), self.qtype, (len(rows), *self.shape_in_file[1:]),
                         self.name)


def _place(out, part, at: np.ndarray, n: int):
    """Write transcoded rows `part` at output rows `at` of `out` (allocated from the first part)."""
    if isinstance(part, np.ndarray):
        if out is None:
            out = np.empty((n, *part.shape[1:]), dtype=part.dtype)
        out[at] = part
        return out
    fields = ("codes", "scales", "zero_points", "mins")
    if out is None:
        out = replace(part, **{f: None if getattr(part, f) is None else
                               np.empty((n, *getattr(part, f).shape[1:]), getattr(part, f).dtype) for f in fields})
    for f in fields:
        if getattr(part, f) is not None:
            getattr(out, f)[at] = getattr(part, f)
    return out


def deferring(path: Path, reader):
    """read_gguf's `load` that leaves matrices in `path` (Deferred) and transcodes the rest now.
    Offsets are those of the reader's memory-mapped views into the file (`raw`), never read here."""
    base = reader.data.__array_interface__["data"][0]

    def load(raw, qtype, shape: tuple[int, ...], name: str):
        raw = np.asarray(raw)
        if len(shape) != 2:  # norms and biases, decoded now: read_gguf adjusts some (Gemma's norm offsets)
            return transcode(raw, qtype, shape, name)
        check_transcodable(qtype, shape, name)  # a type or shape it cannot take fails now, not when read
        if raw.nbytes % shape[0]:
            raise ExportError(f"tensor {name}: {raw.nbytes} bytes do not split into {shape[0]} rows")
        offset = raw.__array_interface__["data"][0] - base
        return Deferred(Path(path), int(offset), int(raw.nbytes), int(qtype), tuple(int(x) for x in shape), name)
    return load


class LazyTensors(MutableMapping):
    """name -> BlockWeight or float array, as GGUFModel.tensors was, with Deferred tensors
    transcoded each time they are read. `copy.copy` copies the mapping, not the tensors."""

    def __init__(self, store: dict, post: Callable | None = None) -> None:
        self._store = store
        self._post = post  # applied to every tensor as it is read (mapped)

    def __getitem__(self, key: str):
        value = self._store[key]
        value = value.load() if isinstance(value, Deferred) else value
        return value if self._post is None else self._post(value)

    def mapped(self, post: Callable) -> LazyTensors:
        """The same tensors, each passed through `post` as it is read (after this mapping's own)."""
        first = self._post
        return LazyTensors(dict(self._store), post if first is None else lambda v: post(first(v)))

    def __setitem__(self, key: str, value) -> None:
        self._store[key] = value

    def __delitem__(self, key: str) -> None:
        del self._store[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._store)

    def __len__(self) -> int:
        return len(self._store)

    def __copy__(self) -> LazyTensors:
        return LazyTensors(dict(self._store), self._post)

    def in_file(self, key: str) -> bool:
        """Whether tensor `key` is left in the file (read, and transcoded, each time it is asked for)."""
        return isinstance(self._store[key], Deferred)

    def largest_bytes(self) -> int:
        """The most bytes one tensor left in the file takes once read (0: none is left there)."""
        return max((v.loaded_bytes() for v in self._store.values() if isinstance(v, Deferred)), default=0)

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape, nothing read."""
        return tuple(self._store[key].shape)

    def rows(self, key: str, index) -> BlockWeight | np.ndarray:
        """Rows `index` of a tensor, only those read from the file (a trimmed head)."""
        value = self._store[key]
        if isinstance(value, Deferred):
            value = value.rows(index).load()
        elif isinstance(value, BlockWeight):
            value = value.rows(index)
        else:
            value = value[np.asarray(index)]
        return value if self._post is None else self._post(value)


def pick_rows(weights, key: str, index):
    """Rows `index` of weights[key]: from the file alone where `weights` is a LazyTensors."""
    if isinstance(weights, LazyTensors):
        return weights.rows(key, index)
    value = weights[key]
    return value.rows(index) if isinstance(value, BlockWeight) else value[np.asarray(index)]


def shallow_copy(weights):
    """A copy of a weights mapping to add and remove names in, the tensors themselves not read."""
    return copy.copy(weights) if isinstance(weights, LazyTensors) else dict(weights)
