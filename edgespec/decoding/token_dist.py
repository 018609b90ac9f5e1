"""Distributions over target ids that never hold a float64 row of the whole vocabulary.

Two kinds, one interface (`TokenDist`):

  Candidates  a sparse distribution: ascending target ids and their float64 probabilities. What
              top-k, top-p, min_p and greedy leave: a few entries, whatever the vocabulary.
  DenseDist   pure temperature (every token may be drawn): float32 weights exp((x - max) / T) of
              a whole row and their float64 sum, sampled by block sums then a cumsum inside one
              block, so no float64 row of the vocabulary is ever built. A trimmed draft head's
              row stays K wide, with the id map that places it in the target vocabulary.

Speculative acceptance needs p(x), q(x) and the residual max(0, p - q) renormalised; the
residual is nonzero only where p is, so it is computed on p's support (Candidates), or as the
dense row patched on q's support (DenseDist minus Candidates). `sample()` draws as
`sampling.sample` does over the full row: a uniform times the total mass, searched in a cdf in
ascending id order (for Candidates the cdf skips zeros, which add nothing to it).
"""
from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["BLOCK", "Candidates", "DenseDist", "TokenDist", "point_mass"]

logger = logging.getLogger(__name__)

# tokens per block of a DenseDist: a sample sums blocks (V / BLOCK of them) then BLOCK weights
BLOCK = 1024


class TokenDist(abc.ABC):
    """A normalised distribution over target ids (the abstract interface)."""

    @abc.abstractmethod
    def prob(self, token: int) -> float:
        """p(token); 0 outside the support."""

    @abc.abstractmethod
    def probs_at(self, ids: np.ndarray) -> np.ndarray:
        """float64 p at each of `ids` (target ids)."""

    @abc.abstractmethod
    def sample(self, rng: np.random.Generator) -> int:
        """One target id drawn from the distribution (one `rng.random()`)."""

    @abc.abstractmethod
    def without(self, tokens: Sequence[int]) -> TokenDist | None:
        """p with `tokens` removed, renormalised (the residual of point masses); None if no mass is left."""

    @abc.abstractmethod
    def minus(self, q: TokenDist) -> TokenDist | None:
        """max(0, p - q) renormalised: rejection sampling's residual; None if it has no mass."""

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

    def sample(self, rng: np.random.Generator) -> int:
        cdf = np.cumsum(self.probs)
        i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        return int(self.ids[min(i, len(self.ids) - 1)])  # the top of the cdf, through rounding

    def without(self, tokens: Sequence[int]) -> Candidates | None:
        keep = ~np.isin(self.ids, np.asarray(tokens, dtype=np.int64))
        return Candidates.build(self.ids[keep], self.probs[keep])

    def minus(self, q: TokenDist) -> Candidates | None:
        # max(0, p - q) is zero wherever p is: p's support is the whole union that matters
        return Candidates.build(self.ids, np.maximum(self.probs - q.probs_at(self.ids), 0.0))

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


def _block_sums(weights: np.ndarray) -> np.ndarray:
    """float64 sums of each BLOCK of float32 weights (no float64 copy of the row)."""
    return np.add.reduceat(weights, np.arange(0, len(weights), BLOCK), dtype=np.float64)


