"""Slow tier: speculative sampling on the real default model keeps the target's distribution.

The draft (the target's body under its 16k VocabTrim head) proposes one token a step; over many
seeded runs the first committed token, accepted or resampled from the residual, must follow the
target's own distribution at that position (the reference `probabilities()`), at chat's
sampler and at pure temperature 1."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.decoding import SamplingParams, probabilities

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea, there lived a"
N_RUNS = 1200
MIN_EXPECTED = 5  # chi-square wants about 5 expected counts a bin: rarer tokens share one bin
P_MIN = 1e-3


def _chi_square_p(counts: Counter, p: np.ndarray) -> float:
    n = sum(counts.values())
    observed = np.zeros(len(p))
    for tok, c in counts.items():
        observed[tok] += c
    big = n * p >= MIN_EXPECTED
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(n * p[big], n * p[~big].sum())
    if exp[-1] == 0:  # no rare tokens: the last bin is empty on both sides
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("sampling", [dict(temperature=0.7, top_p=0.95, top_k=40), dict(temperature=1.0)],
                         ids=["chat-defaults", "temperature-1"])
def test_real_model_speculative_sampling_follows_the_target(default_cache, sampling):
    import edgespec

    with edgespec.load(drafter="model", policy="fixed", k=1) as engine:
        ids = engine.tokenizer.encode(PROMPT)
        engine.target.reset()
        p = probabilities(engine.target.forward(ids, n_logits=1)[-1], SamplingParams(**sampling))
        engine.target.reset()
        firsts: Counter = Counter()
        drafted = accepted = 0
        for seed in range(N_RUNS):
            # two tokens: one drafted and verified, then the target's own
            rs = list(engine.stream(ids, max_tokens=2, seed=seed, **sampling))
            firsts[rs[0].token_ids[0]] += 1
            drafted += engine.last_stats.drafted
            accepted += engine.last_stats.accepted
    # both branches ran: drafts accepted, and drafts rejected and resampled from the residual
    assert drafted >= N_RUNS // 2 and 0 < accepted < drafted
    assert _chi_square_p(firsts, p) > P_MIN
