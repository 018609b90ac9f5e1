"""Sampling parameters, and logits -> distributions shared by target and draft.

`distribution()` is the fast path: top-k by a partial selection, then temperature, softmax, top-p
and min_p on the candidates only, or a dense float32 row for pure temperature (token_dist.py).
`probabilities()` is the reference it must equal (a float64 row of the whole vocabulary), kept
as the test oracle and for small rows.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgespec.checks import is_int, is_number
from edgespec.decoding.token_dist import Candidates, DenseDist, TokenDist
from edgespec.errors import ConfigError

__all__ = [
    "LazyDists", "SamplingParams", "check_max_tokens", "distribution", "probabilities", "sample", "top_probability",
]

logger = logging.getLogger(__name__)

# A nucleus whose cumulative mass falls short of top_p only by rounding counts as reaching it.
_TOP_P_TOLERANCE = 1e-12


# SamplingParams' numbers, by attribute and by the option name users type
_NUMBERS = (("temperature", "temperature"), ("top_p", "top-p"), ("min_p", "min-p"))
# then each value's range, in this order (the numbers are numbers by then): attribute, test, rule
_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("temperature", lambda t: t >= 0, "temperature must be >= 0"),  # also rejects NaN
    ("temperature", math.isfinite, "temperature must be finite"),
    ("top_p", lambda p: 0 < p <= 1, "top-p must be in (0, 1]"),
    ("top_k", lambda k: is_int(k) and k >= 0, "top-k must be an integer >= 0 (0 disables it)"),
    ("min_p", lambda p: 0 <= p < 1, "min-p must be in [0, 1)"),
    ("seed", lambda s: s is None or (is_int(s) and s >= 0), "seed must be an integer >= 0"),
)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into the next token. `temperature == 0` means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # keep tokens at least min_p times as likely as the likeliest, after top-p (0 disables it)
    min_p: float = 0.0

    def __post_init__(self) -> None:
        for attr, option in _NUMBERS:
            # a string from a form or a JSON file is the caller's mistake, named as one
            if not is_number(getattr(self, attr)):
                raise ConfigError(f"{option} must be a number, got {getattr(self, attr)!r}")
        for attr, holds, rule in _RULES:
            if not holds(getattr(self, attr)):
                raise ConfigError(f"{rule}, got {getattr(self, attr)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_max_tokens(max_tokens: int, name: str = "max-tokens") -> int:
    """`max_tokens` if it asks for at least one new token; the one check every caller uses."""
    if not is_int(max_tokens):
        raise ConfigError(f"{name} must be an integer >= 1, got {max_tokens!r} ({type(max_tokens).__name__})")
    if max_tokens < 1:
        raise ConfigError(f"{name} must be >= 1, got {max_tokens}")
    return int(max_tokens)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Float64 probabilities `(..., V)` after top-k, temperature, top-p and min_p, renormalised
    per row: the reference `distribution()` must equal.

    Greedy params give a one-hot at the argmax, so greedy decoding is sampling from a point mass.
    Top-k keeps ties with the k-th largest logit, so it may keep slightly more than k tokens.
    min_p then keeps, of what top-p kept, the tokens whose probability is at least min_p times
    the likeliest token's: exp(x/T - max(x/T)) >= min_p, that ratio computed before any
    normalising sum (so its rounding cannot move the cut); the rest is renormalised. The
    likeliest token always stays, so at least one token does.
    """
    x = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        out = np.zeros_like(x)
        np.put_along_axis(out, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return out
    x = _scaled(x, params.temperature)
    if 0 < params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k, axis=-1)[..., -params.top_k, None]
        x = np.where(x >= kth, x, -np.inf)
    # subtract the row max so exp never overflows
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        p = _nucleus(p, params.top_p)
    if params.min_p > 0:
        p = np.where(e >= params.min_p, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def _scaled(x: np.ndarray, t: float) -> np.ndarray:
    """x / T; where a temperature this small overflows it (5e-324 is a valid float), the same
    distribution from the differences to each row's largest logit instead: 0 for it, -inf for the
    logits T leaves no mass, which is the T -> 0 limit (the likeliest token, ties shared equally),
    not the NaN an inf - inf gives."""
    with np.errstate(over="ignore"):
        q = x / t
    if np.isinf(q[np.isfinite(x)]).any():
        with np.errstate(over="ignore"):
            q = (x - x.max(axis=-1, keepdims=True)) / t
    return q


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the top one)."""
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    keep_sorted = _nucleus_prefix(sorted_p, top_p)
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    p = np.where(keep, p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


def _nucleus_prefix(sorted_p: np.ndarray, top_p: float) -> np.ndarray:
    """Which of the sorted probabilities the nucleus keeps: those whose strictly more likely
    predecessors hold less than top_p (the first always)."""
    cum = np.cumsum(sorted_p, axis=-1)
    mass_before = cum - sorted_p  # exclusive cumsum: mass of strictly more likely tokens
    mass_before[..., 0] = 0.0
    keep_sorted = mass_before < top_p - _TOP_P_TOLERANCE
    keep_sorted[..., 0] = True
    return keep_sorted


# ---------------------------------------------------------------- the fast path

# temperatures between these keep x / T a normal float64 for any finite float32 logit (so the
# division keeps distinct logits distinct: top-k's ties are the logits' own) and 1 / T a float32
_SAFE_T = (1e-30, 1e30)
# top-p without top-k: the first candidate prefix tried, and its growth until the nucleus fits
_FIRST_PREFIX, _GROWTH = 256, 8
# float64 exps are summed over chunks of the row this long (no float64 copy of the whole row)
_CHUNK = 1 << 15
# top-k's first candidates: logits this close to the row's maximum; the span grows fourfold,
# this many times, until it holds k of them
_TOP_K_SPAN, _TOP_K_TRIES = 8.0, 4


def distribution(logits_row: np.ndarray, params: SamplingParams) -> TokenDist:
    """The distribution `probabilities(logits_row, params)` describes, built without a float64
    row of the vocabulary: the same support and the same probabilities to float rounding.

    Greedy: a point mass at the argmax (the first on ties, as np.argmax). Top-k: an
    `np.argpartition`, then every logit >= the k-th (ties kept, as the reference keeps them),
    then temperature, softmax, top-p (sorting those candidates by probability, ties by id) and
    min_p on the candidates only. Pure temperature (top-k 0, top-p 1, min_p 0): a `DenseDist` of
    float32 exps, exact to their float32 rounding. Top-p without top-k: see `_nucleus_candidates`.
    """
    row = np.asarray(logits_row)
    if row.ndim != 1 or not len(row):
        raise ValueError(f"distribution() takes one non-empty row of logits, got shape {row.shape}")
    if params.greedy:
        return Candidates(np.array([int(np.argmax(row))], dtype=np.int64), np.ones(1))
    t, vocab = params.temperature, len(row)
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if not _SAFE_T[0] <= t <= _SAFE_T[1] or not np.isfinite(float(row.max()) / t):
        # x / T overflows or underflows: ties appear that the logits lack; the reference decides
        return Candidates.from_row(probabilities(row, params))
    if not top_k and params.top_p == 1.0 and params.min_p == 0:
        return _dense(row, t)
    if top_k:
        ids = _top_k_ids(row, top_k, t)
        e = np.exp(row[ids].astype(np.float64) / t - float(row[ids].max()) / t)
        p = e / e.sum()
        if params.top_p < 1.0:
            p = _candidate_nucleus(p, params.top_p)
    elif params.top_p < 1.0:
        ids, e, p = _nucleus_candidates(row, t, params.top_p)
    else:  # min_p alone: its cut in logit space picks the candidates
        ids = _min_p_ids(row, t, params.min_p)
        e = np.exp(row[ids].astype(np.float64) / t - float(row.max()) / t)
        p = e / e.sum()
    if params.min_p > 0:
        p = np.where(e >= params.min_p, p, 0.0)
    out = Candidates.build(ids, p)
    if out is None:  # NaN logits: the reference's answer, whatever it is
        return Candidates.from_row(probabilities(row, params))
    return out


def _dense(row: np.ndarray, t: float) -> DenseDist:
    """Pure temperature: float32 exp((x - max) / T) of the whole row and its float64 sum."""
    w = np.subtract(row, row.max(), dtype=np.float32)
    w *= np.float32(1.0 / t)
    np.exp(w, out=w)
    dist = DenseDist.from_weights(w)
    if dist is None:
        raise ValueError("logits hold no finite maximum (NaN or all -inf)")
    return dist


def _kth_largest(row: np.ndarray, k: int):
    """The k-th largest logit of `row` (1 <= k < len(row)). The candidates are first the logits
    near the maximum, found in one comparison pass, and only they are partitioned: a partition of
    the whole vocabulary costs a sampled step more than its head's product does. A flat row (or a
    row without a finite maximum) ends in a partition of the whole row, as before."""
    top = row.max()
    span = _TOP_K_SPAN
    for _ in range(_TOP_K_TRIES if np.isfinite(top) else 0):
        near = row[row >= top - span]
        if len(near) >= k:
            return near[np.argpartition(near, len(near) - k)[len(near) - k:]].min()
        span *= 4
    return row[np.argpartition(row, len(row) - k)[len(row) - k:]].min()


def _top_k_ids(row: np.ndarray, k: int, t: float) -> np.ndarray:
    """Ascending ids of the logits whose x / T is >= the k-th largest x / T (ties included)."""
    kth = _kth_largest(row, k)
    # x / T rounds monotonically, so every logit >= the k-th is kept; a logit a rounding step
    # below it may round onto the same quotient (float64 rows), so look a hair lower and test
    # the quotients themselves
    below = float(kth) - 1e-9 * (abs(float(kth)) + 1e-300)
    ids = np.flatnonzero(row >= row.dtype.type(below) if row.dtype.kind == "f" else row >= below)
    q = row[ids].astype(np.float64) / t
    return ids[q >= float(kth) / t]


def _min_p_ids(row: np.ndarray, t: float, min_p: float) -> np.ndarray:
    """Ascending ids of a superset of min_p's cut exp(x/T - max/T) >= min_p (the exact test
    follows on the candidates): logits within T * -log(min_p) of the max, and a margin."""
    top = float(row.max())
    cut = top + t * math.log(min_p)
    return np.flatnonzero(row >= cut - 1e-3 * (abs(cut) + 1.0))


def _candidate_nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p on candidates in ascending id order: a stable sort by probability breaks ties by id,
    as the reference's stable sort over the whole row does. Renormalised."""
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), dtype=bool)
    keep[order] = _nucleus_prefix(p[order], top_p)
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _nucleus_candidates(row: np.ndarray, t: float, top_p: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-p over the whole row without sorting it: (ascending ids, exps, nucleus probabilities).

    The normaliser is the sum of every exp, in float64 over chunks. Then the prefix C of the
    likeliest tokens (every logit >= the n-th largest, by argpartition) grows until the nucleus
    cut falls on a token strictly likelier than C's least likely one. Exact, because every token
    outside C is at most that likely: the reference's order by (probability, id) begins with the
    kept tokens of C in C's own order, and the first token it drops has the same mass before it.
    A flat row (a nucleus of a large part of the vocabulary) ends in one sort of the whole row, as
    the reference does, with float64 exps of the whole row: the one sampled path that builds one."""
    vocab, top = len(row), float(row.max()) / t
    z = 0.0
    for s in range(0, vocab, _CHUNK):
        z += float(np.exp(row[s:s + _CHUNK].astype(np.float64) / t - top).sum())
    n = min(_FIRST_PREFIX, vocab)
    while True:
        if n >= vocab:
            ids = np.arange(vocab)
        else:
            nth = row[np.argpartition(row, vocab - n)[vocab - n:]].min()
            ids = np.flatnonzero(row >= nth)
        e = np.exp(row[ids].astype(np.float64) / t - top)
        p = e / z
        order = np.argsort(-p, kind="stable")
        sorted_p = p[order]
        keep_sorted = _nucleus_prefix(sorted_p, top_p)
        cut = int(keep_sorted.sum())
        if len(ids) == vocab or (cut < len(ids) and sorted_p[cut - 1] > sorted_p[-1]):
            break
        # past a quarter of the row, selecting costs more than sorting it all
        n = n * _GROWTH if 4 * n * _GROWTH <= vocab else vocab
    keep = np.zeros(len(ids), dtype=bool)
    keep[order] = keep_sorted
    p = np.where(keep, p, 0.0)
    return ids, e, p / p.sum()


class LazyDists(Sequence[TokenDist]):
    """The target's distributions of a verify's rows, each built when first asked for: row i is
    needed only if the drafts before it were accepted. Valid while `logits` is (until the next
    forward); a row is not kept, so at most one full-width row is alive at a time."""

    def __init__(self, logits: np.ndarray, params: SamplingParams) -> None:
        self.logits, self.params = logits, params

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i):  # type: ignore[override] - rows only, no slices
        return distribution(self.logits[i], self.params)


def sample(probs_row: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a 1-D probability vector (need not be exactly normalised)."""
    cdf = np.cumsum(probs_row, dtype=np.float64)
    # side="right" never lands on a zero-probability token
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if i >= len(cdf):  # rounding at the very top of the cdf
        i = int(np.flatnonzero(probs_row)[-1])
    return i


def top_probability(logits: np.ndarray) -> float:
    """Largest softmax probability of one row of raw logits (temperature 1): a model's confidence."""
    x = np.asarray(logits, dtype=np.float32)
    # 1 / sum(exp(x - max)) is the softmax at the argmax, without normalising the whole row
    return float(1.0 / np.exp(x - x.max()).sum(dtype=np.float64))
