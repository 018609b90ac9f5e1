"""The KV holders of the OpenVINO runtime: one class per way of holding the cache.

Every edgespec OpenVINO IR has the buffer KV layout (exporters/onnx/graph.py, kv_layout="buffer"):
it takes the past KV, position ids and an attention mask, and returns logits plus only the new KV
rows. A holder decides how the IR is rewritten before it is compiled (`prepare`), what a forward
of n tokens is fed (`feed`), what it keeps of the outputs (`commit`, `rows`), how it rolls back
(`trim`) and what it holds (`nbytes`), as mlx-lm's models/cache.py gives each cache kind a class:

- `DynamicBufferKV` (the default): one numpy array per layer and K/V (slot j = position j) that
  grows by doubling; a forward is fed the held prefix and the new rows are written back after it;
  rollback lowers the length. It is the exact fast mode: every attention's keys are padded to
  whole blocks and its queries by one row (openvino/graph.pad_keys, pad_queries), so the CPU
  plugin's dynamic int8 quantization of activations stays on and a k-token verify still rounds
  bit for bit like k one-token decodes. `pad_rows` feeds every forward one row more (the exact
  mode where one-row kernels round unlike taller ones). Where the IR records sliding-window layers
  (`window_of`), their pasts are bound from an aligned start (openvino/graph.window_keys): views of
  the same buffers, so a sliding layer's attention costs the same at every context length. Their
  buffers hold a window's worth of rows (`KVPlan.sliding_rows`, as onnxruntime's FixedBufferKV):
  position p at row p - base, the live rows moved to the front before a forward would pass the
  end, so their memory stops growing too (docs/long-context.md).
- `StaticKV` (NPUs need it; runs anywhere): the IR is reshaped to a fixed capacity C and width W;
  every forward feeds W tokens (padded), the whole buffer, and a mask admitting the held positions
  and the real new tokens: rollback is the mask.

`plan_kv` picks the holder and its settings once, from the device and the options: `kv` names a
holder in KV_KINDS (the tests register OpenVINO's own state there, tests/ov_state_kv.py).
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...errors import BackendError, ContextFullError
from ..heap import lazy_zeros
from ..window import WINDOW_FORWARD, KVWindow, sliding_kv
from .graph import pad_keys, pad_queries, window_keys

__all__ = ["DEFAULT_KV_CAPACITY", "DEFAULT_STATIC_CAPACITY", "DynamicBufferKV", "Feed", "KV_KINDS", "KVHolder",
           "KVLayout", "KVPlan", "KVWindow", "StaticKV", "cut_every", "dynamic_inputs", "plan_kv",
           "window_of", "window_pieces"]

DEFAULT_STATIC_CAPACITY = 1024  # positions a static-shape model holds unless kv_capacity says otherwise
# the dynamic mode's limit unless kv_capacity says otherwise, as onnxruntime's and llama.cpp's:
# without one a prompt past the others' context ran (and took gigabytes) where they refuse it
DEFAULT_KV_CAPACITY = 4096
_FIRST_CAPACITY = 256  # the dynamic buffer's first size; it doubles as the sequence grows


@dataclass(frozen=True)
class KVLayout:
    """The cache an IR reads: `n_layers` K and V tensors of (1, kv_heads, positions, head_dim), f32."""

    n_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model) -> KVLayout:
        past = model.input("past_key_0").get_partial_shape()  # (1, kvh, P, hd)
        n_layers = sum(1 for p in model.inputs for n in p.get_names() if n.startswith("past_key_"))
        return cls(n_layers, past[1].get_length(), past[3].get_length())

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.kv_heads * self.head_dim * 4

    def shape(self, positions: int) -> tuple[int, int, int, int]:
        return (1, self.kv_heads, positions, self.head_dim)


@dataclass(frozen=True)
class KVPlan:
    """How a runtime holds its cache, settled at construction (plan_kv)."""

    kind: type[KVHolder]
    capacity: int  # most positions held; a forward past it is a ContextFullError
    width: int | None  # tokens every forward computes (static shapes), else None
    pad_rows: bool  # every forward one row wider, that row dropped (never one row)
    wide: bool  # forwards of more than one token run on a second compiled copy
    quantize: bool  # the CPU plugin may quantize activations to int8 on the fly
    window: KVWindow | None = None  # sliding layers whose pasts are bound from an aligned start
    sliding_rows: int | None = None  # rows a sliding layer's buffer holds (None: whole, as every layer)

    def sliding_kv(self, n_layers: int) -> tuple[float, int]:
        """runtimes/window.sliding_kv of this plan's buffers."""
        return sliding_kv(self.window, n_layers, self.sliding_rows)


