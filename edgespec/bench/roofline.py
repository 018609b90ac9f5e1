"""A bench run's roofline: what each kind of forward reads, how long it takes, and how far that is
from what the machine's memory can deliver.

For the target's plain step, its verify at each width and one drafted token: the weight bytes one
forward reads whole (`Runtime.streamed`: every product's weights; a gathered table only by rows),
the forward's time (the bench's c(B) measurement), the bandwidth that implies, and its share of the
read bandwidth measured here with the engine's thread count. A forward far below that share is
held back by its kernels (compute, launches, copies), not by its bytes; one near it cannot get
much faster without reading fewer bytes. docs/bench.md shows how to read it.
"""
from __future__ import annotations

import threading
import time

import numpy as np

__all__ = ["BANDWIDTH_BYTES", "bandwidths", "describe", "read_bandwidth", "roofline"]

# the buffer the read bandwidth is measured on: larger than any CPU's last-level cache
BANDWIDTH_BYTES = 256 << 20
_PASSES = 5


def read_bandwidth(threads: int, nbytes: int = BANDWIDTH_BYTES, passes: int = _PASSES) -> float:
    """GB/s of `threads` threads each summing its share of one `nbytes` buffer (numpy releases
    the GIL while it sums), the best of `passes` passes after one that faults the pages in."""
    buf = np.ones(max(nbytes // 4, threads), dtype=np.float32)
    parts = np.array_split(buf, max(threads, 1))
    times = []
    for i in range(passes + 1):
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if i:
            times.append(time.perf_counter() - t0)
    return buf.nbytes / min(times) / 1e9


def _row(role: str, width: int, ms: float | None, streamed, bandwidth: float) -> dict:
    """One forward's figures; bytes and bandwidth are None where the runtime cannot tell."""
    weights = None if streamed is None else streamed.weights
    gb_s = None if weights is None or not ms else weights / (ms * 1e6)
    return {"role": role, "width": width, "ms": None if ms is None else round(ms, 3), "weights_bytes": weights,
            "ops": None if streamed is None else streamed.ops, "gb_s": None if gb_s is None else round(gb_s, 2),
            "of_bandwidth": None if gb_s is None else round(gb_s / bandwidth, 3)}


def roofline(target, draft, costs: dict | None, bandwidth: dict[str, float]) -> dict | None:
    """The roofline of one engine: `target` and `draft` are their runtimes' Streamed (or None),
    `costs` the bench's c(B) measurement (costs.py, with `draft_ms` when it timed a drafted
    token), `bandwidth` {"1": GB/s, "<threads>": GB/s}. Rows share the widest measured
    bandwidth. None without timings."""
    if costs is None:
        return None
    best = max(bandwidth.values())
    ms = {int(b): v for b, v in costs["ms"].items()}
    rows = [_row("plain" if b == 1 else "verify", b, v, target, best) for b, v in sorted(ms.items())]
    out = {"bandwidth_gb_s": {k: round(v, 2) for k, v in bandwidth.items()}, "rows": rows}
    if costs.get("draft_ms") is not None:
        rows.append(_row("draft", 1, costs["draft_ms"], draft, best))
        out["draft_of_plain"] = round(costs["draft_ms"] / ms[1], 3)
    return out


def describe(doc: dict) -> list[str]:
    """One line a row, for the bench's console."""
    lines = []
    for r in doc["rows"]:
        size = "?" if r["weights_bytes"] is None else f"{r['weights_bytes'] / 1e6:.0f} MB"
        rate = "" if r["gb_s"] is None else f", {r['gb_s']:.1f} GB/s ({100 * r['of_bandwidth']:.0f}% of memory's)"
        ops = "" if r["ops"] is None else f", {r['ops']} operators"
        lines.append(f"{r['role']} x{r['width']}: {r['ms']:.2f} ms, {size}{rate}{ops}")
    return lines


def bandwidths(threads: int) -> dict[str, float]:
    """{"1": one thread's read bandwidth, "<threads>": the engine's thread count's}, in GB/s."""
    return {str(t): read_bandwidth(t) for t in sorted({1, max(threads, 1)})}
