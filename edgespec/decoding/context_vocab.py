"""The draft's vocabulary widened by the conversation's own tokens.

A VocabTrim draft head scores the K tokens it was cut to. A reply also takes tokens from its
context, the names and words of the prompt or a pasted document, and where the target's next
token lies outside the K the draft cannot propose it: under sampling every such position costs
acceptance p(outside), under greedy decoding a rejected draft. When the draft runs on the target's
body, the target head's weight rows are at hand (runtimes/shared_body.py, `vocab_rows`): each
context token the trimmed head lacks is scored as hidden row . its weight row, next to the K
logits, and the draft samples (or takes the argmax) over both.

Lossless as before: the draft's distribution is whatever it is; rejection sampling and greedy
matching judge each drafted token by the target's logits alone.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

__all__ = ["MAX_EXTRA", "ContextVocab", "Extension"]

logger = logging.getLogger(__name__)

# extra tokens kept per sequence: a long document's distinct words outside a trimmed head number a
# few thousand at most, and each costs a multiply-add per hidden unit per drafted row
MAX_EXTRA = 4096


@dataclass(frozen=True, eq=False)
class Extension:
    """The extra tokens of one sequence: target ids (M,), their head rows (M, H), the id map of the
    widened row (K + M,) and, built when asked, its inverse over the target vocabulary."""

    ids: np.ndarray
    rows: np.ndarray
    id_map: np.ndarray
    base_index: Callable[[], np.ndarray] = field(repr=False)

    def logits(self, head_logits: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """(n, K + M): the trimmed head's logits of n rows, then the extra tokens' scores."""
        return np.concatenate([np.asarray(head_logits, dtype=np.float32), hidden @ self.rows.T], axis=1)

    @cached_property
    def index(self) -> np.ndarray:
        """Target id -> position in the widened row; K + M (outside) for the others."""
        base = self.base_index()
        k, m = len(self.id_map) - len(self.ids), len(self.ids)
        index = np.where(base == k, k + m, base)
        index[self.ids] = k + np.arange(m)
        return index


class ContextVocab:
    """Collects, for a growing sequence, the target ids it holds that `id_map` lacks, with their
    head rows; starts over when the sequence is replaced (a new conversation)."""

    def __init__(self, id_map: np.ndarray, target_vocab: int, rows: Callable[[np.ndarray], np.ndarray],
                 base_index: Callable[[], np.ndarray], limit: int = MAX_EXTRA) -> None:
        self.id_map, self.rows, self.base_index, self.limit = id_map, rows, base_index, limit
        self._kept = np.zeros(target_vocab, dtype=bool)
        self._seq: list[int] = []
        self._start()

    def _start(self) -> None:
        self._kept[:] = False
        self._kept[self.id_map] = True
        self._seq, self._m, self._ext = [], 0, None
        # grown by doubling; an Extension views their first M entries, which later growth leaves as they are
        self._map = np.array(self.id_map, dtype=np.int64)
        self._rows: np.ndarray | None = None

    def update(self, tokens: Sequence[int]) -> Extension | None:
        """The extension for `tokens` (None while it holds no token outside the trimmed head)."""
        n = len(self._seq)
        if len(tokens) < n or tokens[:n] != self._seq:
            self._start()
            n = 0
        fresh = []
        for t in tokens[n:]:
            if not self._kept[t] and self._m + len(fresh) < self.limit:
                self._kept[t] = True
                fresh.append(t)
        self._seq.extend(tokens[n:])
        if fresh:
            self._append(np.asarray(fresh, dtype=np.int64))
        return self._ext

    def _append(self, new: np.ndarray) -> None:
        rows = self.rows(new)
        k, m, end = len(self.id_map), self._m, self._m + len(new)
        if self._rows is None or end > len(self._rows):
            grown = np.empty((max(end, 2 * m, 64), rows.shape[1]), dtype=np.float32)
            if self._rows is not None:
                grown[:m] = self._rows[:m]
            self._rows = grown
            self._map = np.concatenate([self._map[:k + m], np.empty(len(grown) - m, dtype=np.int64)])
        self._rows[m:end] = rows
        self._map[k + m:k + end] = new
        self._m = end
        self._ext = Extension(ids=self._map[k:k + end], rows=self._rows[:end], id_map=self._map[:k + end],
                              base_index=self.base_index)
