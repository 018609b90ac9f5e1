"""The KV holders of the onnxruntime runtime: one class per KV layout of an edgespec decoder graph.

A holder binds a graph's past and new KV for a forward and runs it (`forward`), rolls back (`trim`,
`reset`) and says what it holds (`memory`), as mlx-lm's models/cache.py gives each cache kind a class.
onnxruntime runs one layout of exporters/onnx/graph.py:

- `FixedBufferKV` (the "append" layout, every `edgespec export` for onnxruntime): the graph takes the past
  sequence-major, (1, P, kv_heads, head_dim), and returns only the new rows. One preallocated
  (capacity, kv_heads, head_dim) array per layer for K and one for V; a forward binds the filled
  prefix as the past and the rows right after it as the output (IOBinding on raw pointers), so the
  cache never grows, is never copied, and a rollback just lowers n_past. Logits go into a reused
  buffer too: a step allocates nothing per candidate. The binds go through `RawBinding`, and only
  those that changed since the last forward are made again. `pad_rows` computes every forward one row
  wider (its last token again) and drops that row, the exact mode where a one-row kernel rounds
  unlike a taller one; the padding row's K/V lands one slot past the sequence. A graph exported
  with `--tree` also takes `tree_path`/`tree_depth` (exporters/onnx/tree.py): a chain's are bound
  from one preallocated range, a tree forward's (`TreeRows`) for that forward only, and
  `keep_rows` moves the accepted path's K/V rows behind the prefix. Where the graph's metadata
  names sliding-window layers (exporters/onnx/graph.py, GraphOptions.window_keys), their pasts are
  bound from an aligned start (`KVWindow`, `window_start`), so those layers attend over their window
  only, and their buffers hold a window's worth of rows (`KVPlan.sliding_rows`): position p at row
  p - base, the live rows moved to the front when a forward would pass the end (docs/long-context.md).

`plan_kv` picks the holder and its settings once, from the graph's inputs and outputs and the
options, without a session: a pure function. A graph of the first exporter's layout (past/present:
the cache grew by concatenation) is refused there with a BundleError naming the fix, re-exporting.
"""
from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...errors import BackendError, BundleError, ContextFullError
from ..heap import lazy_zeros
from ..window import WINDOW_FORWARD, WINDOW_ROLLBACK, KVWindow, sliding_kv, window_start

__all__ = ["DEFAULT_KV_CAPACITY", "F32", "I64", "WINDOW_FORWARD", "WINDOW_ROLLBACK", "FixedBufferKV", "KVHolder",
           "KVLayout", "KVPlan", "KVWindow", "RawBinding", "TreeRows", "graph_io", "kv_kind", "plan_kv",
           "sliding_kv_of", "window_start"]

# positions preallocated when no capacity is planned; numpy's zeroed buffers are committed
# page by page as they fill, so an unused tail costs address space, not memory
DEFAULT_KV_CAPACITY = 4096
_LOGIT_ROWS = 17  # logits buffer rows kept ready: verify width for drafts up to 16 tokens
_INPUTS = ["input_ids", "n_logits", "past_key_0"]  # the first inputs of every edgespec decoder graph
F32, I64 = 1, 7  # ONNX element types (TensorProto.FLOAT, INT64): what both bind paths take as they are


