"""The chi-square check the sampling tests share: observed token counts against a distribution."""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

MIN_EXPECTED = 5  # chi-square needs about 5 expected counts per bin: rarer tokens share one bin


def pooled_chi_square_p(counts: np.ndarray, p: np.ndarray) -> float:
    """The p-value of `counts` (per token id) drawn from `p`, the tokens expected fewer than
    MIN_EXPECTED times pooled into one bin; a token drawn outside p's support fails at once."""
    counts, expected = np.asarray(counts, dtype=float), np.asarray(p, dtype=float) * float(np.sum(counts))
    assert counts[expected == 0].sum() == 0, "a token outside the distribution's support was drawn"
    big, rare = expected >= MIN_EXPECTED, (expected > 0) & (expected < MIN_EXPECTED)
    obs, exp = counts[big], expected[big]
    if rare.any():
        obs, exp = np.append(obs, counts[rare].sum()), np.append(exp, expected[rare].sum())
    assert len(obs) >= 2, "too few bins for a chi-square test"
    return float(chisquare(obs, exp).pvalue)
