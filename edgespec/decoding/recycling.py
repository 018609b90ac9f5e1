"""Token Recycling (Luo et al., 2025, arXiv 2408.08696): draft from what the target predicted before.

Every verify (and every plain step) computes the target's logits after each token it scores.
Their top-k ids are kept in an adjacency table, one row per token: "after t the target last
ranked these k tokens highest". A draft is the chain of top-1 successors from the last committed
token. The table costs no forward of its own, lives as long as the drafter (an engine keeps its
decoder, so a later generation starts warm), and drafting is a few table reads.

The paper drafts a static tree (top-k at each depth) and verifies it in one forward with a tree
attention mask. Where the target can (a bundle exported with `--tree`: exporters/onnx/tree.py,
Capabilities.trees), this drafter weighs the trees of tree.py's menu against chains: it keeps how
often the target's token was the table's first, second, ... successor (free: every verified row
tells), and the policy's measured cost of each verify width, and drafts the shape with the most
expected tokens per cost. Elsewhere it drafts chains.

Drafts are deterministic: they are accepted as point masses, so greedy output equals plain
decoding and sampling stays exact (acceptance.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from edgespec.checks import integer, is_int
from edgespec.decoding.draft import Draft, Drafter
from edgespec.decoding.tree import DraftTree, best_shape, shape_size

__all__ = ["STRIDE", "SUCCESSORS", "RecyclingDrafter", "SuccessorTable", "recycled_tree", "top_successors"]

logger = logging.getLogger(__name__)

SUCCESSORS = 8  # k: successors kept per token (the paper's adjacency matrix width)
# top_successors samples every STRIDE-th logit for its threshold: over 262144 logits the sample
# is 2048 wide, and the rows above its threshold a few hundred: several times cheaper than
# np.argpartition over the whole row
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
    -1 where a token was never scored (small next to the model even for a large vocabulary)."""

    def __init__(self, vocab: int, k: int = SUCCESSORS, stride: int = STRIDE) -> None:
        for name, v in (("vocab", vocab), ("k", k), ("stride", stride)):
            integer(v, f"successor table {name}", least=1)
        self.k, self.stride = min(k, vocab), stride
        self.rows = np.full((vocab, self.k), -1, dtype=np.int32)
        self.updates = 0  # rows written so far

    def clear(self) -> None:
        """Forget every successor (in place: the table keeps its memory)."""
        self.rows.fill(-1)
        self.updates = 0

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


def recycled_tree(table: SuccessorTable, root_token: int, widths: Sequence[int]) -> DraftTree:
    """A static tree from the successor table: every node at depth d takes the first widths[d] ids
    of its token's row (best first), skipping an id a sibling already holds.

    Reads the table as `SuccessorTable.chain` does: a token never scored (-1) ends its branch, so
    the tree may be smaller than its shape; widths (1,) * n give that chain. Nodes are stored
    depth first: the first-children path, the likeliest, is rows 0..d as in a chain verify (the
    runtime moves any other accepted path's rows there: Runtime.keep_rows)."""
    if not all(is_int(w) and 1 <= w <= table.k for w in widths):
        raise ValueError(f"tree widths must be integers in 1..{table.k} (the table's k), got {list(widths)}")
    if not 0 <= root_token < len(table.rows):
        raise ValueError(f"root token {root_token} is outside the table's vocabulary of {len(table.rows)}")
    tokens: list[int] = []
    parents: list[int] = []

    def grow(node: int, token: int, depth: int) -> None:
        if depth == len(widths):
            return
        taken: set[int] = set()
        for successor in table.rows[token, : widths[depth]].tolist():
            if successor >= 0 and successor not in taken:
                taken.add(successor)
                tokens.append(successor)
                parents.append(node)
                grow(len(tokens), successor, depth + 1)

    grow(0, int(root_token), 0)
    return DraftTree(tuple(tokens), tuple(parents))