class RawBinding:
    """An IOBinding of raw CPU buffers, and the run that reads it.

    onnxruntime's Python IOBinding builds an OrtDevice and converts a numpy dtype at every bind
    (a one-token forward binds two buffers per layer and K/V, so that cost adds up), and
    its `run_with_iobinding` asks the session about graph capture each run. Where the wrapped C
    objects are reachable (`IOBinding._iobinding`, `InferenceSession._sess`), this binds on them
    with one CPU device made here and ONNX element types (a fraction of the cost) and runs the C session;
    elsewhere (another onnxruntime, a test's fake session) it uses the public wrapper, same calls.

    `bind_input(name, device, element_type, shape, ptr)` and `bind_output(...)` take `device` as
    given (`self.device`), so a hot loop calls them without an extra Python frame."""

    def __init__(self, sess, *, public: bool = False) -> None:
        """public: use the public wrapper even where the C objects are reachable (tests of both paths)."""
        binding = sess.io_binding()
        c_binding, c_sess, device = (None, None, None) if public else _c_objects(sess, binding)
        self.fast = c_binding is not None
        if self.fast:
            self.device, self.bind_input, self.bind_output = device, c_binding.bind_input, c_binding.bind_output
            self._sess, self._arg = c_sess, c_binding
        else:
            self.device = "cpu"
            self.bind_input = lambda name, dev, et, shape, ptr: binding.bind_input(name, dev, 0, et, shape, ptr)
            self.bind_output = lambda name, dev, et, shape, ptr: binding.bind_output(name, dev, 0, et, shape, ptr)
            self._sess, self._arg = sess, binding
        self._binding = binding  # the public object owns the C one: kept alive with it

    def run(self) -> None:
        """Run the session on what is bound."""
        if self.fast:
            self._sess.run_with_iobinding(self._arg, None)
        else:
            self._sess.run_with_iobinding(self._arg)


def _c_objects(sess, binding) -> tuple[object, object, object]:
    """(C IOBinding, C session, C CPU device) behind onnxruntime's Python objects, or Nones where
    this onnxruntime does not have them."""
    c_binding, c_sess = getattr(binding, "_iobinding", None), getattr(sess, "_sess", None)
    if c_binding is None or c_sess is None or not hasattr(c_sess, "run_with_iobinding"):
        return None, None, None
    try:
        from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

        device = OrtDevice.make("cpu", 0)._get_c_device()
    except (ImportError, AttributeError, TypeError):
        return None, None, None
    return c_binding, c_sess, device


@dataclass(frozen=True)
class TreeRows:
    """A tree forward's extra inputs (exporters/onnx/tree.py): `path` (S, D) int64, row s's path
    from the forward's first row to itself, padded with s; `depth` (S,) int64."""

    path: np.ndarray
    depth: np.ndarray

    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> TreeRows:
        """parents[i]: the row before row i on its path (-1: the first row, which every path starts at)."""
        depth = np.zeros(len(parents), dtype=np.int64)
        for i, par in enumerate(parents):
            if (i == 0) != (par < 0) or par >= i:
                raise ValueError(f"row {i}'s parent {par} must be an earlier row (-1 for row 0 only)")
            depth[i] = depth[par] + 1 if i else 0
        path = np.repeat(np.arange(len(parents), dtype=np.int64)[:, None], int(depth.max()) + 1, axis=1)
        for i in range(len(parents)):
            node = i
            for d in range(int(depth[i]), -1, -1):
                path[i, d], node = node, parents[node]
        return cls(path, depth)


@dataclass(frozen=True)
class KVLayout:
    """The cache a graph reads: `n_layers` K and V tensors of `kv_heads` x `head_dim` per position, f32."""

    n_layers: int
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.kv_heads * self.head_dim * 4


@dataclass(frozen=True)
class KVPlan:
    """How a runtime holds its cache, settled at construction (plan_kv)."""

    kind: type[KVHolder]
    layout: KVLayout
    capacity: int | None  # most positions held (a forward past it: ContextFullError); None: no limit
    pad: int  # rows added to every forward (pad_rows), 0 or 1
    tree: bool = False  # the graph takes tree_path/tree_depth (exporters/onnx/tree.py)
    window: KVWindow | None = None  # sliding layers whose pasts are bound from an aligned start
    sliding_rows: int | None = None  # rows a sliding layer's buffer holds (None: capacity + pad, as every layer)

    def sliding_kv(self) -> tuple[float, int]:
        """runtimes/window.sliding_kv of this plan's buffers."""
        return sliding_kv(self.window, self.layout.n_layers, self.sliding_rows)


