"""Distributions over target ids that never hold a float64 row of the whole vocabulary.

Two kinds, one interface (`TokenDist`):

  Candidates  a sparse distribution: ascending target ids and their float64 probabilities. What
              top-k, top-p, min_p and greedy leave: a few entries, whatever the vocabulary.
  DenseDist   pure temperature (every token may be drawn): float32 weights exp((x - max) / T) of
              a whole row and their float64 sum, so no float64 row of the vocabulary is ever
              built. A trimmed draft head's row stays K wide, with the id map that places it in
              the target vocabulary.

Speculative decoding needs p(x) of a draft and a draw from each distribution; a draw is an
exponential race against the position's noise (draws.py), which the drafter and the target share:
over a Candidates' few ids, over a dense row by the blocks that can win.
"""
from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

import numpy as np

from edgespec.decoding.draws import Noise

__all__ = ["Candidates", "DenseDist", "TokenDist", "point_mass"]

logger = logging.getLogger(__name__)


class TokenDist(abc.ABC):
    """A normalised distribution over target ids (the abstract interface)."""

    @abc.abstractmethod
    def prob(self, token: int) -> float:
        """p(token); 0 outside the support."""

    @abc.abstractmethod
    def probs_at(self, ids: np.ndarray) -> np.ndarray:
        """float64 p at each of `ids` (target ids)."""

    @abc.abstractmethod
    def sample(self, noise: Noise) -> int:
        """The target id this distribution draws against one position's `noise` (draws.py): the
        winner of the exponential race, distributed as p over the noise."""

    @abc.abstractmethod
    def dense(self, vocab: int) -> np.ndarray:
        """The float64 row (vocab,): for tests and small vocabularies only."""


@dataclass(frozen=True, eq=False)
class Candidates(TokenDist):
    """Sparse: `ids` ascending distinct target ids (int64), `probs` their float64 probabilities,
    positive and summing to 1 (to rounding)."""

    ids: np.ndarray
    probs: np.ndarray

    @classmethod
    def build(cls, ids: np.ndarray, weights: np.ndarray) -> Candidates | None:
        """From ids (any order, distinct) and nonnegative weights: zeros dropped, sorted, normalised."""
        ids, weights = np.asarray(ids, dtype=np.int64), np.asarray(weights, dtype=np.float64)
        keep = weights > 0
        if not keep.all():
            ids, weights = ids[keep], weights[keep]
        total = weights.sum()
        if not total > 0:
            return None
        if len(ids) > 1 and not (np.diff(ids) > 0).all():
            order = np.argsort(ids, kind="stable")
            ids, weights = ids[order], weights[order]
        return cls(ids, weights / total)

    @classmethod
    def from_row(cls, row: np.ndarray) -> Candidates:
        """The nonzero entries of a dense probability row (a test's or a fallback's)."""
        row = np.asarray(row, dtype=np.float64)
        ids = np.flatnonzero(row)
        return cls(ids.astype(np.int64), row[ids] / row[ids].sum())

    def prob(self, token: int) -> float:
        i = int(np.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < len(self.ids) and self.ids[i] == token else 0.0

    def probs_at(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return np.where(self.ids[pos] == ids, self.probs[pos], 0.0)

    def sample(self, noise: Noise) -> int:
        if len(self.ids) == 1:  # a point mass (greedy, a lookup's draft): no race to run
            return int(self.ids[0])
        return noise.race(self.ids, self.probs)

    def mapped(self, id_map: np.ndarray | None) -> Candidates:
        """A draft head's candidates (draft ids) in target ids: id_map[j] is draft id j's target id."""
        if id_map is None:
            return self
        ids = id_map[self.ids]
        order = np.argsort(ids, kind="stable")
        return Candidates(ids[order], self.probs[order])

    def dense(self, vocab: int) -> np.ndarray:
        out = np.zeros(vocab, dtype=np.float64)
        out[self.ids] = self.probs
        return out


def point_mass(token: int) -> Candidates:
    """The distribution of a deterministic proposal: all mass on `token`."""
    return Candidates(np.array([token], dtype=np.int64), np.ones(1))


@dataclass(frozen=True, eq=False)
class DenseDist(TokenDist):
    """Every id of a row: p(j) = weights[j] / total, with weights float32 and total their float64 sum.

    ids: the target id of each weight (a trimmed draft head's id map), None for the identity;
    index: the inverse (target id -> weight index, len(weights) outside), None for the identity."""

    weights: np.ndarray
    total: float
    ids: np.ndarray | None = None
    index: np.ndarray | None = None

    @classmethod
    def from_weights(cls, weights: np.ndarray, ids: np.ndarray | None = None,
                     index: np.ndarray | None = None) -> DenseDist | None:
        weights = np.asarray(weights, dtype=np.float32)
        total = float(weights.sum(dtype=np.float64))
        return cls(weights, total, ids, index) if total > 0 else None

    def mapped(self, ids: np.ndarray | None, index: np.ndarray | None) -> DenseDist:
        """This row (draft ids) placed in the target vocabulary by the id map and its inverse."""
        if ids is None:
            return self
        return DenseDist(self.weights, self.total, ids, index)

    def probs_at(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        n = len(self.weights)
        pos = self.index[ids] if self.index is not None else np.where(ids < n, ids, n)
        inside = pos < n
        return np.where(inside, self.weights[np.minimum(pos, n - 1)], 0.0).astype(np.float64) / self.total

    def prob(self, token: int) -> float:
        return float(self.probs_at(np.array([token], dtype=np.int64))[0])

    def sample(self, noise: Noise) -> int:
        if self.ids is not None:  # a trimmed head's K ids, scattered over the target's blocks
            return noise.race(self.ids, self.weights)
        return noise.race_row(self.weights)

    def dense(self, vocab: int) -> np.ndarray:
        return self.probs_at(np.arange(vocab))
