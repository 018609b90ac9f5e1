"""Draft trees for Token Recycling's tree verification: shape and acceptance (recycling.py
drafts them from its successor table, and imports this module; nothing here imports it back).

A chain stakes a whole verify on one guess per position; the successor table already holds the
target's other top-k guesses, so a tree tries several at the first positions for the same one
forward. The verify input is the root (the last committed, not yet fed token) followed by the
draft nodes, every parent before its children; logits row i is the target's prediction for the
token after node i, given the path root..i. Everything here is pure: the runtime only needs
`row_parents()` (for the tree attention mask) and `depths()` (for position ids).

Acceptance walks one path down from the root. Greedy, it follows the target's argmax, so it commits what
plain greedy decoding would (if the tree's rows are the chain's bits: docs/LOG.md, tree rows).
Sampling, it follows the target's own draw at each position (draws.py), so it commits what plain
decoding with the same seed would, each token with exactly the target's conditional probability.
"""
from __future__ import annotations

import functools
import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edgespec.checks import integer
from edgespec.decoding.draws import Draws
from edgespec.decoding.token_dist import TokenDist

__all__ = [
    "DraftTree",
    "accept_tree_greedy",
    "accept_tree_coupled",
    "best_shape",
    "expected_tree_tokens",
    "shape_size",
    "tree_shapes",
]

logger = logging.getLogger(__name__)

# first-position widths of the menu's shapes; deeper positions take the top-1 (a chain):
# acceptance falls with depth, so extra candidates pay most where a miss ends the step earliest
_HEADS = ((1,), (2,), (3,), (2, 2))


@dataclass(frozen=True)
class DraftTree:
    """Draft nodes 1..n in verify order; node 0 is the root and is not stored.

    tokens[i] is node i+1's token, parents[i] its parent's node index (0 = the root), < i+1, so
    every parent is fed before its children. Siblings carry distinct tokens: a repeat could never
    be accepted where its twin was not, and would only widen the verify."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        # plain int tuples whatever sequence of integers was passed: hashable, and fast to compare
        for name in ("tokens", "parents"):
            try:
                object.__setattr__(self, name, tuple(operator.index(v) for v in getattr(self, name)))
            except TypeError:
                raise ValueError(f"draft tree {name} must be integers, got {getattr(self, name)!r}") from None
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"draft tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        if any(t < 0 for t in self.tokens):
            raise ValueError(f"draft tree tokens must be >= 0, got {list(self.tokens)}")
        for i, parent in enumerate(self.parents):
            if not 0 <= parent <= i:
                raise ValueError(f"node {i + 1}'s parent must be a node in 0..{i}, got {parent}")
        if len(set(zip(self.parents, self.tokens))) != len(self.tokens):
            raise ValueError(f"siblings repeat a token in the draft tree {list(zip(self.parents, self.tokens))}")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """A linear tree: node i+1 follows node i."""
        return cls(tuple(tokens), tuple(range(len(tokens))))

    @property
    def n(self) -> int:
        """Number of draft nodes (the verify feeds n + 1 rows)."""
        return len(self.tokens)

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(self.n + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent].append(i + 1)
        return tuple(tuple(k) for k in kids)

    def children(self, node: int) -> tuple[int, ...]:
        """Node indices whose parent is `node`, in stored (verify) order."""
        return self._children[node]

    def depths(self) -> tuple[int, ...]:
        """Depth of nodes 0..n (the root is 0): the position offset of each verify row."""
        out = [0]
        for parent in self.parents:
            out.append(out[parent] + 1)  # parents come first, so their depth is known
        return tuple(out)

    @property
    def max_depth(self) -> int:
        return max(self.depths())

    def path_to(self, node: int) -> tuple[int, ...]:
        """Node indices from the root to `node`, both included."""
        if not 0 <= node <= self.n:
            raise ValueError(f"node {node} is not in a tree of {self.n} drafts")
        path = [node]
        while path[-1] != 0:
            path.append(self.parents[path[-1] - 1])
        return tuple(reversed(path))

    def row_parents(self) -> tuple[int, ...]:
        """Each verify row's parent row, -1 for the root: a row attends to the cache and its
        ancestors, found by following these."""
        return (-1, *self.parents)


def shape_size(widths: Sequence[int]) -> int:
    """Most draft nodes a shape can hold (a sparse table fills fewer): the verify's rows less one."""
    return sum(math.prod(widths[: d + 1]) for d in range(len(widths)))


