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
        # how many leading positions hold rows computed by whole chunks at absolute positions
        # (forwards of `limit` ids from a multiple of `limit`): a fresh cache computes them alike
        self.whole = 0

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
        # chunk boundaries sit at multiples of `limit` counted from position 0, not from where the
        # cache ends: a prompt's rows are then computed in the same forwards whatever prefix an
        # earlier request left cached. Every chunk but the last is prefill whose logits are
        # discarded; the last holds the rows whose logits are asked for
        base, end = len(self.ids), len(self.ids) + len(ids)
        last = max(base, min(end - n_logits, (end - 1) // limit * limit))
        pos = base
        while pos < last:
            stop = min(last, (pos // limit + 1) * limit)
            self.rt.forward(ids[pos - base:stop - base], n_logits=1)
            self.ids.extend(ids[pos - base:stop - base])
            self._count_whole(pos, stop, limit)
            pos = stop
        logits = self.rt.forward(ids[last - base:], n_logits=n_logits)
        self.ids.extend(ids[last - base:])
        self._count_whole(last, end, limit)
        return logits

    def _count_whole(self, start: int, stop: int, limit: int) -> None:
        if start == self.whole and stop - start == limit and start % limit == 0:
            self.whole = stop

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
        """Keep the first `n` positions, or fewer where the runtime cannot (a window-sized cache
        trimmed past what it still holds): the ids not held are fed again as pending."""
        self.rt.trim(n)
        n = min(n, self.rt.n_past)
        del self.ids[n:]
        limit = self.limit
        self.whole = min(self.whole, n // limit * limit if limit else n)

    def align(self, tokens: Sequence[int], new_request: bool = False) -> None:
        """Trim to the common prefix with `tokens`, leaving at least the last token unfed.
        `new_request`: keep no more than the rows whole chunks computed (`whole`), so that the
        request's rows are computed in the forwards a fresh cache would run: its greedy reply
        cannot depend on what an earlier request left (a chat turn re-prefills from there)."""
        if self.rt.n_past < len(self.ids):  # trimmed by someone else: a trim keeps a prefix
            del self.ids[self.rt.n_past :]
            self.whole = min(self.whole, len(self.ids))
        elif self.rt.n_past > len(self.ids):  # a forward failed midway: contents unknown
            logger.debug("%s cache holds %d untracked positions; resetting it", type(self.rt).__name__, self.rt.n_past)
            self.rt.reset()
            self.ids.clear()
            self.whole = 0
        keep = min(common_prefix(self.ids, tokens), len(tokens) - 1)
        if new_request and self.limit is not None:
            keep = min(keep, self.whole)
        if keep < len(self.ids):
            self.trim(keep)