@dataclass(frozen=True, eq=False)
class DenseDist(TokenDist):
    """Every id of a row: p(j) = weights[j] / total, with weights float32 and total their float64 sum.

    ids: the target id of each weight (a trimmed draft head's id map), None for the identity;
    index: the inverse (target id -> weight index, len(weights) outside), None for the identity.
    A patch (sorted weight indices and their float64 replacement weights) is how a residual
    changes a few entries without copying the row."""

    weights: np.ndarray
    blocks: np.ndarray  # float64 (ceil(len / BLOCK),): the patched block sums
    ids: np.ndarray | None = None
    index: np.ndarray | None = None
    patch_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    patch_w: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @classmethod
    def from_weights(cls, weights: np.ndarray, ids: np.ndarray | None = None,
                     index: np.ndarray | None = None) -> DenseDist | None:
        weights = np.asarray(weights, dtype=np.float32)
        blocks = _block_sums(weights)
        return cls(weights, blocks, ids, index) if blocks.sum() > 0 else None

    @property
    def total(self) -> float:
        return float(self.blocks.sum())

    def mapped(self, ids: np.ndarray | None, index: np.ndarray | None) -> DenseDist:
        """This row (draft ids) placed in the target vocabulary by the id map and its inverse."""
        if ids is None:
            return self
        return DenseDist(self.weights, self.blocks, ids, index, self.patch_at, self.patch_w)

    def _positions(self, tokens: np.ndarray) -> np.ndarray:
        """Weight index of each target id; len(weights) for ids the row does not hold."""
        n = len(self.weights)
        if self.index is not None:
            return self.index[tokens]
        return np.where(tokens < n, tokens, n)

    def _weights_at(self, pos: np.ndarray) -> np.ndarray:
        """float64 patched weights at weight indices (len(weights) gives 0)."""
        n = len(self.weights)
        inside = pos < n
        out = np.where(inside, self.weights[np.minimum(pos, n - 1)], 0.0).astype(np.float64)
        if len(self.patch_at):
            j = np.minimum(np.searchsorted(self.patch_at, pos), len(self.patch_at) - 1)
            hit = self.patch_at[j] == pos
            out[hit] = self.patch_w[j[hit]]
        return out

    def probs_at(self, ids: np.ndarray) -> np.ndarray:
        return self._weights_at(self._positions(np.asarray(ids, dtype=np.int64))) / self.total

    def prob(self, token: int) -> float:
        return float(self.probs_at(np.array([token], dtype=np.int64))[0])

    def sample(self, rng: np.random.Generator) -> int:
        u = rng.random()
        blocks = self.blocks
        while True:
            cum = np.cumsum(blocks)
            b = int(np.searchsorted(cum, u * cum[-1], side="right"))
            if b >= len(cum):  # the top of the cdf, through rounding: the last block with mass
                b = int(np.flatnonzero(blocks > 0)[-1])
            start = b * BLOCK
            seg = self._weights_at(np.arange(start, min(start + BLOCK, len(self.weights))))
            cs = np.cumsum(seg)
            if cs[-1] > 0:
                break
            # a block a patch emptied keeps a rounding crumb of mass: drop it and draw again
            blocks = blocks.copy()
            blocks[b] = 0.0
        rest = u * cum[-1] - (cum[b - 1] if b else 0.0)
        i = int(np.searchsorted(cs, rest, side="right"))
        if i >= len(cs):
            i = int(np.flatnonzero(seg)[-1])
        j = start + i
        return int(self.ids[j]) if self.ids is not None else j

    def _patched(self, pos: np.ndarray, new_w: np.ndarray) -> DenseDist | None:
        """This row with the weights at indices `pos` (distinct, inside) replaced by `new_w`."""
        order = np.argsort(pos)
        pos, new_w = pos[order], new_w[order]
        old = self._weights_at(pos)
        blocks = self.blocks.copy()
        np.add.at(blocks, pos // BLOCK, new_w - old)
        np.maximum(blocks, 0.0, out=blocks)  # a block emptied by the patch may round below zero
        if len(self.patch_at):  # merge with the earlier patch, the new values winning
            keep = ~np.isin(self.patch_at, pos)
            merged_at = np.concatenate([self.patch_at[keep], pos])
            merged_w = np.concatenate([self.patch_w[keep], new_w])
            order = np.argsort(merged_at)
            pos, new_w = merged_at[order], merged_w[order]
        if not blocks.sum() > 0:
            return None
        return DenseDist(self.weights, blocks, self.ids, self.index, pos, new_w)

    def without(self, tokens: Sequence[int]) -> DenseDist | None:
        pos = np.unique(self._positions(np.asarray(tokens, dtype=np.int64)))
        pos = pos[pos < len(self.weights)]
        return self._patched(pos, np.zeros(len(pos))) if len(pos) else self

    def minus(self, q: TokenDist) -> DenseDist | None:
        if isinstance(q, Candidates):
            # the dense row, changed only on q's support
            pos = self._positions(q.ids)
            inside = pos < len(self.weights)
            pos, qp = pos[inside], q.probs[inside]
            total = self.total
            new_w = np.maximum(self._weights_at(pos) - qp * total, 0.0)
            return self._patched(pos, new_w) if len(pos) else self
        if not isinstance(q, DenseDist):
            raise TypeError(f"no residual of a dense row and a {type(q).__name__}")
        # two dense rows: a float32 row of the residual (never a float64 one)
        p32 = self._target_row(len(self.weights) if self.ids is None else len(self.index))
        p32 -= q._target_row(len(p32))
        np.maximum(p32, 0.0, out=p32)
        return DenseDist.from_weights(p32)

    def _target_row(self, vocab: int) -> np.ndarray:
        """float32 probabilities over target ids 0..vocab-1 (zeros where the row holds none)."""
        row = np.zeros(vocab, dtype=np.float32)
        w = self.weights * np.float32(1.0 / self.total)
        if len(self.patch_at):
            w[self.patch_at] = self.patch_w / self.total
        if self.ids is None:
            n = min(len(w), vocab)
            row[:n] = w[:n]
        else:
            row[self.ids] = w
        return row

    def dense(self, vocab: int) -> np.ndarray:
        return self.probs_at(np.arange(vocab))
