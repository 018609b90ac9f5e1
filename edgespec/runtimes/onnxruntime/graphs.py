"""Load-time surgery on edgespec's ONNX decoder graphs, and weight tables mapped from their files.

Every decoder graph the exporter wrote (exporters/onnx/graph.py: fp32, fp16, int8 quantized,
GGUF-transcoded MatMulNBits; the append KV layout) ends the same way: the final norm,
`Slice(x, -n_logits)` (the rows that reach the head), then the head (Reshape, MatMul / Gemm /
MatMulNBits, an optional softcap) into `logits`. `body_model` and `head_model` cut a graph at that
Slice's output (runtimes/onnxruntime/split.py runs a draft on the target's body with them). The
model files are read without their external data, and without the `onnx` package
(runtimes/onnxruntime/wire.py: importing it held memory in every process that opened a bundle): a
session built by `session` from a rebuilt model's bytes reads its weights from the bundle's folder.

`MappedTables` maps initializers read-only from their external data file, to hand to several
sessions with `SessionOptions.add_initializer` (a tied table) or to let a Gather's table go once
loaded (runtimes/onnxruntime/runtime.py). Until `drop_pages()` a thread keeps letting the pages go while a
session prepacks the table, so the table is never resident whole next to its packed copy.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ...errors import BackendError
from ..base import Streamed
from .pool import shared_pool
from .wire import (
    FLOAT,
    Node,
    OnnxModel,
    Value,
    identity_node,
    model_bytes,
    parse_model,
    read_model,
    rewired,
    tensor_array,
    tensor_value_info,
)

__all__ = ["HIDDEN", "LOGITS", "MappedTables", "OnnxModel", "as_model", "body_model", "fused_model", "gathered_tables",
           "head_model", "import_ort", "initializer_bytes", "load_proto", "ort_values", "session", "session_options",
           "shared_names", "streamed_of"]

logger = logging.getLogger(__name__)


def import_ort():
    try:
        import onnxruntime as ort
    except ImportError as e:  # edge installs may pick another backend
        raise BackendError("onnxruntime is not installed: pip install 'edgespec[onnx]'") from e
    return ort


HIDDEN = "hidden"  # the body's first output and the head's input: final hidden rows, (1, N, hidden)
LOGITS = "logits"


def _model_of(src: str | os.PathLike | OnnxModel) -> OnnxModel:
    return src if isinstance(src, OnnxModel) else read_model(src)


def as_model(model) -> OnnxModel:
    """An OnnxModel of an OnnxModel or of an `onnx` ModelProto (tests build those)."""
    return model if isinstance(model, OnnxModel) else parse_model(model_bytes(model))


def _cut(model: OnnxModel, name: str) -> str:
    """The tensor the head reads: the output of `Slice(final norm, -n_logits)`."""
    neg = {n.outputs[0] for n in model.nodes if n.op_type == "Neg" and n.inputs == ("n_logits",)}
    cut = [n.outputs[0] for n in model.nodes if n.op_type == "Slice" and len(n.inputs) > 1 and n.inputs[1] in neg]
    if len(cut) != 1 or not any(o.name == LOGITS for o in model.outputs):
        raise BackendError(f"{name} is not an edgespec decoder graph with a head to cut (export the bundle again)")
    return cut[0]


def _needed(nodes: tuple[Node, ...], outputs: Iterable[str], stop: str | None = None) -> list[Node]:
    """The nodes that `outputs` depend on (not past `stop`), in the graph's (topological) order."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.outputs}
    keep, todo = set(), [o for o in outputs if o != stop]
    while todo:
        i = producer.get(todo.pop())
        if i is None or i in keep:
            continue
        keep.add(i)
        todo += [t for t in nodes[i].inputs if t and t != stop]
    return [nodes[i] for i in sorted(keep)]


def _model(src: OnnxModel, nodes: list[Node], inputs: list[Value], outputs: list[Value], name: str) -> OnnxModel:
    """A model of `nodes` with the source's IR version, opsets, producer, metadata and the
    initializers they read."""
    used = {t for n in nodes for t in n.inputs}
    inits = tuple(t for t in src.initializers if t.name in used)
    return replace(src, graph_name=name, nodes=tuple(nodes), initializers=inits, inputs=tuple(inputs),
                   outputs=tuple(outputs))


