"""Sampling parameters and the logits → probabilities transform shared by target and draft."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from edgespec.errors import ConfigError

__all__ = ["SamplingParams", "check_max_tokens", "probabilities", "sample", "top_probability"]

logger = logging.getLogger(__name__)

# A nucleus whose cumulative mass falls short of top_p only by rounding counts as reaching it.
_TOP_P_TOLERANCE = 1e-12


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into the next token. `temperature == 0` means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not math.isfinite(self.temperature):
            raise ConfigError(f"temperature must be finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top-k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise ConfigError(f"seed must be an integer >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_max_tokens(max_tokens: int, name: str = "max-tokens") -> int:
    """`max_tokens` if it asks for at least one new token; the one check every caller uses."""
    if isinstance(max_tokens, bool) or not hasattr(max_tokens, "__index__") or max_tokens < 1:
        raise ConfigError(f"{name} must be >= 1, got {max_tokens}")
    return int(max_tokens)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Float64 probabilities `(..., V)` after temperature, top-k and top-p, renormalised per row.

    Greedy params give a one-hot at the argmax, so greedy decoding is sampling from a point mass.
    Top-k keeps ties with the k-th largest logit, so it may keep slightly more than k tokens.
    """
    x = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        out = np.zeros_like(x)
        np.put_along_axis(out, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return out
    x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k, axis=-1)[..., -params.top_k, None]
        x = np.where(x >= kth, x, -np.inf)
    # subtract the row max so exp never overflows
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        p = _nucleus(p, params.top_p)
    return p


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the top one)."""
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    cum = np.cumsum(sorted_p, axis=-1)
    mass_before = cum - sorted_p  # exclusive cumsum: mass of strictly more likely tokens
    mass_before[..., 0] = 0.0
    keep_sorted = mass_before < top_p - _TOP_P_TOLERANCE
    keep_sorted[..., 0] = True
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    p = np.where(keep, p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


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