def window_of(model) -> KVWindow | None:
    """The sliding-window record an IR's exporter wrote in its rt_info (exporters/openvino/export.window_info),
    or None: an IR without one (written before it, or a model with no window) binds every past whole."""
    keys = ("window", "window_align", "window_layers")
    if not all(model.has_rt_info(["edgespec", k]) for k in keys):
        return None
    raw = [model.get_rt_info(["edgespec", k]).astype(str) for k in keys]
    try:
        return KVWindow(int(raw[0]), int(raw[1]), frozenset(int(j) for j in raw[2].split(",")))
    except ValueError as e:  # a hand-edited or damaged record: say so, in one line
        raise BackendError(f"this OpenVINO IR's sliding window record is not valid ({', '.join(raw)}): "
                           "export the bundle again") from e


# an input of a forward: an array, or (buffer, shape): a prefix of a buffer kept across forwards
Feed = np.ndarray | tuple[np.ndarray, tuple[int, ...]]


class KVHolder(abc.ABC):
    """One way of holding an IR's KV cache; the runtime feeds and reads the compiled model."""

    name: ClassVar[str]
    static: ClassVar[bool] = False  # shapes fixed at load (capacity and width)
    # attention keys and queries padded (openvino/graph.py): exact under dynamic int8 activations
    padded: ClassVar[bool] = False
    # any width and the cache outside the plugin: forwards may pad rows or run on a second copy
    dynamic: ClassVar[bool] = False
    new_rows: ClassVar[bool] = True  # it reads the IR's new_* outputs after each forward
    # the plugin may quantize activations (None: where that is exact, or the precision rounds anyway)
    quantize: ClassVar[bool | None] = None

    def __init__(self, layout: KVLayout, plan: KVPlan, request) -> None:
        self.layout, self.plan, self._n = layout, plan, 0

    @classmethod  # noqa: B027 - a holder that feeds the IR as exported rewrites nothing
    def prepare(cls, model, layout: KVLayout, plan: KVPlan) -> None:
        """Rewrite `model` in place, before it is compiled, into what this holder feeds."""

    @property
    def n_past(self) -> int:
        return self._n

    def reserve(self, total: int) -> None:
        """Room for `total` positions, or ContextFullError with the cache unchanged."""
        if total > self.plan.capacity:
            raise ContextFullError(f"the context is full: the KV cache holds at most {self.plan.capacity} "
                                   f"positions (kv_capacity); this sequence needs {total}")

    @abc.abstractmethod
    def feed(self, token_ids: Sequence[int], n_logits: int) -> dict[str, Feed]:
        """The inputs of a forward appending `token_ids` (room reserved first): an array, or
        (buffer, shape), the first prod(shape) elements of a C-contiguous buffer the holder keeps
        (the runtime then wraps the buffer once and only reshapes it per forward)."""

    def pieces(self, n_new: int) -> list[int]:
        """How a forward of `n_new` tokens runs: the sizes of consecutive forwards (one by default)."""
        return [n_new]

    def commit(self, new: list[tuple[np.ndarray, np.ndarray]], n_new: int) -> None:
        """After a forward of `n_new` tokens: keep them; `new` holds each layer's (K, V) output rows."""
        self._n += n_new

    def abort(self, n_past: int) -> None:  # noqa: B027 - a buffer is written only after success
        """After a forward failed: hold the first `n_past` positions, as before it."""

    def rows(self, logits: np.ndarray, n_new: int, n_logits: int) -> np.ndarray:
        """The last `n_logits` new positions' rows of a forward's logits (a view)."""
        return logits[:n_logits]

    def trim(self, n_past: int) -> None:
        """Hold only the first `n_past` positions (n_past <= self.n_past)."""
        self._n = n_past

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes the cache holds now."""

    def close(self) -> None:  # noqa: B027 - optional: only holders of arrays free them
        """Let go of the cache."""


def dynamic_inputs(token_ids: Sequence[int], n_past: int, n_logits: int, rows: int) -> dict[str, np.ndarray]:
    """A dynamic-shape forward's token inputs: `token_ids` after `n_past` positions, of which the
    first `rows` are kept (the rest is padding), logits for the last `n_logits` kept rows."""
    S = len(token_ids)
    return {"input_ids": np.asarray([token_ids], dtype=np.int64),
            "position_ids": np.arange(n_past, n_past + S, dtype=np.int64)[None],
            "attention_mask": np.ones((1, n_past + S), dtype=np.int64),
            # a padded forward's head takes two rows where one is asked: its one-row kernel rounds apart too
            "logits_index": np.arange(rows - n_logits, rows + (S > rows and n_logits == 1), dtype=np.int64)}


def window_pieces(n_past: int, n_new: int, window: KVWindow) -> list[int]:
    """The sizes of the consecutive forwards that append `n_new` tokens after `n_past` so that
    every row binds the window start its position would decoded alone (KVWindow.start): a cut
    wherever the start moves.

    OpenVINO's CPU MatMul sums probabilities @ V in an order that follows the number of key
    columns once a window holds more keys than one of its blocks (removing some whole numbers of
    aligned masked leading columns moves bits, others do not, and it changes with the row count),
    so no alignment alone makes a row whose forward starts its window an aligned block earlier
    round like the same position decoded alone. With the cut, a verify's rows and their decodes
    bind the same start, and their key counts differ only by the trailing padding, as over the
    whole cache. The alignment keeps the cuts rare: a verify straddles a move once in `align`
    positions."""
    sizes, pos, end = [], n_past, n_past + n_new
    while pos < end:
        # the next position whose window starts one aligned block later
        step = (max(0, pos - window.size + 1) // window.align + 1) * window.align + window.size - 1
        nxt = min(end, step)
        sizes.append(nxt - pos)
        pos = nxt
    return sizes


def cut_every(n_past: int, sizes: Sequence[int], every: int) -> list[int]:
    """`sizes` (consecutive forwards after `n_past`) cut again wherever a piece passes a multiple
    of `every`: a window-sized buffer takes at most WINDOW_FORWARD rows a forward, and the cuts
    fall where the decoder's chunked prefill cuts the same ids."""
    out, pos = [], n_past
    for size in sizes:
        end = pos + size
        while pos < end:
            nxt = min(end, (pos // every + 1) * every)
            out.append(nxt - pos)
            pos = nxt
    return out


class _Buffers(KVHolder):
    """K and V arrays per layer, slot j = position j: stale rows past n_past are never read."""

    def __init__(self, layout: KVLayout, plan: KVPlan, request) -> None:
        super().__init__(layout, plan, request)
        self._buf = self._alloc(self._first_size(), [])

    def _first_size(self) -> int:
        return self.plan.capacity

    def _alloc(self, capacity: int, old: list[np.ndarray]) -> list[np.ndarray]:
        # committed as written: memory follows the context actually used (lazy_zeros)
        buf = [lazy_zeros(self.layout.shape(capacity)) for _ in range(2 * self.layout.n_layers)]
        for new, prev in zip(buf, old):
            new[:, :, :self._n] = prev[:, :, :self._n]
        self._nbytes = sum(b.nbytes for b in buf)  # nbytes() runs with every streamed Response
        return buf

    def _base_of(self, j: int) -> int:
        """The position row 0 of layer j's buffers holds."""
        return 0

    def commit(self, new: list[tuple[np.ndarray, np.ndarray]], n_new: int) -> None:
        for j, (k, v) in enumerate(new):
            at = self._n - self._base_of(j)
            self._buf[2 * j][:, :, at:at + n_new] = k[:, :, :n_new]
            self._buf[2 * j + 1][:, :, at:at + n_new] = v[:, :, :n_new]
        super().commit(new, n_new)

    def nbytes(self) -> int:
        return self._nbytes

    def close(self) -> None:
        self._buf, self._nbytes = [], 0


class DynamicBufferKV(_Buffers):
    """Grows by doubling up to the capacity; a forward is fed the held prefix. With window-sized
    sliding buffers (plan.sliding_rows), a sliding layer's row r holds position base + r."""

    name = "buffer"
    padded = dynamic = True

    @classmethod
    def prepare(cls, model, layout: KVLayout, plan: KVPlan) -> None:
        # only a buffer can leave padded keys out of the cache (OpenVINO's state would keep them)
        pad_keys(model)
        if plan.window is not None:  # after pad_keys: the sliding masks are cut from the padded ones
            window_keys(model, plan.window.layers)
        pad_queries(model)

    def __init__(self, layout: KVLayout, plan: KVPlan, request) -> None:
        # set before the first allocation, which sizes the sliding layers' buffers by it
        self._sliding = plan.window.layers if plan.sliding_rows and plan.window is not None else frozenset()
        self._base = 0  # the position a window-sized buffer's row 0 holds
        super().__init__(layout, plan, request)
        # the token inputs' buffers, kept: a forward writes its prefix (pad_rows: one row more)
        room = plan.capacity + 2
        self._ids, self._pos = np.zeros((1, room), dtype=np.int64), np.zeros((1, room), dtype=np.int64)
        self._mask, self._index = np.ones((1, room), dtype=np.int64), np.zeros(room, dtype=np.int64)
        # per sliding layer: (first row, K buffer, K view, V view), views of its buffers from the row of
        # the aligned start, kept while those stay (the runtime then only reshapes their Tensors)
        self._views: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray]] = {}

    def _first_size(self) -> int:
        return min(self.plan.capacity, _FIRST_CAPACITY)

    def _alloc(self, capacity: int, old: list[np.ndarray]) -> list[np.ndarray]:
        self._size = capacity  # rows of a full layer's buffers
        if not self._sliding:
            return super()._alloc(capacity, old)
        # a window-sized buffer is allocated once and never grows; the full layers' double
        buf = []
        for i in range(2 * self.layout.n_layers):
            if i // 2 in self._sliding:
                buf.append(old[i] if old else lazy_zeros(self.layout.shape(self.plan.sliding_rows)))
                continue
            new = lazy_zeros(self.layout.shape(capacity))
            if old:
                new[:, :, :self._n] = old[i][:, :, :self._n]
            buf.append(new)
        self._nbytes = sum(b.nbytes for b in buf)
        return buf

    def _base_of(self, j: int) -> int:
        return self._base if j in self._sliding else 0

    def reserve(self, total: int) -> None:
        super().reserve(total)
        if total > self._size:
            self._buf = self._alloc(min(max(total, 2 * self._size), self.plan.capacity), self._buf)

    def pieces(self, n_new: int) -> list[int]:
        if self.plan.window is None:
            return [n_new]
        sizes = window_pieces(self._n, n_new, self.plan.window)
        return cut_every(self._n, sizes, WINDOW_FORWARD) if self._sliding else sizes

    def _make_room(self, p: int, s: int) -> None:
        """Before a forward of `s` rows (padding included) at `p`: where they would pass the end of
        the window-sized buffers, move the rows from start(p - WINDOW_ROLLBACK) on to the front. The
        bound past stays one contiguous view, and its columns keep their aligned positions."""
        keep = self.plan.window.moved_base(self._base, self.plan.sliding_rows, p, s) if self._sliding else None
        if keep is None:
            return
        if s > WINDOW_FORWARD + self.plan.pad_rows:  # pieces() cuts every forward the runtime runs
            raise BackendError(f"a forward of {s} rows does not fit a window-sized KV buffer "
                               f"(at most {WINDOW_FORWARD + self.plan.pad_rows})")
        lo, hi = keep - self._base, p - self._base
        for i, buf in enumerate(self._buf):
            if i // 2 in self._sliding:
                buf[:, :, :hi - lo] = buf[:, :, lo:hi]  # numpy copies overlapping rows as if through a temporary
        self._base = keep

    def _window_views(self, j: int, first: int) -> tuple[np.ndarray, np.ndarray]:
        k, v = self._buf[2 * j], self._buf[2 * j + 1]
        held = self._views.get(j)
        if held is None or held[0] != first or held[1] is not k:
            held = self._views[j] = (first, k, k[:, :, first:], v[:, :, first:])
        return held[2], held[3]

    def feed(self, token_ids: Sequence[int], n_logits: int) -> dict[str, Feed]:
        S, n = len(token_ids), self._n
        self.reserve(n + S)
        # pad_rows: the last token once more at the next position, its outputs dropped, so no
        # forward multiplies one row: on CPUs whose one-row FullyConnected kernel rounds unlike
        # the taller one (AVX2 with int8/int4 weights), a decode then rounds like a verify's rows
        fed = S + self.plan.pad_rows
        self._make_room(n, fed)
        self._ids[0, :S] = token_ids
        self._ids[0, S:fed] = token_ids[-1]
        self._pos[0, :fed] = np.arange(n, n + fed)
        # as dynamic_inputs: a padded forward's head takes two rows where one is asked
        index = np.arange(S - n_logits, S + (fed > S and n_logits == 1))
        self._index[:len(index)] = index
        feed: dict[str, Feed] = {"input_ids": (self._ids, (1, fed)), "position_ids": (self._pos, (1, fed)),
                                 "attention_mask": (self._mask, (1, n + fed)),
                                 "logits_index": (self._index, (len(index),))}
        window = self.plan.window
        start = window.start(n) if window is not None else 0
        for j in range(self.layout.n_layers):
            k, v = self._buf[2 * j], self._buf[2 * j + 1]
            base = self._base_of(j)
            # buffer rows of the bound past: from the aligned start on a sliding layer, else whole
            first = (start if window is not None and j in window.layers else 0) - base
            if self.layout.kv_heads == 1:  # the rows are contiguous in the buffer: fed in place
                if first:
                    k, v = self._window_views(j, first)
                shape = self.layout.shape(n - base - first)
                feed[f"past_key_{j}"], feed[f"past_value_{j}"] = (k, shape), (v, shape)
            else:  # one run of rows per head: copied together
                feed[f"past_key_{j}"] = np.ascontiguousarray(k[:, :, first:n - base])
                feed[f"past_value_{j}"] = np.ascontiguousarray(v[:, :, first:n - base])
        return feed

    def trim(self, n_past: int) -> None:
        if self._sliding and not self.plan.window.holds(n_past, self._base):
            # the window-sized buffers no longer hold the keys a forward at n_past reads: hold
            # nothing, and the caller, which sees n_past fall to 0, feeds the prefix again
            self._n = self._base = 0
            return
        super().trim(n_past)

    def close(self) -> None:
        self._views = {}
        super().close()


