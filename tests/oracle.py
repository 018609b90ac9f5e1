"""The exact oracle for sampled decoding: the law of the first tokens, enumerated, and a test of
stated power that the engine's sampled output follows it.

For a target whose sampler leaves few tokens per position (top-k, top-p, min-p; or a vocabulary
of a few tokens), the joint probability of every sequence of the first LENGTH generated tokens is
enumerated exactly from the target's own logits, with a sampler written here from its
specification (temperature, then top-k with ties kept, softmax, top-p in order of probability
with ties by id, min-p against the likeliest, renormalised): the law T.

The engine samples by exponential races against noise keyed by seed and position
(edgespec/decoding/draws.py), so a seeded run is a function of its seed, and a speculative run
with a correct path commits exactly what plain decoding with the same seed commits. Hence two
checks, which together have the stated power:

  A. reference against T: R(s) is plain decoding with seed s written here (the target's
     distribution() of each position, raced against the same keyed noise, computed for a million
     seeds at once in numpy). Pearson's chi-square of R's sequence counts against T, without
     pooling (every expected count >= MIN_EXPECTED): for any alternative at total variation d the
     noncentrality is at least n (2d)^2 (Cauchy-Schwarz: sum |dp| <= sqrt(sum dp^2/p)), so its
     power at d is at least that of a noncentral chi-square with that noncentrality, whatever the
     alternative's shape. n is sized for power POWER at TV_SPLIT, false alarms at ALPHA.
  B. path against R: the engine's tokens with seeds 0..N_SEEDS-1 must equal R's, every one. A
     path whose law is at total variation d from R's disagrees with R on a seed with probability
     at least d (the coupling inequality), so it passes N_SEEDS seeds with probability at most
     (1 - TV_SPLIT)^N_SEEDS <= 1 - POWER; a correct path never disagrees: no false alarms.

  If the path's law is at TV >= 2 TV_SPLIT = 0.01 from T, then R is at >= TV_SPLIT from T or the
  path at >= TV_SPLIT from R (triangle inequality): one check fails with probability >= POWER.

The logits are the target's as plain decoding computes them (its prefill, then one-token
forwards: `PlainRows`), so R is the engine's own plain decoding, bit for bit, on a backend whose
verify widths are exact (the engine drafts only at those).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
from scipy.optimize import brentq
from scipy.stats import chi2, chisquare, ncx2

from edgespec.decoding import SamplingParams, sampling
from edgespec.decoding.cache import TrackedCache
from edgespec.decoding.draws import _GOLDEN, BLOCK
from edgespec.decoding.token_dist import Candidates, DenseDist
from edgespec.runtimes.base import Runtime

LENGTH = 4  # generated tokens whose joint law is enumerated
TV = 0.01  # the total variation on that joint the oracle must detect...
POWER = 0.99  # ...with this probability...
ALPHA = 1e-4  # ...at this false-alarm rate
TV_SPLIT = TV / 2  # what each of the two checks must detect (module docstring)
MIN_EXPECTED = 20  # every sequence's expected count in check A: the chi-square's own law holds
N_SEEDS = math.ceil(math.log(1 - POWER) / math.log(1 - TV_SPLIT))  # check B: 919 seeds
CHUNK = 1 << 18  # seeds raced at once in check A (memory: a few arrays of CHUNK x support)
_A_SEEDS = 10 ** 9  # check A's seeds start here, apart from check B's 0..N_SEEDS-1


# ---------------------------------------------------------------- the target's sampler, from its specification


def sampler_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float64 probabilities of one row under `params` (sampled: temperature > 0), written from the
    specification (docs/api.md), not from edgespec.decoding.sampling. Refuses a row whose cut
    falls within a rounding error of a boundary: the oracle is asked only where it is clear."""
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    keep = np.isfinite(x)
    if 0 < params.top_k < keep.sum():
        kth = np.sort(x[keep])[::-1][params.top_k - 1]
        nxt = np.sort(x[keep])[::-1][params.top_k]
        assert kth - nxt > 1e-6 or kth == nxt, "top-k cut within rounding of a logit"
        keep &= x >= kth
    e = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    p = e / e.sum()
    if params.top_p < 1:
        order = sorted(np.flatnonzero(keep), key=lambda i: (-p[i], i))
        before = 0.0
        for i in order:
            assert abs(before - params.top_p) > 1e-6, "top-p cut within rounding of its mass"
            if before >= params.top_p:
                keep[i] = False
            before += p[i]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if params.min_p > 0:
        ratio = np.where(keep, e, 0.0)  # exp(x/T - max x/T) of the kept tokens
        assert not np.any(keep & (np.abs(ratio - params.min_p) < 1e-6)), "min-p cut within rounding"
        p = np.where(keep & (ratio >= params.min_p), p, 0.0)
        p /= p.sum()
    return p