def _hidden_size(model: OnnxModel, cut: str) -> int:
    """The head's input width: the exporter records it; older bundles have it in the Reshape
    that follows the cut ([-1, hidden])."""
    meta = model.metadata_props
    if "edgespec.hidden_size" in meta:
        return int(meta["edgespec.hidden_size"])
    consts = {t.name: t for t in model.initializers if t.external is None}
    for n in model.nodes:
        if n.op_type == "Reshape" and n.inputs[0] == cut and len(n.inputs) > 1 and n.inputs[1] in consts:
            return int(tensor_array(consts[n.inputs[1]])[-1])
    raise BackendError("cannot tell the hidden size of this ONNX graph (export the bundle again)")


def body_model(src: str | os.PathLike | OnnxModel) -> OnnxModel:
    """The decoder at `src` (a path or a model read once) without its head: outputs `hidden`
    (1, N, hidden), the final hidden rows of the last n_logits positions, then the graph's KV outputs."""
    model = _model_of(src)
    cut = _cut(model, _label(src))
    width = _hidden_size(model, cut)
    kv_out = [o for o in model.outputs if o.name != LOGITS]
    nodes = _needed(model.nodes, [cut, *(o.name for o in kv_out)])
    nodes.append(identity_node(cut, HIDDEN, "edgespec_hidden"))
    out = [tensor_value_info(HIDDEN, FLOAT, [1, "N", width]), *kv_out]
    return _model(model, nodes, list(model.inputs), out, "edgespec_body")


def head_model(src: str | os.PathLike | OnnxModel, *, direct: bool = True) -> OnnxModel:
    """The decoder's head alone: `hidden` (1, N, hidden) -> `logits` (1, N, vocab).
    direct: the head's product written straight into `logits` where the graph flattens the rows
    around it (`_direct_product`); False: the graph's own nodes, as they are."""
    model = _model_of(src)
    cut = _cut(model, _label(src))
    width = _hidden_size(model, cut)
    nodes = _needed(model.nodes, [LOGITS], stop=cut)
    if direct:
        nodes = _direct_product(model, nodes, cut)
    nodes.insert(0, identity_node(HIDDEN, cut, "edgespec_hidden"))
    inp = [tensor_value_info(HIDDEN, FLOAT, [1, "N", width])]
    out = [o for o in model.outputs if o.name == LOGITS]
    return _model(model, nodes, inp, out, "edgespec_head")


def fused_model(src: str | os.PathLike | OnnxModel) -> OnnxModel:
    """The whole decoder, its head's product written straight into `logits` (`_direct_product`);
    a graph without an edgespec head to cut, as it is."""
    model = _model_of(src)
    try:
        cut = _cut(model, _label(src))
    except BackendError:
        return model
    nodes = _direct_product(model, list(model.nodes), cut)
    if len(nodes) == len(model.nodes):
        return model
    return _model(model, nodes, list(model.inputs), list(model.outputs), model.graph_name)


# products that multiply a (..., K) input over any leading dimensions
_BATCHED = ("MatMul", "MatMulNBits")


def _ints_of(consts: dict, name: str) -> list[int] | None:
    return [int(v) for v in tensor_array(consts[name]).ravel()] if name in consts else None


def _direct_product(model: OnnxModel, nodes: list[Node], cut: str) -> list[Node]:
    """The head's nodes, with `logits = Unsqueeze(P(Reshape(cut, [-1, H]), ...), [0])` (how the
    exporter writes every head without a softcap, P a MatMul or MatMulNBits) as `logits =
    P(cut, ...)`: the same products of the same (1, N, H) rows, bit for bit. onnxruntime then
    writes them into the bound logits buffer, where it allocated P's output apart and copied it
    over: a buffer of whole logit rows per call at Gemma 3's vocabulary, served from glibc's heap
    once the first were freed, whose free blocks grew it during a generation (and with it the
    default configuration's peak). Any other head is left as it is."""
    head = _flat_head(nodes, cut)
    if head is None or not _flattens_rows(model, head):
        return nodes
    flat, prod, last = head.flat, head.prod, head.last
    if [n for n in nodes if {*flat.outputs, *prod.outputs} & set(n.inputs)] != [prod, last]:
        return nodes  # the flattened rows or the product have another reader
    direct = rewired(prod, (cut, *prod.inputs[1:]), (LOGITS,))
    return [direct if n is prod else n for n in nodes if n is not flat and n is not last]