class StaticKV(_Buffers):
    """Allocated once for the capacity; every forward feeds the whole buffer and `width` tokens."""

    name = "buffer"
    static = True

    @classmethod
    def prepare(cls, model, layout: KVLayout, plan: KVPlan) -> None:
        W, C = plan.width, plan.capacity
        shapes = {"input_ids": [1, W], "position_ids": [1, W], "attention_mask": [1, C + W], "logits_index": [W]}
        shapes.update({f"past_{kind}_{j}": list(layout.shape(C)) for j in range(layout.n_layers)
                       for kind in ("key", "value")})
        model.reshape(shapes)

    def feed(self, token_ids: Sequence[int], n_logits: int) -> dict[str, Feed]:
        S, n, W, C = len(token_ids), self._n, self.plan.width, self.plan.capacity
        self.reserve(n + S)
        if S > W:
            raise BackendError(f"OpenVINO static shapes take at most {W} tokens per forward, got {S}")
        ids = np.zeros((1, W), dtype=np.int64)
        ids[0, :S] = token_ids
        mask = np.zeros((1, C + W), dtype=np.int64)
        mask[0, :n] = 1  # rollback lives here: slots past n_past are simply not attended
        mask[0, C:C + S] = 1
        feed = {"input_ids": ids, "position_ids": np.arange(n, n + W, dtype=np.int64)[None],
                "attention_mask": mask, "logits_index": np.arange(W, dtype=np.int64)}
        for j in range(self.layout.n_layers):  # the whole buffers, the same every forward: bound once
            k, v = self._buf[2 * j], self._buf[2 * j + 1]
            feed[f"past_key_{j}"], feed[f"past_value_{j}"] = (k, k.shape), (v, v.shape)
        return feed

    def rows(self, logits: np.ndarray, n_new: int, n_logits: int) -> np.ndarray:
        return logits[n_new - n_logits:n_new]  # one row per slot of the width: the real tokens' last


