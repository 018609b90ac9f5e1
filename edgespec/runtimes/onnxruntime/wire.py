"""An ONNX model file read and rebuilt at the protobuf wire level, without the `onnx` package.

The runtimes need little of a decoder graph at load: each node's op type, inputs and outputs,
each initializer's name, type, shape and where its external data lies, the graph's inputs and
outputs, the model's metadata; and they write models made of the source's own pieces (a body or
a head cut out of it, runtimes/onnxruntime/graphs.py). Importing `onnx` for that held resident
memory in every process that opens a bundle (its C++ extension and protobuf; the measurement is
in docs/dependencies.md), where nothing else imports either. So the file is read here: the
fields named above are decoded, every other one (node attributes, a tensor's data, value types)
stays as the bytes it was written as, copied into a rebuilt model unchanged, so onnxruntime reads
exactly what the exporter wrote.

Field numbers are onnx.proto's (IR version 3 and later); the readers accept a repeated scalar
packed or not, and any field order, as protobuf does.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PureWindowsPath

import numpy as np

from ...errors import BackendError

__all__ = ["FLOAT", "check_external_data", "OnnxModel", "Tensor", "Node", "Value", "identity_node", "model_bytes",
           "parse_model", "read_model", "rewired", "tensor_array", "tensor_value_info"]

# onnx.proto field numbers
_MODEL_IR, _MODEL_PRODUCER, _MODEL_GRAPH, _MODEL_OPSET, _MODEL_META = 1, 2, 7, 8, 14
_GRAPH_NODE, _GRAPH_NAME, _GRAPH_INIT, _GRAPH_INPUT, _GRAPH_OUTPUT = 1, 2, 5, 11, 12
_NODE_INPUT, _NODE_OUTPUT, _NODE_NAME, _NODE_OP = 1, 2, 3, 4
_T_DIMS, _T_TYPE, _T_FLOAT, _T_INT32, _T_INT64, _T_NAME, _T_RAW = 1, 2, 4, 5, 7, 8, 9
_T_DOUBLE, _T_EXT, _T_LOC = 10, 13, 14
_VALUE_NAME, _VALUE_TYPE = 1, 2
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL

FLOAT = 1  # TensorProto.DataType.FLOAT
# TensorProto.DataType -> numpy dtype, for the types a table or a shape constant is stored as
_NUMPY = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
          10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64", 15: "complex128"}
# bytes per element of the others, as numpy holds them (bfloat16, the float8s, 4-bit types)
_ITEMSIZE = {16: 2, 17: 1, 18: 1, 19: 1, 20: 1, 21: 1, 22: 1, 23: 1}


# ---- reading ---------------------------------------------------------------------------------

def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start: int, end: int) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of the message in buf[start:end]: an int for a varint, the
    (start, end) of the payload for a length-delimited field, the bytes of a fixed-width one."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = (pos, pos + n), pos + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, pos = bytes(buf[pos:pos + n]), pos + n
        else:  # groups (3, 4) are not in onnx.proto
            raise ValueError(f"wire type {wire}")
        if pos > end:
            raise ValueError("a field runs past its message")
        yield key >> 3, wire, value


def _str(buf, span: tuple[int, int]) -> str:
    return str(buf[span[0]:span[1]], "utf-8")


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _ints(buf, wire: int, value) -> list[int]:
    """A repeated integer field's values: one (unpacked) or a packed run."""
    if wire == 0:
        return [_signed(value)]
    out, pos = [], value[0]
    while pos < value[1]:
        v, pos = _varint(buf, pos)
        out.append(_signed(v))
    return out