@dataclass(frozen=True)
class _FlatHead:
    """`logits = last(prod(flat(cut, shape), ...), axes)`, the nodes _direct_product rewrites."""

    flat: Node  # Reshape of the cut's (1, N, H) rows
    prod: Node  # a batched product (_BATCHED) of the reshaped rows
    last: Node  # Unsqueeze of the product into `logits`


def _flat_head(nodes: list[Node], cut: str) -> _FlatHead | None:
    """The Reshape, product and Unsqueeze of a head shaped as _direct_product rewrites it, else None
    (their constants are _flattens_rows's to check)."""
    by_out = {o: n for n in nodes for o in n.outputs}
    last = by_out.get(LOGITS)
    prod = by_out.get(last.inputs[0]) if last is not None and last.op_type == "Unsqueeze" else None
    flat = by_out.get(prod.inputs[0]) if prod is not None and prod.op_type in _BATCHED else None
    if flat is None or flat.op_type != "Reshape" or flat.inputs[0] != cut or len(last.inputs) != 2:
        return None
    return _FlatHead(flat=flat, prod=prod, last=last)


def _flattens_rows(model: OnnxModel, head: _FlatHead) -> bool:
    """Whether the Reshape is to constant [-1, H] and the Unsqueeze's axes are constant [0]: the
    product then sees the cut's rows as they are, only without their leading 1."""
    consts = {t.name: t for t in model.initializers if t.external is None}
    shape = _ints_of(consts, head.flat.inputs[1])
    return _ints_of(consts, head.last.inputs[1]) == [0] and shape is not None and len(shape) == 2 and shape[0] == -1


def _label(src) -> str:
    return (src.origin or src.graph_name) if isinstance(src, OnnxModel) else Path(src).name


def shared_names(*models) -> list[str]:
    """Initializers every model reads (a tied table: the body's embedding, the head's matrix)."""
    sets = [{t.name for t in as_model(m).initializers} for m in models]
    return sorted(set.intersection(*sets)) if sets else []


def gathered_tables(model) -> list[str]:
    """External initializers a Gather reads rows of (the input embedding, as floats or as GGUF
    blocks and their scales): a forward reads a few rows, so they need not be in memory whole."""
    model = as_model(model)
    external = {t.name for t in model.initializers if t.external is not None}
    return sorted({n.inputs[0] for n in model.nodes if n.op_type == "Gather" and n.inputs[0] in external})


def load_proto(path: str | os.PathLike) -> OnnxModel:
    """The graph of an .onnx file without its external data (read without the `onnx` package)."""
    return read_model(path)


# how often the pages of tables being prepacked are let go: often enough that little of a large
# head (prepacked at hundreds of MB a second) is resident between two drops
SHED_SECONDS = 0.01


def _shed(maps: list, stop: threading.Event) -> None:
    """Unmap the maps' resident pages every SHED_SECONDS until `stop`: a session prepacking them
    reads each page once, so the table's pages never pile up next to its packed copy. Reads fault
    pages back in from the page cache: the data is unchanged, only what stays resident."""
    import mmap

    while not stop.wait(SHED_SECONDS):
        for m in maps:
            m.madvise(mmap.MADV_DONTNEED)