# the holders a runtime takes by name (kv="buffer"); static shapes pick StaticKV
KV_KINDS: dict[str, type[KVHolder]] = {"buffer": DynamicBufferKV}


def plan_kv(device: str, precision: str, *, static: bool = False, kv: str | None = None,
            width: int | None = None, capacity: int | None = None, pad_rows: bool = False,
            wide: bool = False, window: KVWindow | None = None) -> KVPlan:
    """The holder and its settings for a model compiled for `device` in `precision`: static shapes
    where asked or on an NPU (which compiles nothing else); `kv` a name in KV_KINDS; pad_rows and
    wide only where the holder has dynamic shapes (and wide on the CPU, whose plugin re-prepares its
    graph per width). `window` (the IR's record, window_of) only for the dynamic buffer: static
    shapes bind one fixed size for every layer, and OpenVINO's state keeps the whole past; its
    sliding layers then hold window-sized buffers (KVWindow.rows) where those are smaller."""
    static = static or device.startswith("NPU")
    kind = _holder(kv, static)
    quantize = kind.quantize if kind.quantize is not None else kind.padded or precision != "f32"
    capacity = capacity or (DEFAULT_STATIC_CAPACITY if static else DEFAULT_KV_CAPACITY)
    pad_rows = pad_rows and kind.dynamic
    window = window if issubclass(kind, DynamicBufferKV) else None
    return KVPlan(kind, capacity, max(int(width or 1), 1) if static else None, pad_rows,
                  wide and kind.dynamic and device.startswith("CPU"), quantize, window,
                  _sliding_rows(window, pad_rows, capacity))


def _holder(kv: object, static: bool) -> type[KVHolder]:
    """The holder named `kv` (default "buffer"), StaticKV for the buffer with static shapes."""
    kind = KV_KINDS.get(kv or "buffer") if isinstance(kv, str) or kv is None else None
    if static and kind is DynamicBufferKV:
        kind = StaticKV
    if kind is None or static != kind.static:
        raise BackendError(f"OpenVINO: kv must be one of {', '.join(KV_KINDS)} ('buffer' with static shapes), "
                           f"got {kv!r}")
    return kind


def _sliding_rows(window: KVWindow | None, pad_rows: bool, capacity: int) -> int | None:
    """KVPlan.sliding_rows: window-sized buffers for the sliding layers where they are smaller
    than the capacity; None where every layer holds the capacity."""
    rows = window.rows(int(pad_rows)) if window is not None else None
    return rows if rows is not None and rows < capacity else None
