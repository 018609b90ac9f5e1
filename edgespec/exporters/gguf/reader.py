"""Opening a GGUF safely: its layout checked against its size first (models/gguf_layout.py),
then its header read into a `GGUFFile`; metadata values read with one-line errors. A LazyTensor
stands for a tensor whose bytes stay in the file, for exports that copy GGUF tensors rather than
read them.

Why not gguf-py's GGUFReader: it keeps every item of every metadata array as numpy views of its
memory map, two per string, and Gemma 3's 262k-token vocabulary made that about two million
objects and 0.7 GB (the most memory the first run of `edgespec chat` took). `GGUFFile` reads the
same header into plain values (strings as bytes, decoded when asked for; numeric arrays as one
numpy array each) and offers the part of GGUFReader's surface the exporters use: `fields` (each
with `types` and `contents()`), `tensors` (name, tensor_type, shape, n_elements, n_bytes,
data_offset, data) and `data`, the file's memory map.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from dataclasses import field as dc_field
from functools import cached_property
from pathlib import Path

import numpy as np

from ...errors import ExportError

__all__ = ["GGUFFile", "GGUFField", "GGUFTensor", "LazyTensor", "check_layout", "field", "lazy_tensor", "open_gguf",
           "read_span"]

# GGUFValueType -> struct format of a scalar; 8 is a string, 9 an array (the GGUF specification)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml types gguf-py hands out as typed arrays; every other type is raw bytes, a row per last dim
_TYPED = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GGUFField:
    """One metadata value: `types` as gguf-py lists them ([ARRAY, item type] for an array), the
    value as read (strings as bytes, numeric arrays as numpy arrays)."""

    types: list
    value: object

    def contents(self):
        """The value as gguf-py's ReaderField.contents() gives it: str, a Python number, or a list
        (arrays of arrays flattened, as gguf-py does)."""
        if isinstance(self.value, list):
            return [_plain(v) for v in _leaves(self.value)]
        return _plain(self.value)


def _leaves(items: list):
    for v in items:
        if isinstance(v, list):
            yield from _leaves(v)
        elif isinstance(v, np.ndarray):
            yield from v.tolist()
        else:
            yield v


def _plain(value):
    if isinstance(value, bytes):
        return value.decode("utf-8")  # UnicodeDecodeError, as gguf-py: field() makes it one line
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's info, and its data as a view of the file's memory map (nothing read until used)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: the row length first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    _file: GGUFFile = dc_field(repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        """The bytes (float and integer types: typed values) in numpy order, as gguf-py gives them."""
        np_dims = tuple(int(d) for d in reversed(self.shape.tolist()))
        typed = _TYPED.get(int(self.tensor_type))
        raw = self._file.data[self.data_offset:self.data_offset + self.n_bytes]
        if typed is None:
            per, nbytes = _block(int(self.tensor_type))
            return raw.reshape(*np_dims[:-1], np_dims[-1] // per * nbytes)
        return raw.view(np.dtype(typed).newbyteorder(self._file.order)).reshape(np_dims)


def _block(qtype: int) -> tuple[int, int]:
    from ...models.gguf_layout import GGML_BLOCKS

    return GGML_BLOCKS[qtype]


class GGUFFile:
    """A GGUF's header (metadata and tensor infos), read once from a file whose layout
    check_layout has already bounded; tensor data stays in the file (`data`, a memory map)."""

    def __init__(self, path: Path, header_bytes: int) -> None:
        from gguf import GGMLQuantizationType, GGUFValueType

        self.path = Path(path)
        self._value_type, self._qtype = GGUFValueType, GGMLQuantizationType
        with self.path.open("rb") as fh:
            self._buf = fh.read(header_bytes)
        self.order = ">" if struct.unpack_from("<I", self._buf, 4)[0] & 0xFFFF == 0 else "<"
        self.pos = 8
        n_tensors, n_kv = self._take("Q"), self._take("Q")
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_kv):
            key = self._string().decode("utf-8", errors="replace")
            kind = self._take("I")
            types, value = self._value(kind)
            self.fields[key] = GGUFField(types, value)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = self.fields.get("general.alignment")
        alignment = int(align.value) if align is not None else 32
        start = -(-self.pos // alignment) * alignment
        self.tensors = self._tensors(infos, start)
        del self._buf

    @cached_property
    def data(self) -> np.ndarray:
        """The whole file, memory-mapped read-only (pages are read as tensors' data are touched)."""
        return np.memmap(self.path, mode="r")

    def _take(self, fmt: str):
        value = struct.unpack_from(self.order + fmt, self._buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value[0]

    def _string(self) -> bytes:
        n = self._take("Q")
        self.pos += n
        return self._buf[self.pos - n:self.pos]

    def _value(self, kind: int) -> tuple[list, object]:
        vt = self._value_type
        if kind in _SCALARS:
            return [vt(kind)], self._take(_SCALARS[kind])
        if kind == _STRING:
            return [vt(kind)], self._string()
        item, n = self._take("I"), self._take("Q")
        if item in _SCALARS:
            dtype = np.dtype(self.order + _SCALARS[item]) if item != 7 else np.dtype(np.bool_)
            arr = np.frombuffer(self._buf, dtype=dtype, count=n, offset=self.pos).copy()
            self.pos += arr.nbytes
            return [vt(kind), vt(item)], arr
        if item == _STRING:
            return [vt(kind), vt(item)], [self._string() for _ in range(n)]
        inner = [self._value(item) for _ in range(n)]  # arrays of arrays (no writer nests deeper)
        return [vt(kind), *(inner[0][0] if inner else [vt(item)])], [v for _, v in inner]

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string().decode("utf-8", errors="replace")
        n_dims = self._take("I")
        dims = [self._take("Q") for _ in range(n_dims)]
        return name, dims, self._take("I"), self._take("Q")

    def _tensors(self, infos, start: int) -> list[GGUFTensor]:
        out, seen = [], set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ExportError(f"the GGUF has two tensors named {name[:80]}")
            seen.add(name)
            per, nbytes = _block(kind)
            n = int(np.prod(dims, dtype=np.int64))
            out.append(GGUFTensor(name, self._qtype(kind), np.array(dims, dtype=np.uint64), n, n // per * nbytes,
                                  start + offset, self))
        return out



@dataclass(frozen=True)
class LazyTensor:
    """A GGUF tensor's name, type and shape (numpy order), its bytes left unread in the file, so a
    model of any block type can be described without decoding it. Indexing rows (read_gguf's
    q/k reordering, fused-weight splits) gives another LazyTensor of those rows' shape."""

    name: str
    qtype: int
    shape: tuple[int, ...]

    def __getitem__(self, rows) -> LazyTensor:
        n = len(np.arange(self.shape[0])[rows])
        return LazyTensor(self.name, self.qtype, (n, *self.shape[1:]))


def lazy_tensor(raw, qtype, shape: tuple[int, ...], name: str) -> LazyTensor:
    """read_gguf's `load` for a model whose weights are copied from the file, never decoded."""
    return LazyTensor(name, int(qtype), tuple(int(x) for x in shape))


def field(reader, key: str, default=None):
    """The value of metadata `key` (`default` when absent); text that is not UTF-8 is a one-line
    ExportError (gguf-py decodes strings only when asked for them)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise ExportError(f"the GGUF's '{key}' holds text that is not UTF-8") from None


def check_layout(path: Path):
    """Every count and size of the GGUF's header checked against the file's size (a one-line
    ExportError), before any reader opens the file: a reader that iterates whatever an array claims
    (2^40 entries: a hang) or trusts tensor sizes is safe after it. Returns the layout
    (models/gguf_layout.GGUFLayout)."""
    from ...models.gguf_layout import GGUFLayoutError, check_gguf_layout

    try:
        return check_gguf_layout(path)
    except GGUFLayoutError as e:
        raise ExportError(f"cannot read {path.name}: {e}") from None
    except (OSError, ValueError) as e:  # unreadable, or empty (mmap refuses a 0-byte file)
        raise ExportError(f"cannot read {path.name}: {getattr(e, 'strerror', None) or e}") from None


def open_gguf(path: Path) -> GGUFFile:
    """The header of the GGUF at `path` (open it once: it reads every metadata string)."""
    try:
        import gguf  # noqa: F401 - its enums name the types
    except ImportError as e:
        raise ExportError("reading a GGUF needs gguf-py: pip install 'edgespec[onnx]'") from e
    layout = check_layout(path)
    try:
        return GGUFFile(path, layout.data_offset)
    except (ValueError, KeyError, struct.error) as e:  # a type no enum knows, a damaged string
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"cannot read {path.name}: {msg}") from e


def read_span(fh, offset: int, nbytes: int, what: str) -> np.ndarray:
    """`nbytes` of the open file `fh` from `offset`, as a uint8 array of their own (not a memory
    map, so they leave the process with the array). Read into the array rather than through
    `np.fromfile`: a signal's exception raised inside numpy's check of whether `fh` is a path makes
    it take the file object for one, and the process unwinds with a TypeError instead."""
    fh.seek(offset)
    raw = np.empty(nbytes, dtype=np.uint8)
    if fh.readinto(memoryview(raw)) != nbytes:
        raise ExportError(f"the GGUF ends inside tensor {what}")
    return raw
