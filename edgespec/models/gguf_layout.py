"""A GGUF file's layout checked against its size before any reader trusts it.

gguf-py's GGUFReader iterates every array the header claims, element by element, and a slice past
the end of its memory map is merely short: a token-scores array claiming 2^40 entries keeps it
busy for days, a tensor claiming more bytes than the file has is found only when it is read. This
walk reads the header with every count and size bounded by the bytes that are left (an array of
N items needs at least N times its smallest item), so a hostile or truncated file is a one-line
error in time proportional to its size, and nothing is allocated from a count it claims.

Plain `struct` reads, no gguf-py: the runtimes (a llama.cpp draft's embedding file) and the
exporters check with the same code.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GGUFLayoutError", "GGUFLayout", "check_gguf_layout", "GGML_BLOCKS"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # what gguf-py and llama.cpp read
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 4  # arrays of arrays: no GGUF writer nests deeper than one level

# GGUFValueType -> struct format of a scalar; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# ggml type -> (elements per block, bytes per block), as gguf-py's GGML_QUANT_SIZES; types a file
# may name that no reader here handles are refused by the readers themselves
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}


class GGUFLayoutError(ValueError):
    """The file is not a GGUF whose header fits in it; the message is one line."""


@dataclass(frozen=True)
class GGUFLayout:
    version: int
    n_tensors: int
    n_kv: int
    data_offset: int
    size: int


class _Walk:
    """A cursor over the file that refuses any read past its end."""

    def __init__(self, buf, order: str) -> None:
        self.buf, self.order, self.pos, self.size = buf, order, 0, len(buf)

    def left(self) -> int:
        return self.size - self.pos

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        if n > self.left():
            raise GGUFLayoutError(f"the file ends inside its header (at byte {self.pos} of {self.size})")
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += n
        return value[0] if len(value) == 1 else value

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise GGUFLayoutError(f"{what} claims {n} bytes at byte {self.pos}, but the file has {self.left()} left")
        self.pos += n

    def string(self, what: str) -> bytes:
        n = self.take("Q")
        start = self.pos
        self.skip(n, what)
        return bytes(self.buf[start:self.pos])

    def count(self, n: int, min_item: int, what: str) -> int:
        """`n` items of at least `min_item` bytes each, refused when they cannot fit in what is left."""
        if n * min_item > self.left():
            raise GGUFLayoutError(f"{what} claims {n} entries, more than the {self.left()} bytes left in the file "
                                  "can hold")
        return n


def _key(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise GGUFLayoutError("a metadata key is not UTF-8 text") from None
    if not text.isprintable():  # a newline in a name must not break the one-line error
        text = repr(text)[1:-1]
    return text if len(text) <= 80 else text[:77] + "..."


def _value(w: _Walk, kind: int, what: str, depth: int = 0) -> object:
    """Skip one value of GGUFValueType `kind`; scalars are returned (general.alignment is read)."""
    if kind in _SCALARS:
        return w.take(_SCALARS[kind])
    if kind == _STRING:
        w.string(what)
        return None
    if kind != _ARRAY:
        raise GGUFLayoutError(f"{what} has an unknown value type {kind}")
    if depth >= _MAX_NESTING:
        raise GGUFLayoutError(f"{what} nests arrays more than {_MAX_NESTING} deep")
    item, n = w.take("I"), w.take("Q")
    if item in _SCALARS:
        w.skip(w.count(n, struct.calcsize(_SCALARS[item]), what) * struct.calcsize(_SCALARS[item]), what)
    elif item == _STRING:
        for _ in range(w.count(n, 8, what)):  # bounded: each string takes its 8-byte length at least
            w.skip(w.take("Q"), what)
    elif item == _ARRAY:
        for _ in range(w.count(n, 12, what)):  # each holds its item type and count at least
            _value(w, _ARRAY, what, depth + 1)
    else:
        raise GGUFLayoutError(f"{what} is an array of unknown value type {item}")
    return None


def _tensor(w: _Walk) -> tuple[str, int, int]:
    """(name, offset, bytes) of one tensor info."""
    name = _key(w.string("a tensor name"))
    n_dims = w.take("I")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise GGUFLayoutError(f"tensor {name} has {n_dims} dimensions (1 to {_MAX_DIMS})")
    dims = [w.take("Q") for _ in range(n_dims)]
    kind, offset = w.take("I"), w.take("Q")
    if kind not in GGML_BLOCKS:
        raise GGUFLayoutError(f"tensor {name} has an unknown ggml type {kind}")
    block, nbytes = GGML_BLOCKS[kind]
    if any(d < 1 for d in dims) or dims[0] % block:
        raise GGUFLayoutError(f"tensor {name} has shape {dims}, which ggml type {kind} (blocks of {block}) cannot hold")
    n = 1
    for d in dims:
        n *= d  # a Python int: no overflow, compared with the file size below
    return name, offset, n // block * nbytes


def check_gguf_layout(path: str | Path) -> GGUFLayout:
    """Walk the header of the GGUF at `path`; GGUFLayoutError (one line) unless every string,
    array and tensor it declares lies inside the file."""
    path = Path(path)
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size < 24:
            raise GGUFLayoutError(f"{size} bytes is too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(buf, size)


def _walk(buf, size: int) -> GGUFLayout:
    if bytes(buf[:4]) != _MAGIC:
        raise GGUFLayoutError("not a GGUF file (no GGUF magic)")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in _VERSIONS:
        raise GGUFLayoutError(f"GGUF version {version} is not supported ({', '.join(map(str, _VERSIONS))})")
    w = _Walk(buf, order)
    w.pos = 8
    n_tensors, n_kv = w.take("Q"), w.take("Q")
    w.count(n_kv, 13, "the metadata")  # key length, value type, one byte of value
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = _key(w.string("a metadata key"))
        kind = w.take("I")
        value = _value(w, kind, f"metadata '{key}'")
        if key == "general.alignment":
            if kind != 4 or not value or value & (value - 1):
                raise GGUFLayoutError(f"general.alignment must be a power of two (a uint32), got {value!r}")
            alignment = value
    w.count(n_tensors, 24, "the tensor list")  # name length, dims, type, offset
    tensors = [_tensor(w) for _ in range(n_tensors)]
    data = -(-w.pos // alignment) * alignment
    for name, offset, nbytes in tensors:
        if data + offset + nbytes > size:
            raise GGUFLayoutError(f"tensor {name} claims {nbytes} bytes at offset {offset}, past the end of the "
                                  f"file ({size} bytes; a truncated download?)")
    return GGUFLayout(version, n_tensors, n_kv, data, size)
