"""Sampling randomness keyed by seed and position, shared by the drafter and the target.

Every sampled token is an exponential race (the Gumbel-max trick written with exponentials): at
sequence position t, token i of a distribution w wins when E(seed, t, i) / w(i) is the least,
where the E are independent Exp(1) draws computed from the seed, the position and the token id by
a counter-based hash, not taken from a stream of random numbers. The winner is distributed as w
exactly. So:

- the target's token at position t is a function of the seed, t and the target's distribution
  there alone: however many random draws a step made before it, whatever the timing;
- a drafter samples its token at t by racing the same E over its own distribution q, and the
  verify keeps a draft exactly when it equals the target's own winner at its position, which the
  verify computes anyway. Every committed token is the target's winner, so the text is the one
  plain decoding gives with that seed, token for token, whatever was drafted, by which drafter,
  how many tokens a step, with or without overlap. Lossless by construction: a draft decides only
  how many of the target's tokens one forward commits (drafter-invariant speculative decoding,
  Daliri, Musco and Suresh 2024, arXiv 2408.07978).

The price, against rejection sampling (whose text depends on the drafts): a sampled draft is kept
with probability at least (1 - d) / (1 + d), d the total variation between p and q, where
rejection sampling keeps it with 1 - d. Nothing is lost where q is p on a subset of the
vocabulary (a VocabTrim head on the target's body): both keep a draft with probability p(subset).
Deterministic drafts (prompt lookup, Token Recycling, trees of them) are kept with probability
p(x), as before.

A whole vocabulary is cheap to race: within each block of BLOCK consecutive ids the E are built
from the block's minimum (Exp(BLOCK)), which of its ids holds it (uniform), and Exp(1) above the
minimum for the others. By the memorylessness of the exponential that is the same joint law as
BLOCK independent Exp(1) (ids past the vocabulary's end fill the last block and are never asked
for), and it bounds the block: none of its ids beats minimum / the block's largest weight. A race
over a dense row computes the bounds, then the E of the blocks whose bound is below the best of
the few most promising: a few hundred ids of a 262k vocabulary, not the whole row.
"""
from __future__ import annotations

import logging
import secrets

import numpy as np

__all__ = ["BLOCK", "Draws", "Noise"]

logger = logging.getLogger(__name__)

BLOCK = 32  # ids per block of the noise: 2**5, so a hash's low bits pick the id holding the minimum
_FIRST = 8  # blocks with the least bounds a dense race computes first, to bound the others

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: consecutive counters, well-spread states
def _mix(z: int) -> int:
    """splitmix64's finaliser on a Python int (a bijection of 64-bit words that mixes every bit)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _hash(key: int, counters: np.ndarray) -> np.ndarray:
    """The splitmix64 outputs of a stream keyed `key` at `counters` (int64 >= 0): uint64 hashes."""
    z = counters.astype(np.uint64)
    z += np.uint64(1)
    z *= np.uint64(_GOLDEN)
    z += np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def _exponential(h: np.ndarray) -> np.ndarray:
    """Exp(1) draws from the top 53 bits of uint64 hashes (a uniform in (0, 1), never 0 or 1)."""
    u = (h >> np.uint64(11)).astype(np.float64)
    u += 0.5
    u *= 2.0 ** -53
    return -np.log(u)


class Noise:
    """The Exp(1) draws of one sequence position, one for each target id. Counter 2i draws id i's
    E above its block's minimum, counter 2b + 1 block b's minimum and where it is: one hash each."""

    __slots__ = ("_key",)

    def __init__(self, key: int) -> None:
        self._key = key

    def blocks(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(minimum E, offset of the id that holds it) of blocks `b`: one hash each, its high
        bits for the minimum, its low five (independent of them) for the offset."""
        h = _hash(self._key, 2 * np.asarray(b, dtype=np.int64) + 1)
        return _exponential(h) / BLOCK, (h & np.uint64(BLOCK - 1)).astype(np.int64)

    def at(self, ids: np.ndarray) -> np.ndarray:
        """float64 E of target `ids` (int >= 0)."""
        ids = np.asarray(ids, dtype=np.int64)
        n = len(ids)
        h = _hash(self._key, np.concatenate([2 * ids, 2 * (ids // BLOCK) + 1]))  # both kinds in one pass
        e = _exponential(h)
        above, minimum = e[:n], e[n:] / BLOCK
        above[ids % BLOCK == (h[n:] & np.uint64(BLOCK - 1))] = 0.0
        return minimum + above

    def race(self, ids: np.ndarray, weights: np.ndarray) -> int:
        """The id among `ids` (target ids) whose E / weight is least: a draw from `weights`
        normalised (a zero weight never wins)."""
        with np.errstate(divide="ignore"):
            return int(ids[np.argmin(self.at(ids) / weights)])

    def race_row(self, weights: np.ndarray) -> int:
        """`race(arange(len(weights)), weights)` for a row indexed by target id, computing E only
        in the blocks whose bound is below the best of the _FIRST most promising (the module
        docstring): the same winner, a small part of the work."""
        n = len(weights)
        top = np.maximum.reduceat(weights, np.arange(0, n, BLOCK))  # each block's largest weight
        minimum, _ = self.blocks(np.arange(len(top)))
        with np.errstate(divide="ignore"):
            bound = minimum / top  # inf for a block without weight
        first = np.argpartition(bound, _FIRST)[:_FIRST] if len(bound) > _FIRST else np.arange(len(bound))
        best = self._best(first, weights)[1]
        winner, _ = self._best(np.flatnonzero(bound <= best), weights)  # the first blocks among them
        if winner < 0:
            raise ValueError("no token has a positive weight")
        return winner

    def _best(self, blocks: np.ndarray, weights: np.ndarray) -> tuple[int, float]:
        """(the least E / weight over the ids of `blocks`, its id; -1 where no weight is positive)."""
        ids = (blocks[:, None] * BLOCK + np.arange(BLOCK)).ravel()
        ids = ids[ids < len(weights)]
        with np.errstate(divide="ignore"):
            values = self.at(ids) / weights[ids]
        j = int(np.argmin(values))
        return (int(ids[j]), float(values[j])) if np.isfinite(values[j]) else (-1, np.inf)


class Draws:
    """The randomness of one stream: the noise of each sequence position, keyed by `seed` (None: a
    fresh random seed, kept in `seed`)."""

    def __init__(self, seed: int | None) -> None:
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        key, rest = 0, self.seed
        while True:  # every 64-bit word of a large seed counts
            key = _mix(key ^ (rest & _MASK) ^ _GOLDEN)
            rest >>= 64
            if not rest:
                break
        self._key = key

    def at(self, position: int) -> Noise:
        """The noise of sequence position `position` (0 is the prompt's first token)."""
        return Noise(_mix(self._key + _GOLDEN * (position + 1)))