# ---------------------------------------------------------------- the target's rows, as plain decoding computes them


class PlainRows:
    """`rows(prefix)`: the target's logits after prompt + prefix, computed as plain decoding does
    (the prompt but its last token prefilled in the decoder's chunks, then one-token forwards),
    so bit-identical to what the engine's plain decoding sees. Memoised; `rt` is reset after."""

    def __init__(self, rt: Runtime, prompt: Sequence[int], max_batch: int | None = None) -> None:
        self.rt, self.prompt = rt, list(prompt)
        self._cache = TrackedCache(rt, max_batch)
        self._rows: dict[tuple[int, ...], np.ndarray] = {}
        self._released = False

    def __call__(self, prefix: Sequence[int]) -> np.ndarray:
        key = tuple(prefix)
        if key not in self._rows:
            seq = self.prompt + list(key)
            self._cache.align(seq)
            pending = self._cache.pending(seq)
            if len(pending) > 1:
                self._cache.feed(pending[:-1], n_logits=1)
            self._rows[key] = np.array(self._cache.feed(pending[-1:], n_logits=1)[-1], dtype=np.float32)
            if self._released:  # lent back to an engine: leave it empty again, as `release` did
                self.release()
        return self._rows[key]

    def release(self) -> None:
        """Empty the runtime's cache, for an engine sharing it (its decoder notices and prefills
        again); a row asked for afterwards is computed and the cache emptied again."""
        self.rt.reset()
        self._cache = TrackedCache(self.rt, self._cache.max_batch)
        self._released = True


# ---------------------------------------------------------------- the exact law


@dataclass(frozen=True)
class Law:
    """The exact joint law of the first `length` tokens: its sequences and their probabilities."""

    sequences: tuple[tuple[int, ...], ...]
    probs: np.ndarray

    @property
    def support(self) -> int:
        return len(self.sequences)


def exact_law(rows: Callable[[Sequence[int]], np.ndarray], params: SamplingParams, length: int = LENGTH) -> Law:
    """Enumerate every sequence of `length` tokens the sampler can produce after the prompt."""
    seqs, probs = [()], [1.0]
    for _ in range(length):
        grown, grown_p = [], []
        for seq, q in zip(seqs, probs):
            p = sampler_probs(rows(seq), params)
            for tok in np.flatnonzero(p):
                grown.append((*seq, int(tok)))
                grown_p.append(q * float(p[tok]))
        seqs, probs = grown, grown_p
    return Law(tuple(seqs), np.array(probs))


# ---------------------------------------------------------------- the reference: plain decoding for many seeds at once


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """draws._mix on uint64 arrays."""
    z = z ^ (z >> np.uint64(30))
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    return z ^ (z >> np.uint64(31))


def position_keys(seeds: np.ndarray, position: int) -> np.ndarray:
    """Draws(seed).at(position)'s key for each seed (< 2**64), as uint64."""
    key = _mix(np.asarray(seeds, dtype=np.uint64) ^ np.uint64(_GOLDEN))
    with np.errstate(over="ignore"):
        return _mix(key + np.uint64(_GOLDEN * (position + 1) & (2 ** 64 - 1)))


