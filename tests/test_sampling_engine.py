"""Speculative sampling through the whole engine keeps the target's distribution.

With a draft from a different model (so the draft's distribution is far from the target's and
drafts are both kept and replaced often), the first generated token over many seeded runs must
follow the target's softmax at that position. The exact oracle with its stated power:
tests/test_oracle.py and tests/test_oracle_engine.py.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.bundle import load_bundle
from edgespec.decoding import SamplingParams, probabilities
from edgespec.engine.engine import load
from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime
from tests.tiny import PROMPTS
from tests.zoo import OTHER_SEED

N_RUNS = 3000
MIN_EXPECTED = 5  # chi-square needs about 5 expected counts per bin: rarer tokens share one bin
P_MIN = 1e-3


def next_token_probs(bundle_path, role: str, ids: list[int], params: SamplingParams) -> np.ndarray:
    b = load_bundle(bundle_path)
    entry = b.manifest.target if role == "target" else b.manifest.draft
    with OnnxRuntime(b.file(entry.formats["onnx"].file)) as rt:
        return probabilities(rt.forward(ids, n_logits=1)[-1], params)


def chi_square_p(counts: Counter, p: np.ndarray) -> float:
    n = sum(counts.values())
    observed = np.bincount(list(counts.elements()), minlength=len(p)).astype(float)
    big = n * p >= MIN_EXPECTED
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(n * p[big], n * p[~big].sum())
    return float(chisquare(obs, exp).pvalue)


def first_tokens(engine, ids) -> tuple[Counter, int, int]:
    """N_RUNS seeded samples at temperature 1: the first tokens' counts, drafted and accepted.
    max_tokens=2: one drafted token (a budget of 1 would draft nothing) plus the target's."""
    firsts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(N_RUNS):
        rs = list(engine.stream(ids, max_tokens=2, temperature=1.0, seed=seed))
        firsts[rs[0].token_ids[0]] += 1
        drafted += engine.last_stats.drafted
        accepted += engine.last_stats.accepted
    return firsts, drafted, accepted


def test_first_sampled_token_follows_the_target(zoo):
    path = zoo.bundle("gemma3", OTHER_SEED)
    params = SamplingParams(temperature=1.0)
    with load(path, k=4, drafter="model", threads=1) as engine:
        ids = engine.tokenizer.encode(PROMPTS[1])
        p = next_token_probs(path, "target", ids, params)
        q = next_token_probs(path, "draft", ids, params)
        firsts, drafted, accepted = first_tokens(engine, ids)

    assert drafted == N_RUNS
    # drafts were kept and replaced many times
    assert 0.05 * N_RUNS < accepted < 0.95 * N_RUNS, accepted
    assert (n_bins := int((N_RUNS * p >= MIN_EXPECTED).sum())) >= 20, n_bins
    assert chi_square_p(firsts, p) > P_MIN

    # the test has power: samples from the draft alone, binned the same way, are rejected
    rng = np.random.default_rng(0)
    from_draft = Counter(rng.choice(len(q), size=N_RUNS, p=q / q.sum()).tolist())
    assert chi_square_p(from_draft, p) < 1e-6


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_with_a_draft_matches_the_target_pointwise(zoo, seed):
    """Seeded runs are reproducible, and every committed token was possible under the target."""
    path = zoo.bundle("gemma3", OTHER_SEED)
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9)
    with load(path, k=3, drafter="model") as engine:
        ids = engine.tokenizer.encode(PROMPTS[0])
        kw = dict(max_tokens=12, temperature=0.7, top_k=40, top_p=0.9, seed=seed)
        out = [t for r in engine.stream(ids, **kw) for t in r.token_ids]
        assert [t for r in engine.stream(ids, **kw) for t in r.token_ids] == out
    b = load_bundle(path)
    with OnnxRuntime(b.file(b.manifest.target.formats["onnx"].file)) as rt:
        logits = rt.forward(ids + out, n_logits=len(out) + 1)[:-1]
    allowed = probabilities(logits, params)  # zero outside each position's top-k/top-p set
    assert all(allowed[i, t] > 0 for i, t in enumerate(out))


def test_sampling_with_recycled_drafts_follows_the_target(zoo):
    """Token Recycling drafts the target's own earlier top-1 as a point mass: exact all the same."""
    path = zoo.bundle("gemma3", None)
    params = SamplingParams(temperature=1.0)
    with load(path, k=1, drafter="recycle", threads=1) as engine:
        ids = engine.tokenizer.encode(PROMPTS[1])
        p = next_token_probs(path, "target", ids, params)
        firsts, drafted, accepted = first_tokens(engine, ids)
        guess = engine.decoder.drafter.table.chain(ids[-1], 1)

    # the first run fills the table; from then on every run drafts the target's top-1 there
    assert drafted == N_RUNS - 1 and guess == [int(np.argmax(p))]
    assert 0.05 * N_RUNS < accepted < 0.95 * N_RUNS, accepted  # both branches of the test ran
    assert chi_square_p(firsts, p) > P_MIN
