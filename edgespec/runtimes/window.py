"""Sliding-window attention's record and its aligned start, shared by the backends that bind a
sliding layer's past shorter than the others (runtimes/onnxruntime/kv.py, runtimes/openvino/kv.py;
docs/long-context.md)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WINDOW_FORWARD", "WINDOW_ROLLBACK", "KVWindow", "sliding_kv", "window_start"]

# a sliding layer's buffer takes forwards of up to WINDOW_FORWARD rows (wider ones run in pieces
# that end at its multiples, as the decoder's chunked prefill does) and keeps WINDOW_ROLLBACK rows
# before the window of the last move, so that a rejected draft's rollback (a draft model's spans a
# few one-token forwards) stays exact; the memory planner's prefill chunk is at most WINDOW_FORWARD
WINDOW_FORWARD, WINDOW_ROLLBACK = 256, 64


def window_start(n_past: int, window: int, align: int) -> int:
    """The first position a sliding layer's past is bound from, for a forward whose first new
    position is `n_past`: the first key its window can see, n_past - window + 1, rounded down to a
    multiple of `align`.

    A verify row and the same position decoded alone must sum the same terms in the same order.
    Starting every forward exactly at its first query's window would move a position's key to
    another column in each (a verify's earlier rows need earlier keys), and onnxruntime's Softmax
    sums in SIMD lanes by column, its SGEMM sums P @ V in depth slices by column (OpenVINO's
    P @ V needs more: runtimes/openvino/kv.window_pieces): the sums would
    round apart. Rounded down to a multiple of `align` (chosen by the exporter for the head size,
    exporters/onnx/masks.window_align), the two start a whole number of aligned blocks apart: the
    extra leading columns are masked (exact zeros, summed before any real term) and every real key
    keeps its lane and its slice. The exactness probe checks the machine at hand."""
    return max(0, n_past - window + 1) // align * align


@dataclass(frozen=True)
class KVWindow:
    """A graph's sliding-window layers, whose pasts are bound from `window_start` on."""

    size: int  # keys a sliding layer's query sees, itself included
    align: int  # the bound past's first position is a multiple of this
    layers: frozenset[int]  # j of past_key_<j> / past_value_<j>

    def __post_init__(self) -> None:
        if self.size < 1 or self.align < 1 or not self.layers:
            raise ValueError(f"bad sliding window: {self}")

    def start(self, n_past: int) -> int:
        return window_start(n_past, self.size, self.align)

    def rows(self, pad: int) -> int:
        """Rows a sliding layer's buffer holds: after a move before a forward at P, the rows from
        start(P - WINDOW_ROLLBACK) (at most rollback + size + align - 2 of them) and the forward's."""
        return WINDOW_ROLLBACK + self.size + self.align + WINDOW_FORWARD + pad

    def moved_base(self, base: int, rows: int, p: int, s: int) -> int | None:
        """Before a forward of `s` rows at position `p` into window-sized buffers of `rows` rows
        whose row 0 holds position `base`: the position the live rows move to row 0 from,
        start(p - WINDOW_ROLLBACK), where the forward would pass the end; None where it fits."""
        return None if p + s <= base + rows else self.start(max(0, p - WINDOW_ROLLBACK))

    def holds(self, n_past: int, base: int) -> bool:
        """Whether buffers whose row 0 holds position `base` still hold every key a forward at
        `n_past` reads (a trim back to n_past is exact); if not, they must be filled again."""
        return self.start(n_past) >= base


def sliding_kv(window: KVWindow | None, n_layers: int, rows: int | None) -> tuple[float, int]:
    """(share of a position's KV bytes on `window`'s layers, the rows each of their window-sized
    buffers holds), what the memory planner counts once rather than per position: (0.0, 0) with no
    window or whole buffers (rows None)."""
    if window is None or rows is None:
        return 0.0, 0
    return len(window.layers) / n_layers, rows