class MappedTables:
    """Initializers mapped read-only from their external data files (one mapping per file): file
    pages, shared by every session handed them, that the kernel may drop and read back.

    From construction until `drop_pages()`, a thread lets the tables' pages go every
    SHED_SECONDS: the sessions built meanwhile (a head's MatMulNBits prepacks its own copy of the
    tied table) read them page by page, so the table is never resident whole next to its packed
    copy, which lowers the load peak. `drop_pages()` stops it and lets the pages go
    for good: what a Gather reads later (the embedding rows of the tokens seen) comes back, the rest
    of the table no longer counts in the process's memory."""

    def __init__(self, model, folder: Path, names: Iterable[str]) -> None:
        """model: an OnnxModel (or an `onnx` ModelProto) holding the initializers `names`."""
        import mmap

        tensors = {t.name: t for t in as_model(model).initializers}
        self._maps: dict[str, mmap.mmap] = {}
        self._ranges: list[tuple[Path, int, int]] = []  # (file, offset, length) of each mapped table
        self.arrays: dict[str, np.ndarray] = {}
        for name in names:
            t = tensors[name]
            if t.external is None:
                self.arrays[name] = np.ascontiguousarray(tensor_array(t))
                continue
            nbytes = t.numel * t.dtype.itemsize
            if int(t.external.get("length", nbytes)) != nbytes:
                raise BackendError(f"initializer {name} is not stored as plain {t.dtype} (export the bundle again)")
            file = t.external["location"]
            if file not in self._maps:
                with open(folder / file, "rb") as f:
                    self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            offset = int(t.external.get("offset", 0))
            flat = np.frombuffer(self._maps[file], dtype=t.dtype, count=t.numel, offset=offset)
            self.arrays[name] = flat.reshape(t.dims)
            self._ranges.append((folder / file, offset, nbytes))
        self._stop = threading.Event()
        if self._maps and hasattr(mmap, "MADV_DONTNEED"):
            threading.Thread(target=_shed, args=(list(self._maps.values()), self._stop), daemon=True,
                             name="edgespec-shed-pages").start()
        weakref.finalize(self, self._stop.set)  # tables let go without drop_pages(): the thread stops too

    def drop_pages(self) -> None:
        """Unmap the resident pages (they stay in the file): the next read faults them back in.

        A row read later must bring back its own page, not the large folio the file was cached in
        when it was read whole (on Linux 6.x, one random embedding row mapped a whole folio back): so reads
        are marked random (no read-around) and the tables' cached pages are dropped too."""
        import mmap

        self._stop.set()
        if not (hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap, "MADV_RANDOM")):
            return  # not Linux or macOS: the pages stay mapped, as a session's own copy would
        for m in self._maps.values():
            m.madvise(mmap.MADV_RANDOM)
            m.madvise(mmap.MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            for path, offset, length in self._ranges:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


# onnxruntime's CPU arena keeps every block a forward ever took, sized up to the next power of two;
# a decoder's activations are small and short-lived, and malloc serves them as fast while giving
# them back, so a generation peaks lower
CPU_ARENA = False


def session_options(threads: int | None, spin: bool):
    """onnxruntime SessionOptions of every edgespec CPU session: full graph optimization, no CPU
    arena (CPU_ARENA), and the process-wide thread pool where the process allows it
    (runtimes/onnxruntime/pool.py); else a pool of its own with `threads` intra-op threads (None:
    onnxruntime's choice) that spin-wait between runs only with `spin`."""
    ort = import_ort()
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.enable_cpu_mem_arena = CPU_ARENA
    if shared_pool(threads):
        opts.use_per_session_threads = False
        return opts
    if threads:
        opts.intra_op_num_threads = threads
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def session(model, folder: Path, *, threads: int | None, spin: bool, initializers: dict):
    """An onnxruntime CPU session of a rebuilt `model` (an OnnxModel, or an `onnx` ModelProto)
    whose external data lives in `folder`, built from its bytes;
    `initializers`: name -> OrtValue used instead of the file's (shared with another session)."""
    ort = import_ort()
    opts = session_options(threads, spin)
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    present = {t.name for t in as_model(model).initializers}
    for name, value in initializers.items():
        if name in present:
            opts.add_initializer(name, value)
    try:
        return ort.InferenceSession(model_bytes(model), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types; keep one line
        raise BackendError(f"cannot load the split graph of {folder.name}: {str(e).splitlines()[0]}") from e


def ort_values(arrays: dict[str, np.ndarray]) -> dict:
    """OrtValues over the arrays' own memory (no copy): they must outlive every session given them."""
    ort = import_ort()
    return {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in arrays.items()}




def initializer_bytes(model, exclude: set[str]) -> int:
    """Bytes of `model`'s initializers (external or inline), those in `exclude` left out."""
    return sum(t.numel * t.itemsize for t in as_model(model).initializers if t.name not in exclude)


def streamed_of(model) -> Streamed:
    """What one forward of `model` reads whole and runs: the initializers its nodes read, except
    where a Gather only takes rows of them (a tied head's product of the same table counts), and
    its node count (onnxruntime fuses a few more at load)."""
    model = as_model(model)
    read = {name for n in model.nodes for j, name in enumerate(n.inputs) if not (n.op_type == "Gather" and j == 0)}
    return Streamed(sum(t.numel * t.itemsize for t in model.initializers if t.name in read), len(model.nodes))