class KVHolder(abc.ABC):
    """One way of holding a graph's KV cache; it binds the session's KV inputs and outputs and runs it."""

    fixed: ClassVar[bool] = False  # buffers preallocated for the capacity (Capabilities.fixed_kv)
    pads: ClassVar[bool] = False  # can compute a forward one row wider and drop that row (pad_rows)
    # where the past input's shape (1, ?, ?, head_dim) names the KV heads
    heads_axis: ClassVar[int]
    default_capacity: ClassVar[int | None] = None

    def __init__(self, plan: KVPlan, sess, ort, output: str, width: int) -> None:
        """sess: the onnxruntime session; output: the first output's name (logits or hidden), whose
        rows are `width` wide."""
        self.plan, self._sess, self._ort, self._output, self._width = plan, sess, ort, output, width
        self._n = 0
        self.reset()

    @property
    def n_past(self) -> int:
        return self._n

    def forward(self, token_ids: Sequence[int], n_logits: int, tree: TreeRows | None = None) -> np.ndarray:
        """Append `token_ids` (n_logits <= their count); the last `n_logits` rows of the output.
        `tree`: the rows form a draft tree (the tree graph only); keep_rows then keeps one path."""
        cap = self.plan.capacity
        if cap is not None and self._n + len(token_ids) > cap:
            raise ContextFullError(f"the context is full: {self._n} + {len(token_ids)} positions exceed "
                                   f"the KV capacity of {cap}")
        return self._run(token_ids, n_logits, tree)

    @abc.abstractmethod
    def _run(self, token_ids: Sequence[int], n_logits: int, tree: TreeRows | None = None) -> np.ndarray:
        """Bind, run the session, keep the new positions (room checked)."""

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        """After a tree forward that began at position `start`: hold the positions before it and
        then the new rows `rows` (indices into that forward's rows, increasing: a root-to-node path)."""
        raise BackendError("this KV layout verifies chains only")

    def trim(self, n_past: int) -> None:
        """Hold only the first `n_past` positions."""
        if n_past >= self._n:
            return
        if n_past <= 0:
            self.reset()
            return
        self._keep(n_past)

    def _keep(self, n_past: int) -> None:
        """Hold the first `n_past` positions (0 < n_past < n_past now)."""
        self._n = n_past

    def reset(self) -> None:
        self._n = 0

    def probe(self, n_new: int, n_ctx: int) -> bool:
        """Runtime.probe_scratch: False where the holder cannot stand a prefix in for a context."""
        return False

    def buffers(self) -> list[np.ndarray]:
        """The preallocated K/V arrays."""
        return []

    @abc.abstractmethod
    def memory(self) -> dict[str, int]:
        """Bytes held now: `kv` and what else the holder allocates."""

    def close(self) -> None:
        self._sess = None


