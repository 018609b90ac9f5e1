"""c(B): what a B-token forward of the target costs over a one-token forward, measured.

A speculative step verifies k drafts in one forward of k+1 tokens; it pays when the tokens it
commits outnumber c(k+1). Devices differ most in this curve (a GPU-less ARM core pays nearly B
times, a wide AVX-512 core far less), so the bench records it for fleet comparisons.

Widths run interleaved, each repeat from the same cached prefix (trimmed back after every
forward); the medians are kept.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from statistics import median

import numpy as np

from ..errors import EdgespecError

__all__ = ["verify_costs", "WIDTHS"]

logger = logging.getLogger(__name__)

WIDTHS = (1, 2, 4, 8)
PREFIX = 64  # positions already cached: a verify never starts from an empty cache
REPEATS = 5


def verify_costs(rt, widths: Sequence[int] = WIDTHS, prefix: int = PREFIX, repeats: int = REPEATS) -> dict | None:
    """{"one_token_ms", "ms": {B: ms}, "c": {B: cost over one token}, "prefix", "repeats"} for the
    runtime `rt`, or None where it cannot be measured (a static-shape or untrimmable runtime).
    Leaves the cache empty."""
    caps = rt.capabilities
    if not caps.can_trim or caps.static_shapes:
        return None  # static shapes pad every forward to one width: no curve to measure
    if 1 not in widths:
        widths = (1, *widths)
    top = max(widths)
    if rt.kv_capacity is not None:
        prefix = min(prefix, rt.kv_capacity - top)
        if prefix < 1:
            return None
    rng = np.random.default_rng(0)
    low = min(16, max(rt.vocab_size - 1, 0))  # the first ids are often special tokens
    ids = [int(t) for t in rng.integers(low, rt.vocab_size, size=prefix + top)]
    samples: dict[int, list[float]] = {b: [] for b in widths}
    try:
        rt.reset()
        rt.forward(ids[:prefix], n_logits=1)
        for rep in range(repeats + 1):  # the first pass warms every width up (allocations) and is dropped
            for b in widths:
                t0 = time.perf_counter()
                rt.forward(ids[prefix:prefix + b], n_logits=b)  # a verify needs every row's logits
                dt = time.perf_counter() - t0
                rt.trim(prefix)
                if rep:
                    samples[b].append(dt)
    except EdgespecError as e:
        logger.warning("c(B) not measured: %s", e)
        return None
    finally:
        rt.reset()
    ms = {b: 1e3 * median(s) for b, s in samples.items()}
    return {"one_token_ms": round(ms[1], 3), "ms": {str(b): round(v, 3) for b, v in ms.items()},
            "c": {str(b): round(v / ms[1], 3) for b, v in ms.items() if b != 1},
            "prefix": prefix, "repeats": repeats}