@functools.lru_cache(maxsize=32, typed=True)  # pure, and asked for every drafting step: built once per bound
def tree_shapes(max_nodes: int) -> tuple[tuple[int, ...], ...]:
    """The menu of shapes holding at most `max_nodes` drafts: chains of 1..max_nodes, then a top-2,
    a top-3 and a top-2-then-top-2 head, each continued by chains as deep as the bound allows.
    Fixed and small on purpose: the engine picks among them from measured verify cost."""
    integer(max_nodes, "max_nodes", least=1, error=ValueError)
    shapes = []
    for head in _HEADS:
        shape = head
        while shape_size(shape) <= max_nodes:
            shapes.append(shape)
            shape += (1,)
    return tuple(shapes)


def accept_tree_greedy(tree: DraftTree, logits: np.ndarray) -> tuple[list[int], int]:
    """Walk from the root along the child carrying the target's argmax; stop where none does.

    logits: (n+1, V), row i the target's prediction after node i. Returns the accepted node
    indices in path order (root excluded) and the target's next token: the correction after the
    last accepted node, or the bonus token at a leaf. On a chain it is `accept_greedy`."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != tree.n + 1:
        raise ValueError(f"need {tree.n + 1} rows of target logits for {tree.n} drafts, got shape {logits.shape}")
    best = np.argmax(logits, axis=-1)  # ties as accept_greedy breaks them: plain greedy's token
    return _walk(tree, lambda node: int(best[node]))


def accept_tree_coupled(tree: DraftTree, target_dists: Sequence[TokenDist], draws: Draws,
                        start: int) -> tuple[list[int], int]:
    """`acceptance.accept_coupled` over a tree: from the root, the target draws its token at each
    position (start + the node's depth) against the position's noise and the walk goes on to the
    child carrying it; where no child does, that token is committed. Every committed token is the
    target's own draw, so exact; a node with children x1..xm is passed with probability
    p(x1) + ... + p(xm), as multi-candidate rejection sampling of point masses (SpecInfer) passes it.

    target_dists: n+1 distributions (token_dist.py), row i the target's after node i; only the
    rows on the walked path are read (a lazy sequence builds only those). Returns the accepted
    node indices (root excluded) and the next token."""
    if len(target_dists) != tree.n + 1:
        raise ValueError(f"need {tree.n + 1} target rows for {tree.n} drafts, got {len(target_dists)}")
    depths = tree.depths()
    return _walk(tree, lambda node: target_dists[node].sample(draws.at(start + depths[node])))


def _walk(tree: DraftTree, pick) -> tuple[list[int], int]:
    """The path from the root along the child carrying `pick(node)` (the target's token after
    node), and the token after its last node."""
    accepted: list[int] = []
    node = 0  # the root
    while True:
        token = pick(node)
        match = [c for c in tree.children(node) if tree.tokens[c - 1] == token]
        if not match:  # siblings are distinct: at most one child matches
            return accepted, token
        node = match[0]
        accepted.append(node)


def expected_tree_tokens(widths: Sequence[int], reach: Sequence[float]) -> float:
    """Tokens a step drafting a full tree of this shape commits on average, the target's own
    included: depth d is reached if the target's token was among the first widths[d] successors
    at every depth before, which happens with probability reach[w - 1] at each (independently:
    the chain model of policy.expected_tokens, with one alpha per width)."""
    expected, p = 1.0, 1.0
    for w in widths:
        p *= reach[w - 1]
        expected += p
    return expected


def best_shape(reach: Sequence[float], verify_cost: Sequence[float], max_nodes: int) -> tuple[int, ...]:
    """The menu's shape (tree_shapes) with the most expected tokens per verify cost.
    verify_cost[i]: what a verify of i + 1 rows costs (policy.verify_table, in plain steps), at
    least max_nodes + 1 long. On a backend where every row costs (c(B) steep) this is a chain."""
    shapes = tree_shapes(max(1, min(max_nodes, len(verify_cost) - 1)))
    return max(shapes, key=lambda w: expected_tree_tokens(w, reach) / verify_cost[shape_size(w)])