@dataclass(frozen=True, eq=False)
class Tensor:
    """An initializer: what the runtimes read of it, and its serialized TensorProto (`raw`)."""

    name: str
    data_type: int
    dims: tuple[int, ...]
    external: dict[str, str] | None  # location, offset, length; None: the data is in the proto
    raw: memoryview = field(repr=False)

    @property
    def numel(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1

    @property
    def itemsize(self) -> int:
        if self.data_type in _NUMPY:
            return np.dtype(_NUMPY[self.data_type]).itemsize
        if self.data_type in _ITEMSIZE:
            return _ITEMSIZE[self.data_type]
        raise BackendError(f"initializer {self.name} has ONNX data type {self.data_type}, which edgespec does not read")

    @property
    def dtype(self) -> np.dtype:
        if self.data_type not in _NUMPY:
            raise BackendError(f"initializer {self.name} has ONNX data type {self.data_type}, "
                               "which numpy does not hold (export the bundle again)")
        return np.dtype(_NUMPY[self.data_type])


@dataclass(frozen=True, eq=False)
class Node:
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    raw: memoryview = field(repr=False)


@dataclass(frozen=True, eq=False)
class Value:
    """A graph input or output (a ValueInfoProto): its name, and its serialized form."""

    name: str
    raw: memoryview = field(repr=False)


@dataclass(frozen=True, eq=False)
class OnnxModel:
    """The parts of a ModelProto the runtimes read or carry into a model they rebuild."""

    ir_version: int
    producer_name: str
    opsets: tuple[memoryview, ...] = field(repr=False)  # serialized OperatorSetIdProtos
    metadata: tuple[tuple[str, str], ...]
    graph_name: str
    nodes: tuple[Node, ...]
    initializers: tuple[Tensor, ...]
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    origin: str = ""  # the file it was read from, for messages

    @property
    def metadata_props(self) -> dict[str, str]:
        return dict(self.metadata)

    def to_bytes(self) -> bytes:
        """The serialized ModelProto (what onnxruntime's InferenceSession reads)."""
        graph = b"".join([*(_ld(_GRAPH_NODE, n.raw) for n in self.nodes), _ld(_GRAPH_NAME, self.graph_name.encode()),
                          *(_ld(_GRAPH_INIT, t.raw) for t in self.initializers),
                          *(_ld(_GRAPH_INPUT, v.raw) for v in self.inputs),
                          *(_ld(_GRAPH_OUTPUT, v.raw) for v in self.outputs)])
        meta = (_ld(1, k.encode()) + _ld(2, v.encode()) for k, v in self.metadata)
        return b"".join([_key(_MODEL_IR, 0), _enc(self.ir_version), _ld(_MODEL_PRODUCER, self.producer_name.encode()),
                         _ld(_MODEL_GRAPH, graph), *(_ld(_MODEL_OPSET, o) for o in self.opsets),
                         *(_ld(_MODEL_META, m) for m in meta)])


def _tensor(buf, span) -> Tensor:
    name, dtype, dims, ext, loc = "", 0, [], {}, 0
    for f, wire, v in _fields(buf, *span):
        if f == _T_NAME:
            name = _str(buf, v)
        elif f == _T_TYPE:
            dtype = v
        elif f == _T_DIMS:
            dims += _ints(buf, wire, v)
        elif f == _T_EXT:
            entry = {k: _str(buf, s) for k, _, s in _fields(buf, *v)}
            ext[entry.get(1, "")] = entry.get(2, "")
        elif f == _T_LOC:
            loc = v
    return Tensor(name, dtype, tuple(dims), ext if loc == _EXTERNAL else None, buf[span[0]:span[1]])


def _node(buf, span) -> Node:
    inputs, outputs, op = [], [], ""
    for f, _, v in _fields(buf, *span):
        if f == _NODE_INPUT:
            inputs.append(_str(buf, v))
        elif f == _NODE_OUTPUT:
            outputs.append(_str(buf, v))
        elif f == _NODE_OP:
            op = _str(buf, v)
    return Node(op, tuple(inputs), tuple(outputs), buf[span[0]:span[1]])


def _value(buf, span) -> Value:
    name = next((_str(buf, v) for f, _, v in _fields(buf, *span) if f == _VALUE_NAME), "")
    return Value(name, buf[span[0]:span[1]])


def parse_model(data: bytes | memoryview, name: str = "model") -> OnnxModel:
    """The OnnxModel of a serialized ModelProto; a one-line BackendError if it is not one."""
    buf = memoryview(data)
    try:
        ir, producer, opsets, meta, graph = 0, "", [], [], None
        for f, _, v in _fields(buf, 0, len(buf)):
            if f == _MODEL_IR:
                ir = v
            elif f == _MODEL_PRODUCER:
                producer = _str(buf, v)
            elif f == _MODEL_OPSET:
                opsets.append(buf[v[0]:v[1]])
            elif f == _MODEL_META:
                entry = {k: _str(buf, s) for k, _, s in _fields(buf, *v)}
                meta.append((entry.get(1, ""), entry.get(2, "")))
            elif f == _MODEL_GRAPH:
                graph = v
        if graph is None:
            raise ValueError("no graph")
        parts: dict[int, list] = {_GRAPH_NODE: [], _GRAPH_INIT: [], _GRAPH_INPUT: [], _GRAPH_OUTPUT: []}
        readers = {_GRAPH_NODE: _node, _GRAPH_INIT: _tensor, _GRAPH_INPUT: _value, _GRAPH_OUTPUT: _value}
        graph_name = ""
        for f, _, v in _fields(buf, *graph):
            if f in readers:
                parts[f].append(readers[f](buf, v))
            elif f == _GRAPH_NAME:
                graph_name = _str(buf, v)
    except (IndexError, ValueError, TypeError) as e:  # truncated, or not protobuf at all
        raise BackendError(f"{name} is not a readable ONNX model ({e})") from None
    return OnnxModel(ir, producer, tuple(opsets), tuple(meta), graph_name, tuple(parts[_GRAPH_NODE]),
                     tuple(parts[_GRAPH_INIT]), tuple(parts[_GRAPH_INPUT]), tuple(parts[_GRAPH_OUTPUT]), name)


def read_model(path: str | os.PathLike) -> OnnxModel:
    """The model in an .onnx file, without its external data (~140 KB for Gemma 3 270M), whose
    external data files are checked (check_external_data) before anything opens them."""
    path = Path(path)
    if not path.is_file():
        raise BackendError(f"ONNX model not found: {path}")
    model = parse_model(path.read_bytes(), path.name)
    check_external_data(model, path.parent)
    return model


def _outside(location: str) -> bool:
    parts = re.split(r"[\\/]", location)
    return (not location.strip() or "\0" in location or location.startswith(("/", "\\"))
            or PureWindowsPath(location).drive != "" or ".." in parts)


def check_external_data(model: OnnxModel, folder: Path) -> None:
    """Each initializer stored outside the model file names a file inside `folder` (the model's
    own, symlinks resolved) and lies within that file: a bundle must not make onnxruntime read
    /etc/passwd or anything else outside it, and a truncated `.onnx.data` must be a one-line
    error, not a read past the end of a memory map. Checked before onnxruntime opens them."""
    root, sizes = folder.resolve(), {}
    for t in model.initializers:
        if t.external is None:
            continue
        loc = t.external.get("location", "")
        where = f"{model.origin or 'model'}: initializer {t.name!r} names its data at {loc[:80]!r}"
        if _outside(loc):
            raise BackendError(f"{where}, outside the model's folder")
        if loc not in sizes:
            try:
                real = (folder / loc).resolve(strict=True)
                real.relative_to(root)
                sizes[loc] = real.stat().st_size
            except ValueError:
                raise BackendError(f"{where}, which links outside the model's folder") from None
            except (OSError, RuntimeError) as e:  # missing, or a symlink loop
                raise BackendError(f"{where}, which cannot be opened: {getattr(e, 'strerror', None) or e}") from None
        try:
            offset = int(t.external.get("offset", 0))
            length = int(t.external.get("length", 0))
        except ValueError:
            raise BackendError(f"{where} with an offset or length that is not a byte count") from None
        if offset < 0 or length < 0 or offset + length > sizes[loc]:
            raise BackendError(f"{where}, bytes {offset}..{offset + length}, but the file holds {sizes[loc]} "
                               "(truncated? export the bundle again)")


def tensor_array(t: Tensor) -> np.ndarray:
    """An inline initializer's values (a copy), from raw_data or the typed field it was written to."""
    if t.external is not None:
        raise BackendError(f"initializer {t.name} is stored outside the model file")
    typed = {_T_FLOAT: ("float32", 1), _T_INT32: ("int32", 6), _T_INT64: ("int64", 7), _T_DOUBLE: ("float64", 11)}
    raw, values = None, []
    for f, wire, v in _fields(t.raw, 0, len(t.raw)):
        if f == _T_RAW:
            raw = t.raw[v[0]:v[1]]
        elif f in typed and typed[f][1] == t.data_type:
            if typed[f][0].startswith("float"):
                width = 4 if f == _T_FLOAT else 8
                payload = v if wire != 2 else bytes(t.raw[v[0]:v[1]])
                values += np.frombuffer(payload, dtype=f"<f{width}").tolist()
            else:
                values += _ints(t.raw, wire, v)
    dtype = t.dtype
    if raw is not None:
        flat = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype)
    elif values or t.numel == 0:
        flat = np.array(values, dtype=dtype)
    else:
        raise BackendError(f"initializer {t.name} is stored in a form edgespec does not read (export the bundle again)")
    if flat.size != t.numel:
        raise BackendError(f"initializer {t.name} holds {flat.size} values for shape {list(t.dims)}")
    return flat.reshape(t.dims)