class FixedBufferKV(KVHolder):
    """Sequence-major buffers preallocated for the capacity, written in place through IOBinding."""

    fixed = pads = True
    heads_axis = 2  # past: (1, P, kvh, hd)
    default_capacity = DEFAULT_KV_CAPACITY

    def __init__(self, plan: KVPlan, sess, ort, output: str, width: int) -> None:
        super().__init__(plan, sess, ort, output, width)
        lay, rows = plan.layout, plan.capacity + plan.pad
        sliding = plan.window.layers if plan.sliding_rows and plan.window else frozenset()
        self._base = 0  # the position a sliding layer's buffer row 0 holds
        # the padding row's K/V lands one slot past the sequence: room for it at capacity. Pages
        # are committed as they are written: RSS follows the context actually used (lazy_zeros)
        self._kv = [lazy_zeros((plan.sliding_rows if i // 2 in sliding else rows, lay.kv_heads, lay.head_dim))
                    for i in range(2 * lay.n_layers)]
        self._kv_bytes = sum(a.nbytes for a in self._kv)  # memory() runs with every streamed Response
        per = KVLayout(1, lay.kv_heads, lay.head_dim).bytes_per_token
        self._per = (per * (lay.n_layers - len(sliding)), per * len(sliding))  # (full, sliding) bytes a position
        self.logits = np.zeros((_LOGIT_ROWS, width), dtype=np.float32)
        self._ids = np.zeros((1, rows), dtype=np.int64)
        self._arange = np.arange(rows, dtype=np.int64)  # a chain's tree_path and tree_depth (tree graph)
        self._tree: TreeRows | None = None  # the arrays a tree forward bound, alive while bound
        self._n_logits = np.zeros(1, dtype=np.int64)
        self._binding = RawBinding(sess)
        # (past input, new output, buffer base address, a sliding layer's?) per K/V buffer: the base never
        # moves. Without window-sized buffers a sliding layer is still bound its window of the whole one
        sliding = plan.window.layers if plan.window else frozenset()
        self._slots = [(f"past_{kind}_{i // 2}", f"new_{kind}_{i // 2}", buf.ctypes.data, i // 2 in sliding)
                       for i, (kind, buf) in enumerate(zip(("key", "value") * lay.n_layers, self._kv))]
        b = self._binding
        b.bind_input("n_logits", b.device, I64, [1], self._n_logits.ctypes.data)  # its address never moves
        self._bound: tuple[int, int, int] = (-1, -1, 0)  # (ids width, logits rows, logits address) bound

    def _run(self, token_ids: Sequence[int], n_logits: int, tree: TreeRows | None = None) -> np.ndarray:
        if not self.plan.sliding_rows or len(token_ids) <= WINDOW_FORWARD:
            return self._run_one(token_ids, n_logits, tree)
        # too wide for a sliding buffer at once: pieces ending at multiples of WINDOW_FORWARD, the
        # last holding the rows asked for (where the decoder's chunked prefill cuts the same ids)
        p, end = self._n, self._n + len(token_ids)
        last = min(max(p, (end - 1) // WINDOW_FORWARD * WINDOW_FORWARD), end - n_logits)
        if end - last > WINDOW_FORWARD:
            raise BackendError(f"a forward returns at most {WINDOW_FORWARD} logit rows here, asked for {n_logits}")
        pos = p
        while pos < last:
            stop = min(last, (pos // WINDOW_FORWARD + 1) * WINDOW_FORWARD)
            self._run_one(token_ids[pos - p:stop - p], 1)
            pos = stop
        return self._run_one(token_ids[last - p:], n_logits)

    def _make_room(self, p: int, s: int) -> None:
        """Before a forward of `s` rows (padding included) at `p`: where they would pass the end of
        the sliding buffers, move the rows from start(p - WINDOW_ROLLBACK) on to the front. The
        bound past stays one contiguous view, and its columns keep their aligned positions."""
        keep = self.plan.window.moved_base(self._base, self.plan.sliding_rows, p, s)
        if keep is None:
            return
        lo, hi = keep - self._base, p - self._base
        for buf, (_, _, _, sliding) in zip(self._kv, self._slots):
            if sliding:
                buf[:hi - lo] = buf[lo:hi]  # numpy copies overlapping rows as if through a temporary
        self._base = keep

    def _run_one(self, token_ids: Sequence[int], n_logits: int, tree: TreeRows | None = None) -> np.ndarray:
        p, real, pad, lay = self._n, len(token_ids), self.plan.pad, self.plan.layout
        if tree is not None and (pad or not self.plan.tree):
            raise BackendError("tree verification needs the tree graph (edgespec export --tree) without pad_rows")
        # with padding, the graph also returns the padding row's logits (it returns the last rows)
        s, rows = real + pad, n_logits + pad
        if rows > len(self.logits):  # a wider verify than planned: grow once, keep it
            self.logits = np.zeros((rows, self._width), dtype=np.float32)
        b = self._binding
        ids = self._ids[0, :s]
        ids[:real] = token_ids
        ids[real:] = token_ids[-1]
        self._n_logits[0] = rows
        # bind again only what moved: the ids' width and the logits' rows change with the step's
        # shape, the K/V past and new rows with every forward (P grows)
        bound = (s, rows, self.logits.ctypes.data)
        if bound != self._bound:
            if bound[0] != self._bound[0]:
                b.bind_input("input_ids", b.device, I64, [1, s], self._ids.ctypes.data)
                if self.plan.tree:  # a chain: one path 0..s-1 for every row, depth = row
                    b.bind_input("tree_path", b.device, I64, [1, s], self._arange.ctypes.data)
                    b.bind_input("tree_depth", b.device, I64, [s], self._arange.ctypes.data)
            b.bind_output(self._output, b.device, F32, [1, rows, self._width], bound[2])
            self._bound = bound
        if tree is not None:  # bound for this forward only: the next one binds its chain again
            self._tree = tree
            b.bind_input("tree_path", b.device, I64, list(tree.path.shape), tree.path.ctypes.data)
            b.bind_input("tree_depth", b.device, I64, [s], tree.depth.ctypes.data)
            self._bound = (-1, -1, 0)
        bind_in, bind_out, dev = b.bind_input, b.bind_output, b.device
        kvh, hd = lay.kv_heads, lay.head_dim
        past, new, row = [1, p, kvh, hd], [1, s, kvh, hd], kvh * hd * 4
        start = self.plan.window.start(p) if self.plan.window else 0
        base = 0
        if self.plan.sliding_rows:
            self._make_room(p, s)
            base = self._base
        # a sliding layer's past: positions start..p-1, at row (position - base) of a window-sized
        # buffer, or of the whole one (base 0)
        window, skip, at = [1, p - start, kvh, hd], (start - base) * row, (p - base) * row
        for past_name, new_name, addr, sliding in self._slots:
            if sliding:
                bind_in(past_name, dev, F32, window, addr + skip)
                bind_out(new_name, dev, F32, new, addr + at)
            else:
                bind_in(past_name, dev, F32, past, addr)
                bind_out(new_name, dev, F32, new, addr + p * row)
        b.run()
        self._n = p + real
        return self.logits[:n_logits]

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        if not self.plan.tree:
            return super().keep_rows(start, rows)  # raises: a chain graph has no tree rows
        idx = np.asarray(rows, dtype=np.int64)
        if start < 0 or start + (int(idx.max()) + 1 if idx.size else 0) > self._n or (np.diff(idx) <= 0).any():
            raise ValueError(f"rows {list(rows)} are not increasing rows of the forward at {start} (n_past {self._n})")
        for buf in self._kv:  # the path's K/V rows moved down behind the prefix: a few rows each
            buf[start:start + idx.size] = buf[start + idx]
        self._n = start + idx.size

    def _keep(self, n_past: int) -> None:
        if self.plan.sliding_rows and not self.plan.window.holds(n_past, self._base):
            # the sliding buffers no longer hold the keys a forward at n_past reads: hold nothing,
            # and the caller, which sees n_past fall to 0, feeds the prefix again
            self.reset()
            return
        self._n = n_past

    def reset(self) -> None:
        self._n = self._base = 0

    def probe(self, n_new: int, n_ctx: int) -> bool:
        if n_new < 1 or n_ctx > self.plan.capacity:
            return False
        # the buffers' prefix stands in for a cached context: its contents do not matter here
        self._n = max(0, n_ctx - n_new)
        if self.plan.sliding_rows:
            self._base = self.plan.window.start(max(0, self._n - WINDOW_ROLLBACK))
        try:
            self._run([0] * min(n_new, n_ctx), 1)
        finally:
            self.reset()
        return True

    def buffers(self) -> list[np.ndarray]:
        return list(self._kv)

    def memory(self) -> dict[str, int]:
        held = min(self._n, self.plan.sliding_rows or self._n)  # rows of a sliding buffer written so far, at most
        return {"kv": self._kv_bytes, "kv_used": self._per[0] * self._n + self._per[1] * held,
                "logits": self.logits.nbytes}

    def close(self) -> None:
        self._binding = None
        self._kv, self._kv_bytes = [], 0
        super().close()


def kv_kind(outputs: Sequence[str], name: str = "the model") -> type[KVHolder]:
    """The holder of a graph with these output names: the append layout returns `new_*` rows. The
    first layout's graphs (`present_*` out: the cache grew by concatenation) are refused with the fix."""
    if "new_key_0" in outputs:
        return FixedBufferKV
    if "present_key_0" in outputs:
        raise BundleError(f"{name} has the old growing KV layout, which edgespec no longer runs: export the "
                          "bundle again with `edgespec export`")
    raise BackendError(f"{name} is not an edgespec decoder graph (no new_key_0 output)")


def graph_io(sess) -> tuple[list[tuple[str, list]], list[str]]:
    """(inputs as (name, shape), output names) of an onnxruntime session: what plan_kv reads."""
    return [(i.name, list(i.shape)) for i in sess.get_inputs()], [o.name for o in sess.get_outputs()]


def plan_kv(inputs: Sequence[tuple[str, Sequence]], outputs: Sequence[str], *, capacity: int | None = None,
            pad_rows: bool = False, name: str = "the model", meta: Mapping[str, str] | None = None) -> KVPlan:
    """The holder and its settings for a graph with these inputs ((name, shape), in order) and
    output names: the layout's holder (kv_kind), the KV shape read from `past_key_0`, `capacity`
    (or the holder's default), pad_rows where the holder can pad, and the sliding window the
    graph's metadata `meta` records (a fixed-buffer holder binds those layers' pasts shorter)."""
    names = [n for n, _ in inputs]
    if names[:3] != _INPUTS:
        raise BackendError(f"{name} is not an edgespec decoder graph (inputs: {', '.join(names[:4])})")
    kind = kv_kind(outputs, name)
    past = inputs[2][1]
    layout = KVLayout(sum(1 for n in names if n.startswith("past_key_")), int(past[kind.heads_axis]), int(past[3]))
    window = _window(meta or {}, name) if kind.fixed else None
    cap = int(capacity or kind.default_capacity) if kind.fixed else capacity
    pad, tree = int(pad_rows and kind.pads), "tree_path" in names and kind.fixed
    return KVPlan(kind, layout, cap, pad, tree=tree, window=window,
                  sliding_rows=_sliding_rows(window, tree, cap, pad))


def _sliding_rows(window: KVWindow | None, tree: bool, capacity: int | None, pad: int) -> int | None:
    """KVPlan.sliding_rows: window-sized buffers where they are smaller than the others
    (capacity + pad rows); None for a tree graph, whose keep_rows moves rows by position."""
    rows = window.rows(pad) if window is not None and not tree else None
    return rows if rows is not None and capacity is not None and rows < capacity + pad else None


def _window(meta: Mapping[str, str], name: str) -> KVWindow | None:
    """The sliding window a graph records in its metadata; None where it records none (every past is
    then bound whole)."""
    keys = ("edgespec.window", "edgespec.window_align", "edgespec.window_layers")
    if not all(k in meta for k in keys):
        return None
    try:
        return KVWindow(int(meta[keys[0]]), int(meta[keys[1]]),
                        frozenset(int(j) for j in meta[keys[2]].split(",")))
    except ValueError as e:
        raise BundleError(f"{name} records a bad sliding window ({e}): export the bundle again") from e


def sliding_kv_of(path) -> tuple[float, int]:
    """KVPlan.sliding_kv of the graph at `path` as this runtime would open it, read from the file
    without a session (the memory planner's estimate before loading): (0.0, 0) for none."""
    from .wire import read_model

    model = read_model(path)
    names = [v.name for v in model.inputs]
    window = _window(model.metadata_props, str(path))
    if window is None or "tree_path" in names:
        return 0.0, 0
    return sliding_kv(window, sum(1 for n in names if n.startswith("past_key_")), window.rows(0))