def noise(seeds: np.ndarray, position: int, ids: np.ndarray) -> np.ndarray:
    """(len(seeds), len(ids)): Draws(seed).at(position).at(ids) for every seed."""
    keys = position_keys(seeds, position)[:, None]
    ids = np.asarray(ids, dtype=np.int64)
    counters = np.concatenate([2 * ids, 2 * (ids // BLOCK) + 1]).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _mix((counters + np.uint64(1)) * np.uint64(_GOLDEN) + keys)
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53
    e = -np.log(u)
    n = len(ids)
    above, minimum = e[:, :n], e[:, n:] / BLOCK
    above[(ids % BLOCK)[None, :] == (h[:, n:] & np.uint64(BLOCK - 1)).astype(np.int64)] = 0.0
    return minimum + above


def _support(dist) -> tuple[np.ndarray, np.ndarray]:
    """(target ids, weights) a target distribution races over."""
    if isinstance(dist, Candidates):
        return dist.ids, dist.probs
    assert isinstance(dist, DenseDist) and dist.ids is None, "a target row is candidates or a dense row"
    return np.arange(len(dist.weights)), dist.weights


def reference(seeds: np.ndarray, rows: Callable[[Sequence[int]], np.ndarray], prompt_len: int,
              params: SamplingParams, length: int) -> np.ndarray:
    """(len(seeds), length) tokens of plain decoding with each seed: at each position the
    target's `distribution()` (looked up in its module at call time: a mistake injected there is
    the reference's too) raced against the seed's noise there."""
    seeds = np.asarray(seeds, dtype=np.int64)
    out = np.empty((len(seeds), length), dtype=np.int64)
    groups: dict[tuple[int, ...], np.ndarray] = {(): np.arange(len(seeds))}
    for t in range(length):
        grown = {}
        for prefix in sorted(groups):  # sorted: neighbours share prefixes, so rows are cheap
            idx = groups[prefix]
            ids, w = _support(sampling.distribution(rows(prefix), params))
            with np.errstate(divide="ignore"):
                tok = ids[np.argmin(noise(seeds[idx], prompt_len + t, ids) / w, axis=1)]
            out[idx, t] = tok
            for x in np.unique(tok):
                grown[(*prefix, int(x))] = idx[tok == x]
        groups = grown
    return out


# ---------------------------------------------------------------- power


@cache
def chi_square_size(df: int, tv: float = TV_SPLIT) -> tuple[int, float]:
    """(samples, noncentrality) for Pearson's chi-square with `df` degrees of freedom to reach power
    POWER at false-alarm rate ALPHA against every alternative at total variation `tv`."""
    crit = chi2.isf(ALPHA, df)
    lam = brentq(lambda nc: ncx2.sf(crit, df, nc) - POWER, 1e-6, 1e6)
    return math.ceil(lam / (2 * tv) ** 2), lam


def power_at(df: int, n: int, tv: float) -> float:
    """Power of check A with n samples against an alternative at total variation `tv` (a bound)."""
    return float(ncx2.sf(chi2.isf(ALPHA, df), df, n * (2 * tv) ** 2))


@dataclass(frozen=True)
class Verdict:
    """Check A's outcome for one configuration, and what it can detect."""

    name: str
    length: int
    support: int
    n: int
    statistic: float
    p_value: float

    @property
    def df(self) -> int:
        return self.support - 1

    def statement(self, seeds: int = N_SEEDS) -> str:
        """What checks A and B (over `seeds` seeds) detect together."""
        lam = self.n * (2 * TV_SPLIT) ** 2
        tv_b = seeds_tv(seeds)
        return (f"{self.name}: law of the first {self.length} tokens, {self.support} sequences. A: chi-square of the "
                f"reference's {self.n:,} seeded runs against the exact law, df {self.df}, alpha {ALPHA:g}, "
                f"noncentrality >= n(2d)^2 = {lam:.1f} at d = {TV_SPLIT}: power "
                f"{power_at(self.df, self.n, TV_SPLIT):.4f} "
                f"(p = {self.p_value:.3g}). B: {seeds} seeds identical to the reference, power "
                f"{1 - (1 - tv_b) ** seeds:.4f} at d = {tv_b:.4g}, no false alarms. Together: power >= {POWER} "
                f"against total variation {TV_SPLIT + tv_b:.4g} from the exact law, false-alarm rate <= {ALPHA:g}.")


def seeds_tv(seeds: int) -> float:
    """The total variation check B detects with probability POWER over `seeds` seeds."""
    return 1 - (1 - POWER) ** (1 / seeds)


def check_reference(name: str, rows, prompt_len: int, params: SamplingParams, length: int = LENGTH) -> Verdict:
    """Check A: the reference's law against the exact law, with n sized from the power required."""
    law = exact_law(rows, params, length)
    n, _ = chi_square_size(law.support - 1)
    assert law.probs.min() * n >= MIN_EXPECTED, \
        f"a sequence of probability {law.probs.min():.2g} is expected fewer than {MIN_EXPECTED} times in {n}"
    base = 1 + max(max(seq) for seq in law.sequences)
    weights = base ** np.arange(length, dtype=np.int64)  # a sequence as one integer
    index = {int(np.dot(seq, weights)): i for i, seq in enumerate(law.sequences)}
    counts = np.zeros(law.support)
    for start in range(0, n, CHUNK):
        seeds = np.arange(_A_SEEDS + start, _A_SEEDS + min(n, start + CHUNK))
        tokens = reference(seeds, rows, prompt_len, params, length)
        assert tokens.max() < base, "the reference drew a token no sequence of the exact law holds"
        codes, c = np.unique(tokens @ weights, return_counts=True)
        for code, k in zip(codes.tolist(), c):
            assert code in index, f"the reference drew a sequence the exact law gives probability 0 ({code})"
            counts[index[code]] += k
    stat, p = chisquare(counts, law.probs * n)
    verdict = Verdict(name, length, law.support, n, float(stat), float(p))
    assert p > ALPHA, f"{name}: the reference does not follow the exact law (p = {p:.3g}): {verdict.statement()}"
    return verdict


def check_path(name: str, run: Callable[[int], Sequence[int]], rows, prompt_len: int, params: SamplingParams,
               length: int = LENGTH, rounding: float | None = None, seeds: int = N_SEEDS) -> int:
    """Check B: `run(seed)`'s first `length` tokens equal the reference's for seeds 0..seeds-1
    (N_SEEDS for the full power; fewer where runs are dear: Verdict.statement says what they detect).

    `rounding`: logits the path's verify rows may differ by from the reference's (drafting at
    widths the probe found inexact, under allow_inexact). A run may then part from the reference
    only at a near-tie that rounding can flip: where its token's race value is within
    exp(2 * rounding / T) of the reference winner's. Returns how many runs parted so."""
    want = reference(np.arange(seeds), rows, prompt_len, params, length)
    parted = 0
    for seed in range(seeds):
        got = list(run(seed))[:length]
        if got != want[seed].tolist():
            assert rounding is not None and _near_tie(seed, got, want[seed].tolist(), rows, prompt_len, params,
                                                      rounding), \
                f"{name}: seed {seed} gave {got}, plain decoding with that seed {want[seed].tolist()}"
            parted += 1
    return parted


def _near_tie(seed: int, got: list[int], want: list[int], rows, prompt_len: int, params: SamplingParams,
              rounding: float) -> bool:
    """Whether `got` parts from `want` first at a race the reference's winner won by less than
    logits off by `rounding` could change."""
    t = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    dist = sampling.distribution(rows(want[:t]), params)
    pair = np.array([got[t], want[t]])
    p = dist.probs_at(pair)
    if not p[0] > 0:  # outside the reference's top-k: rounding may have moved the cut
        row = rows(want[:t])
        kth = np.sort(row)[::-1][params.top_k - 1] if params.top_k else np.inf
        return bool(row[got[t]] >= kth - 2 * rounding)
    values = noise(np.array([seed]), prompt_len + t, pair)[0] / p
    return bool(values[0] / values[1] <= math.exp(2 * rounding / params.temperature))