class RecyclingDrafter(Drafter):
    """Token Recycling (see the module docstring). The policy sizes a chain like any other
    drafter's, from its measured cost (table reads, ~0) and acceptance; with `trees`, a tree of
    tree.py's menu is drafted instead where it promises more tokens per cost (`shape`: always
    that shape, for tests and benchmarks)."""

    source = "recycle"
    tree_source = "recycle:tree"  # the policy's key for tree steps: its own acceptance, recycle's costs
    MAX_NODES = 16  # the widest tree considered: the exactness probe's widths stop at 17 rows
    RANK_DECAY = 0.98  # per scored row: the rank statistics follow the text (~50 rows)

    def __init__(self, vocab: int, k: int = SUCCESSORS, clock: Callable[[], float] = time.perf_counter,
                 trees: bool = False, shape: tuple[int, ...] | None = None) -> None:
        self.table = SuccessorTable(vocab, k)
        self.clock = clock
        self.trees, self.shape = trees or shape is not None, shape
        # decayed counts: rows whose target token was the table's r-th successor, and rows scored
        self._ranks, self._scored = np.zeros(self.table.k), 0.0
        self._drafted = False  # whether the step now being verified is this drafter's

    def forget(self) -> None:
        self.table.clear()
        self._ranks, self._scored = np.zeros(self.table.k), 0.0
        self._drafted = False

    def reach(self) -> list[float]:
        """Estimated probability that the target's next token is among a row's first 1..k successors
        (a prior of one half of one row for the top-1, as the policy's)."""
        return list((np.cumsum(self._ranks) + 0.5) / (self._scored + 1.0))

    def propose(self, tokens, limit, policy, params, rng) -> Draft:
        t0 = self.clock()
        n = min(policy.next_k(self.source), limit)
        if n <= 0:
            self._drafted = False
            return Draft([])
        shape = self._shape(policy, limit, n)
        if shape is not None:
            tree = recycled_tree(self.table, tokens[-1], shape)
            self._drafted = tree.n > 0
            if tree.n and any(p != i for i, p in enumerate(tree.parents)):
                return Draft(list(tree.tokens), None, self.tree_source, 1e3 * (self.clock() - t0) / tree.n,
                             tree=tree)
        found = self.table.chain(tokens[-1], n)
        self._drafted = bool(found)
        if not found:
            return Draft([])
        return Draft(found, None, self.source, 1e3 * (self.clock() - t0) / len(found))

    def _shape(self, policy, limit: int, k: int) -> tuple[int, ...] | None:
        """A tree shape to draft, or None for the policy's chain of k."""
        if not self.trees or limit < 2:
            return None
        if self.shape is not None:
            return self.shape if shape_size(self.shape) <= limit else None
        max_nodes = min(limit, self.MAX_NODES)
        costs = policy.verify_costs(self.source, max_nodes + 1)
        if costs is None:  # a policy that does not measure costs: its chain
            return None
        best = best_shape(self.reach(), costs, max_nodes)
        return None if set(best) == {1} else best

    def observe(self, tokens: list[int], logits: np.ndarray) -> list[tuple[str, int, int]]:
        # a step another drafter (or nobody) drafted still tells whether this one's first token
        # would have been the target's: a free trial, so a policy that stopped drafting from the
        # table learns when it pays again without spending verifies on probes
        guess = int(self.table.rows[tokens[0], 0])
        drafted, self._drafted = self._drafted, False
        before = self.table.rows[np.asarray(tokens)] if self.trees else None
        top = self.table.update(tokens, logits)
        if before is not None:  # only shape choices read the ranks: chains pay nothing for them
            self._count_ranks(before, top[:, 0])
        if drafted or guess < 0:
            return []
        return [(self.source, 1, int(guess == top[0, 0]))]

    def _count_ranks(self, before: np.ndarray, target: np.ndarray) -> None:
        """Where each row's target token stood among its token's successors before this update."""
        for row, token in zip(before, target):
            if row[0] < 0:  # never scored: the table could not have drafted here
                continue
            self._ranks *= self.RANK_DECAY
            self._scored = self._scored * self.RANK_DECAY + 1.0
            hit = np.flatnonzero(row == token)
            if hit.size:
                self._ranks[hit[0]] += 1.0