# ---- writing ---------------------------------------------------------------------------------

def _enc(v: int) -> bytes:
    v &= (1 << 64) - 1  # a negative int64 is ten bytes of two's complement
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _key(f: int, wire: int) -> bytes:
    return _enc(f << 3 | wire)


def _ld(f: int, payload) -> bytes:
    """A length-delimited field."""
    return _key(f, 2) + _enc(len(payload)) + bytes(payload)


def identity_node(src: str, dst: str, name: str) -> Node:
    """An Identity node src -> dst (a renamed tensor at a cut)."""
    raw = _ld(_NODE_INPUT, src.encode()) + _ld(_NODE_OUTPUT, dst.encode()) + _ld(_NODE_NAME, name.encode()) \
        + _ld(_NODE_OP, b"Identity")
    return Node("Identity", (src,), (dst,), memoryview(raw))


def rewired(node: Node, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Node:
    """`node` reading `inputs` and writing `outputs`; its other fields (name, domain, attributes)
    as they were written."""
    rest = b"".join(_key(f, 2) + _enc(v[1] - v[0]) + bytes(node.raw[v[0]:v[1]]) if wire == 2 else
                    _key(f, wire) + (_enc(v) if wire == 0 else v)
                    for f, wire, v in _fields(node.raw, 0, len(node.raw)) if f not in (_NODE_INPUT, _NODE_OUTPUT))
    raw = b"".join([*(_ld(_NODE_INPUT, i.encode()) for i in inputs), *(_ld(_NODE_OUTPUT, o.encode()) for o in outputs),
                    rest])
    return Node(node.op_type, tuple(inputs), tuple(outputs), memoryview(raw))


def tensor_value_info(name: str, elem_type: int, shape: list[int | str]) -> Value:
    """A graph input or output: a tensor of `elem_type` whose dims are sizes or symbolic names."""
    dims = b"".join(_ld(1, _key(1, 0) + _enc(d) if isinstance(d, int) else _ld(2, d.encode())) for d in shape)
    tensor = _key(1, 0) + _enc(elem_type) + _ld(2, dims)  # TypeProto.Tensor: elem_type, shape
    return Value(name, memoryview(_ld(_VALUE_NAME, name.encode()) + _ld(_VALUE_TYPE, _ld(1, tensor))))


def model_bytes(model) -> bytes:
    """A serialized model: an OnnxModel's bytes, or an `onnx` ModelProto's (tests build those)."""
    if isinstance(model, OnnxModel):
        return model.to_bytes()
    if isinstance(model, (bytes, bytearray, memoryview)):
        return bytes(model)
    return model.SerializeToString()
