"""A runtime together with the target ids its KV cache holds.

Both the decoder (for the target) and a model drafter (for the draft) keep one, so that every
feed and every trim updates the runtime and its bookkeeping together.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from edgespec.decoding.tree import DraftTree
from edgespec.runtimes.base import Runtime, common_prefix

__all__ = ["TrackedCache", "batch_limit", "common_prefix"]

logger = logging.getLogger(__name__)


def batch_limit(rt: Runtime, max_batch: int | None = None) -> int | None:
    """Most tokens one forward of `rt` runs (None: no limit): what its capabilities accept, and at
    most `max_batch`, a limit of the engine's own (a memory plan's prefill chunk)."""
    limits = [n for n in (rt.capabilities.max_batch_tokens, max_batch) if n is not None]
    return min(limits) if limits else None


class TrackedCache:
    """`rt` plus `ids`, the target ids its cache holds (a prefix of the committed sequence).
    `max_batch`: most tokens per forward, below what the runtime accepts (None: its own limit)."""

    def __init__(self, rt: Runtime, max_batch: int | None = None) -> None:
        self.rt = rt
        self.max_batch = max_batch
        self.ids: list[int] = []

    @property
    def limit(self) -> int | None:
        """Most tokens one forward takes (None: no limit)."""
        return batch_limit(self.rt, self.max_batch)

    def pending(self, tokens: Sequence[int]) -> list[int]:
        """The ids of `tokens` the cache does not hold yet (call `align` first)."""
        return list(tokens[len(self.ids) :])

    def feed(self, ids: list[int], n_logits: int) -> np.ndarray | None:
        """Append target ids to the cache, in chunks the backend accepts; logits of the last chunk.

        Drafts with a trimmed head keep the full input embedding, so they too are fed target ids."""
        if not ids:
            return None
        limit = self.limit or len(ids)
        # every chunk but the last is prefill whose logits are discarded
        split = max(len(ids) - limit, 0)
        for start in range(0, split, limit):
            end = min(start + limit, split)
            self.rt.forward(ids[start:end], n_logits=1)
            self.ids.extend(ids[start:end])
        logits = self.rt.forward(ids[split:], n_logits=n_logits)
        self.ids.extend(ids[split:])
        return logits

    def feed_tree(self, ids: list[int], tree: DraftTree) -> np.ndarray:
        """Feed `ids` (their last the tree's root) and then the draft tree in one forward
        (Runtime.forward_tree); the logits of the root and every node, (tree.n + 1, V). Until
        `keep_path`, the nodes are tracked as -1: no committed id matches them, so an `align`
        in between (a failed step) keeps the root and drops every node's row."""
        self.feed(ids[:-1], n_logits=1)
        logits = self.rt.forward_tree([ids[-1], *tree.tokens], tree.row_parents())
        self.ids.append(ids[-1])
        self.ids.extend([-1] * tree.n)
        return logits

    def keep_path(self, tree: DraftTree, nodes: list[int]) -> None:
        """After feed_tree: hold the root, then the accepted `nodes` (a root-to-node path), in place
        of the whole tree. Rows stay valid only at their own position after their own parent, so
        they are moved (Runtime.keep_rows), never matched by token id."""
        root = len(self.ids) - tree.n - 1
        self.rt.keep_rows(root, [0, *nodes])
        del self.ids[root + 1:]
        self.ids.extend(tree.tokens[n - 1] for n in nodes)

    def trim(self, n: int) -> None:
        """Keep the first `n` positions."""
        self.rt.trim(n)
        del self.ids[n:]

    def align(self, tokens: Sequence[int]) -> None:
        """Trim to the common prefix with `tokens`, leaving at least the last token unfed."""
        if self.rt.n_past < len(self.ids):  # trimmed by someone else: a trim keeps a prefix
            del self.ids[self.rt.n_past :]
        elif self.rt.n_past > len(self.ids):  # a forward failed midway: contents unknown
            logger.debug("%s cache holds %d untracked positions; resetting it", type(self.rt).__name__, self.rt.n_past)
            self.rt.reset()
            self.ids.clear()
        keep = min(common_prefix(self.ids, tokens), len(tokens) - 1)
        if keep < len(self.ids):
            self.trim(keep)
