"""Token Recycling (Luo et al., 2025, arXiv 2408.08696): draft from what the target predicted before.

Every verify (and every plain step) computes the target's logits after each token it scores.
Their top-k ids are kept in an adjacency table, one row per token: "after t the target last
ranked these k tokens highest". A draft is the chain of top-1 successors from the last committed
token. The table costs no forward of its own, lives as long as the drafter (an engine keeps its
decoder, so a later generation starts warm), and drafting is a few table reads.

The paper drafts a static tree (top-k at each depth) and verifies it in one forward with a tree
attention mask. Every runtime here verifies a linear chain (no tree mask in the graphs), so this
drafter proposes the chain only; the other k - 1 columns are kept for a tree verifier.

Drafts are deterministic: they are accepted as point masses, so greedy output equals plain
decoding and sampling stays exact (acceptance.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from edgespec.decoding.draft import Draft, Drafter
from edgespec.errors import ConfigError

__all__ = ["STRIDE", "SUCCESSORS", "RecyclingDrafter", "SuccessorTable", "top_successors"]

logger = logging.getLogger(__name__)

SUCCESSORS = 8  # k: successors kept per token (the paper's adjacency matrix width)
# top_successors samples every STRIDE-th logit for its threshold: over 262144 logits the sample
# is 2048 wide, and the rows above its threshold a few hundred (measured ~0.1 ms a row against
# ~0.5 ms for np.argpartition over the whole row, 2-vCPU AMD EPYC)
STRIDE = 128


def top_successors(logits: np.ndarray, k: int, stride: int = STRIDE) -> np.ndarray:
    """(rows, k) int ids of each row's k largest logits, largest first (exact, ties in any order).

    Exact without a partition of the whole row: the k-th largest of every `stride`-th logit is a
    lower bound of the row's k-th largest (the sample's top k are k logits of the row at least that
    large), so the row's top k are among the logits >= it; one comparison pass finds those few."""
    logits = np.asarray(logits)
    rows, vocab = logits.shape
    k = min(k, vocab)
    if stride <= 1 or vocab // stride < k:  # too few samples for a bound
        top = np.argpartition(logits, vocab - k, axis=1)[:, vocab - k:]
        order = np.argsort(-np.take_along_axis(logits, top, axis=1), axis=1, kind="stable")
        return np.take_along_axis(top, order, axis=1)
    bound = np.partition(logits[:, ::stride], -k, axis=1)[:, -k]
    out = np.empty((rows, k), dtype=np.int64)
    for i, row in enumerate(logits):
        ids = np.flatnonzero(row >= bound[i])  # at least k: the sample's own top k
        values = row[ids]
        top = np.argpartition(values, len(values) - k)[len(values) - k:]
        out[i] = ids[top[np.argsort(-values[top], kind="stable")]]
    return out


class SuccessorTable:
    """Each token's k most likely successors as the target last ranked them: int32 (vocab, k),
    -1 where a token was never scored (about 8 MB for a 262144 vocab at k = 8)."""

    def __init__(self, vocab: int, k: int = SUCCESSORS, stride: int = STRIDE) -> None:
        for name, v in (("vocab", vocab), ("k", k), ("stride", stride)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"successor table {name} must be an integer >= 1, got {v!r}")
        self.k, self.stride = min(k, vocab), stride
        self.rows = np.full((vocab, self.k), -1, dtype=np.int32)
        self.updates = 0  # rows written so far

    def update(self, tokens: list[int], logits: np.ndarray) -> np.ndarray:
        """Row i of `logits` follows `tokens[i]`; a later row for the same token wins (its context
        is the newer). Returns each row's top k, (len(tokens), k)."""
        if len(tokens) != len(logits):
            raise ValueError(f"{len(tokens)} tokens for {len(logits)} logit rows")
        top = top_successors(logits, self.k, self.stride)
        for token, successors in zip(tokens, top):
            self.rows[token] = successors
        self.updates += len(tokens)
        return top

    def chain(self, start: int, n: int) -> list[int]:
        """Up to `n` ids following top-1 successors from `start`; it ends at a token never scored."""
        out: list[int] = []
        token = start
        while len(out) < n:
            token = int(self.rows[token, 0])
            if token < 0:
                break
            out.append(token)
        return out


class RecyclingDrafter(Drafter):
    """Token Recycling with chain drafts (see the module docstring). The policy sizes the chain
    like any other drafter's, from its measured cost (table reads, ~0) and acceptance."""

    source = "recycle"

    def __init__(self, vocab: int, k: int = SUCCESSORS, clock: Callable[[], float] = time.perf_counter) -> None:
        self.table = SuccessorTable(vocab, k)
        self.clock = clock
        self._drafted = False  # whether the step now being verified is this drafter's

    def propose(self, tokens, limit, policy, params, rng) -> Draft:
        t0 = self.clock()
        n = min(policy.next_k(self.source), limit)
        found = self.table.chain(tokens[-1], n) if n > 0 else []
        self._drafted = bool(found)
        if not found:
            return Draft([])
        return Draft(found, None, self.source, 1e3 * (self.clock() - t0) / len(found))

    def observe(self, tokens: list[int], logits: np.ndarray) -> list[tuple[str, int, int]]:
        # a step another drafter (or nobody) drafted still tells whether this one's first token
        # would have been the target's: a free trial, so a policy that stopped drafting from the
        # table learns when it pays again without spending verifies on probes
        guess = int(self.table.rows[tokens[0], 0])
        drafted, self._drafted = self._drafted, False
        top = self.table.update(tokens, logits)
        if drafted or guess < 0:
            return []
        return [(self.source, 1, int(guess == top[0, 0]))]
