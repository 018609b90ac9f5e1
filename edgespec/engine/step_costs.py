"""c(B): what a B-token verify of the target costs over a one-token forward, measured on the
runtimes as opened (the tuner's figures, tuning.py; the bench's curve, bench/costs.py).

Each B-token verify runs after a prefix already in the cache; a draft on the target's body is fed
the B-1 drafted tokens first (so it has computed their rows, as in a real step), and one drafted
token is timed too where a draft model is given. Widths run interleaved, with fresh ids every
repeat (a shared body would reuse rows of ids it has seen); the caches are left empty.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median

import numpy as np

from ..errors import EdgespecError
from ..runtimes import Runtime

__all__ = ["verify_costs", "WIDTHS", "PREFIX", "REPEATS"]

logger = logging.getLogger(__name__)

WIDTHS = (1, 2, 4, 8)  # the bench's c(B) widths
PREFIX = 64  # positions already cached: a verify never starts from an empty cache
REPEATS = 5


def verify_costs(rt: Runtime, widths: Sequence[int] = WIDTHS, prefix: int = PREFIX, repeats: int = REPEATS, *,
                 draft: Runtime | None = None, shared_body: bool = False,
                 stat: Callable[[list[float]], float] = median) -> dict | None:
    """c(B) of the runtime `rt`: {"one_token_ms", "ms": {B: ms}, "c": {B: cost over one token},
    "prefix", "repeats"}, or None where it cannot be measured (static shapes, no trim). With a
    `draft` runtime, "draft_ms", one drafted token, is measured too; `shared_body`: the draft runs
    on `rt`'s body (engine.opened.shared_body), so each B-token verify follows B-1 drafted tokens
    fed to it. `stat` (median) of the repeats."""
    caps = rt.capabilities
    if not caps.can_trim or caps.static_shapes:
        return None  # static shapes pad every forward to one width: no curve to measure
    widths = sorted({1, *widths})
    prefix = _prefix(prefix, max(widths), rt, draft)
    if prefix < 1:
        return None
    run = _Forwards.of(rt, draft, feed=shared_body and draft is not None, prefix=prefix)
    try:
        samples, drafted = _sample(run, widths, repeats)
    except EdgespecError as e:
        logger.warning("c(B) not measured: %s", e)
        return None
    finally:
        run.reset()
    return _figures(samples, drafted, stat, prefix, repeats)


def _prefix(prefix: int, top: int, rt: Runtime, draft: Runtime | None) -> int:
    """The cached positions a verify of `top` tokens still fits after, in every cache measured."""
    for cap in (rt.kv_capacity, draft.kv_capacity if draft is not None else None):
        if cap is not None:
            prefix = min(prefix, cap - top - 1)
    return prefix


@dataclass(frozen=True)
class _Forwards:
    """The runtimes one measurement times and its source of fresh ids."""

    target: Runtime
    draft: Runtime | None
    feed: bool  # the draft runs on the target's body: only then do its drafts change what a verify computes
    prefix: int
    rng: np.random.Generator
    low: int  # the first ids are often special tokens: drawn from low..vocab
    vocab: int

    @classmethod
    def of(cls, rt: Runtime, draft: Runtime | None, *, feed: bool, prefix: int) -> _Forwards:
        vocab = min(rt.vocab_size, draft.vocab_size) if draft is not None else rt.vocab_size
        return cls(rt, draft, feed, prefix, np.random.default_rng(0), min(16, max(vocab - 1, 0)), vocab)

    @property
    def models(self) -> list[Runtime]:
        return [m for m in (self.target, self.draft) if m is not None]

    def ids(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(self.low, self.vocab, size=n)]

    def start(self) -> None:
        """Every cache emptied, then holding the same prefix."""
        ids = self.ids(self.prefix)
        for m in self.models:
            m.reset()
            m.forward(ids, n_logits=1)

    def verify(self, b: int) -> float:
        """Seconds of one b-token verify (after its b-1 drafts, fed untimed to a draft on the
        target's body); the caches back to the prefix."""
        new = self.ids(b)
        if self.feed and b > 1:
            self.draft.forward(new[:b - 1], n_logits=1)
        t0 = time.perf_counter()
        self.target.forward(new, n_logits=b)  # a verify needs every row's logits
        dt = time.perf_counter() - t0
        self._trim()
        return dt

    def drafted(self) -> float:
        """Seconds of one drafted token, on an id the target has not seen; the caches back to the prefix."""
        t0 = time.perf_counter()
        self.draft.forward([int(self.rng.integers(self.low, self.vocab))], n_logits=1)
        dt = time.perf_counter() - t0
        self._trim()
        return dt

    def _trim(self) -> None:
        for m in self.models:
            m.trim(self.prefix)

    def reset(self) -> None:
        for m in self.models:
            m.reset()


def _sample(run: _Forwards, widths: list[int], repeats: int) -> tuple[dict[int, list[float]], list[float]]:
    """Seconds per verify width, and per drafted token (none without a draft), over `repeats`
    interleaved passes after one that warms every width up (allocations) and is dropped."""
    samples: dict[int, list[float]] = {b: [] for b in widths}
    drafted: list[float] = []
    run.start()
    for rep in range(repeats + 1):
        for b in widths:
            dt = run.verify(b)
            if rep:
                samples[b].append(dt)
            if run.draft is not None and b == 1:
                dt = run.drafted()
                if rep:
                    drafted.append(dt)
    return samples, drafted


def _figures(samples: dict[int, list[float]], drafted: list[float], stat: Callable[[list[float]], float],
             prefix: int, repeats: int) -> dict:
    ms = {b: 1e3 * stat(s) for b, s in samples.items()}
    out = {"one_token_ms": round(ms[1], 3), "ms": {str(b): round(v, 3) for b, v in ms.items()},
           "c": {str(b): round(v / ms[1], 3) for b, v in ms.items() if b != 1}, "prefix": prefix, "repeats": repeats}
    if drafted:
        out["draft_ms"] = round(1e3 * stat(drafted), 3)
    return out
