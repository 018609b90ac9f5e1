"""The sampler on candidates: `distribution()` equals the reference `probabilities()`, and
speculative sampling on sparse / dense distributions stays lossless for every drafter path."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.decoding import (
    Candidates,
    DenseDist,
    Draws,
    FixedK,
    LazyDists,
    SamplingParams,
    SpeculativeDecoder,
    TokenDist,
    accept_coupled,
    distribution,
    probabilities,
)
from edgespec.decoding.tree import DraftTree, accept_tree_coupled
from edgespec.errors import ConfigError
from edgespec.runtimes.base import Capabilities, Runtime
from tests.toy import ToyRuntime

V = 50
PROMPT = [3, 14, 15, 9, 26]
KEEP = np.arange(0, V, 2)  # a trimmed draft head: even target ids only
P_MIN = 1e-3

PARAMS = {
    "top-k/top-p": SamplingParams(temperature=1.0, top_p=0.9, top_k=12),
    "top-p": SamplingParams(temperature=1.0, top_p=0.9),
    "min-p": SamplingParams(temperature=1.2, top_k=30, min_p=0.05),
    "temperature": SamplingParams(temperature=1.0),
}


def assert_same(dist: TokenDist, ref: np.ndarray) -> None:
    """Same support and probabilities to float rounding (a dense row to its float32 exps)."""
    got = dist.dense(len(ref))
    if isinstance(dist, DenseDist):
        # float32 exps: relative error grows with |x - max| / T, so tiny probabilities get an absolute bound
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-9)
    else:
        np.testing.assert_array_equal(np.flatnonzero(got), np.flatnonzero(ref))
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=0)


def chi_p(counts: np.ndarray, p: np.ndarray) -> float:
    """Chi-square p-value of counts against p, rare bins pooled (expected >= 5 per bin)."""
    assert counts[p == 0].sum() == 0, "a token outside the target's support was committed"
    expected = p * counts.sum()
    big, rare = expected >= 5, (expected > 0) & (expected < 5)
    obs, exp = counts[big], expected[big]
    if rare.any():
        obs, exp = np.append(obs, counts[rare].sum()), np.append(exp, expected[rare].sum())
    return float(chisquare(obs, exp).pvalue)


# ---------------------------------------------------------------- distribution() == probabilities()


def test_distribution_equals_reference_on_random_rows():
    rng = np.random.default_rng(0)
    kinds = set()
    for trial in range(1500):
        vocab = int(rng.integers(2, 400))
        row = rng.standard_normal(vocab) * rng.choice([0.3, 3.0, 30.0])
        if trial % 3 == 0:  # integer logits: ties everywhere, at the k-th and the nucleus boundary
            row = np.round(row)
        row = row.astype(rng.choice([np.float32, np.float64]))
        params = SamplingParams(temperature=float(rng.choice([0.2, 0.7, 1.0, 2.5])),
                                top_p=float(rng.choice([1.0, 0.95, 0.6, 0.1])),
                                top_k=int(rng.choice([0, 1, 3, 40, 10_000])),
                                min_p=float(rng.choice([0.0, 0.0, 0.02, 0.5])))
        dist = distribution(row, params)
        kinds.add(type(dist))
        assert_same(dist, probabilities(row, params))
    assert kinds == {Candidates, DenseDist}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=2),  # ties with the 2nd largest: all kept
    SamplingParams(temperature=1.0, top_k=3, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=0.5),  # the nucleus ends inside a tie: lower ids first
    SamplingParams(temperature=1.0, top_p=0.75),
    SamplingParams(temperature=1.0, top_k=100),  # top-k larger than the vocabulary
    SamplingParams(temperature=0.5, top_p=1.0, min_p=0.25),
    SamplingParams(temperature=1.0, top_p=0.6, min_p=0.9),
])
def test_distribution_keeps_the_reference_ties(params):
    rows = [np.log(np.array([0.1, 0.2, 0.4, 0.2, 0.1])),
            np.log(np.array([0.2, 0.2, 0.2, 0.2, 0.2])),
            np.array([0.0, 3.0, 2.0, 3.0, 2.0, 2.0, -np.inf, 1.0]),
            np.array([5.0, 5.0, 5.0, 1.0], dtype=np.float32)]
    for row in rows:
        assert_same(distribution(row, params), probabilities(row, params))
    row = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0])
    kept = distribution(row, SamplingParams(temperature=1.0, top_k=3))
    assert kept.ids.tolist() == [1, 2, 3, 4, 5]  # the three logits tied with the 3rd largest


def test_top_k_partitions_only_the_logits_near_the_maximum():
    """The k-th largest logit is found among the logits near the maximum (a span that grows until
    it holds k of them), never by partitioning the whole row: it must equal the whole row's."""
    from edgespec.decoding import sampling

    rng = np.random.default_rng(2)
    rows = [(rng.standard_normal(50_000) * scale).astype(np.float32) for scale in (0.5, 3.0, 40.0, 400.0)]
    rows.append(np.full(1000, 2.0, dtype=np.float32))  # one tie across the row
    rows.append(np.r_[np.full(999, -np.inf), 1.0])  # fewer finite logits than k: the whole row decides
    for row in rows:
        for k in (1, 40, 999):
            want = row[np.argpartition(row, len(row) - k)[len(row) - k:]].min()
            assert sampling._kth_largest(row, k) == want
        params = SamplingParams(temperature=0.7, top_k=40, top_p=0.95)
        assert_same(distribution(row, params), probabilities(row, params))
    calls = []
    real = np.argpartition
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(np, "argpartition", lambda a, *args, **kw: calls.append(len(a)) or real(a, *args, **kw))
        distribution(rows[1], SamplingParams(temperature=0.7, top_k=40))
    assert calls and max(calls) < len(rows[1]) // 10  # only candidates were partitioned


def test_top_p_alone_grows_its_prefix_exactly():
    rng = np.random.default_rng(1)
    vocab = 20_000  # beyond the first prefixes tried, so the growth and the whole-row sort both run
    for scale, ties in ((6.0, False), (1.0, False), (0.05, False), (3.0, True)):
        row = (rng.standard_normal(vocab) * scale).astype(np.float32)
        if ties:  # a block of equal logits right at the first prefix's edge
            order = np.argsort(-row)
            row[order[200:400]] = row[order[200]]
        for top_p in (0.5, 0.9, 0.99):
            params = SamplingParams(temperature=0.8, top_p=top_p)
            assert_same(distribution(row, params), probabilities(row, params))


def test_greedy_is_a_point_mass_at_the_first_argmax():
    dist = distribution(np.array([1.0, 4.0, 4.0, 0.0]), SamplingParams())
    assert dist.ids.tolist() == [1] and dist.probs.tolist() == [1.0]
    assert dist.sample(Draws(0).at(0)) == 1


def test_min_p_keeps_tokens_within_its_ratio_of_the_likeliest():
    p = np.array([0.5, 0.3, 0.1, 0.06, 0.04])
    params = SamplingParams(temperature=1.0, min_p=0.2)  # keeps p >= 0.1
    ref = probabilities(np.log(p), params)
    np.testing.assert_allclose(ref, [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9, 0, 0])
    assert_same(distribution(np.log(p), params), ref)
    # after top-p (0.5 + 0.3 reach 0.8), of what top-p kept
    np.testing.assert_allclose(probabilities(np.log(p), SamplingParams(temperature=1.0, top_p=0.8, min_p=0.7)),
                               [1, 0, 0, 0, 0])


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), True])
def test_min_p_is_validated(bad):
    with pytest.raises(ConfigError, match="min-p"):
        SamplingParams(temperature=1.0, min_p=bad)


def test_dense_distribution_samples_the_reference():
    rng = np.random.default_rng(2)
    row = (rng.standard_normal(3000) * 2).astype(np.float32)  # three blocks, the last one short
    params = SamplingParams(temperature=0.9)
    dist = distribution(row, params)
    assert isinstance(dist, DenseDist) and dist.weights.dtype == np.float32
    ref = probabilities(row, params)
    assert dist.prob(int(np.argmax(row))) == pytest.approx(ref.max(), rel=1e-6)
    small = distribution(row[:30], params)
    draws = Draws(2)
    counts = np.bincount([small.sample(draws.at(i)) for i in range(20_000)], minlength=30)
    assert chi_p(counts, probabilities(row[:30], params)) > P_MIN
    big = np.bincount([dist.sample(draws.at(i)) for i in range(20_000)], minlength=3000)
    top = np.argsort(-ref)[:20]  # the likeliest tokens alone, the rest pooled
    obs = np.append(big[top], big.sum() - big[top].sum())
    assert chisquare(obs, np.append(ref[top], 1 - ref[top].sum()) * big.sum()).pvalue > P_MIN


# ---------------------------------------------------------------- races (draws.py)


def test_the_noise_is_independent_exponentials():
    """E over ids of many blocks (the block minima built in) is Exp(1), with no trace of the
    block structure: the minimum of each block is Exp(BLOCK), as n independent Exp(1) give."""
    from scipy.stats import kstest

    from edgespec.decoding.draws import BLOCK

    noise = Draws(11).at(5)
    e = noise.at(np.arange(200 * BLOCK))
    assert kstest(e, "expon").pvalue > P_MIN
    minima = e.reshape(200, BLOCK).min(axis=1)
    assert kstest(minima * BLOCK, "expon").pvalue > P_MIN
    np.testing.assert_array_equal(minima, noise.blocks(np.arange(200))[0])
    # another position, another seed: other draws, uncorrelated
    other = Draws(11).at(6).at(np.arange(200 * BLOCK)), Draws(12).at(5).at(np.arange(200 * BLOCK))
    assert all(abs(np.corrcoef(e, o)[0, 1]) < 0.02 for o in other)


@pytest.mark.parametrize("scale", [0.1, 2.0, 8.0])
def test_a_dense_race_finds_the_winner_of_the_whole_row(scale):
    """The dense race computes E in a few blocks only; its winner is the whole row's."""
    rng = np.random.default_rng(3)
    row = (rng.standard_normal(5000) * scale).astype(np.float32)
    row[rng.choice(5000, 50)] = -np.inf  # weights of zero never win
    dist = distribution(row, SamplingParams(temperature=1.0))
    assert isinstance(dist, DenseDist)
    for position in range(200):
        noise = Draws(1).at(position)
        assert dist.sample(noise) == noise.race(np.arange(5000), dist.weights)


def test_one_distribution_draws_one_token_whatever_its_form():
    """Dense, dense placed by an id map, or candidates: the same distribution against the same
    noise draws the same token (the target's row and a draft's may take different forms)."""
    rng = np.random.default_rng(4)
    vocab = 2500
    keep = np.sort(rng.choice(vocab, 700, replace=False))  # a trimmed dense draft, in target ids
    index = np.full(vocab, len(keep))
    index[keep] = np.arange(len(keep))
    trimmed = distribution(rng.standard_normal(len(keep)).astype(np.float32),
                           SamplingParams(temperature=1.3)).mapped(keep, index)
    np.testing.assert_allclose(trimmed.dense(vocab)[keep].sum(), 1.0)
    full = np.full(vocab, -np.inf, dtype=np.float32)
    full[keep] = np.log(trimmed.weights)
    dense = distribution(full, SamplingParams(temperature=1.0))
    sparse = Candidates.build(keep, trimmed.weights)
    for position in range(300):
        noise = Draws(9).at(position)
        assert trimmed.sample(noise) == dense.sample(noise) == sparse.sample(noise)


# ---------------------------------------------------------------- lossless, every drafter path


def _target_p(target: ToyRuntime, ids: list[int], params: SamplingParams) -> np.ndarray:
    target.reset()
    p = probabilities(target.forward(ids)[-1], params)
    target.reset()
    return p


def _run(dec: SpeculativeDecoder, prompt: list[int], params: SamplingParams, n: int) -> tuple[np.ndarray, dict, int]:
    """First-token counts, second-token counts per first token, and drafts accepted, over n streams."""
    first, second, accepted = np.zeros(V), {}, 0
    kw = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)
    for i in range(n):
        tokens = list(prompt)
        for step in dec.stream(tokens, SamplingParams(seed=i, **kw), 2):
            accepted += step.accepted
        a, b = tokens[len(prompt):len(prompt) + 2]
        first[a] += 1
        second.setdefault(a, np.zeros(V))[b] += 1
    return first, second, accepted


def assert_lossless(dec: SpeculativeDecoder, target: ToyRuntime, prompt: list[int], params: SamplingParams,
                    n: int = 2500) -> int:
    first, second, accepted = _run(dec, prompt, params, n)
    assert chi_p(first, _target_p(target, prompt, params)) > P_MIN
    common = sorted(second, key=lambda x: -second[x].sum())[:2]
    assert second[common[0]].sum() >= 300
    for x in common:
        if second[x].sum() >= 300:  # the second token given the first
            assert chi_p(second[x], _target_p(target, prompt + [x], params)) > P_MIN, x
    return accepted


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("trimmed", [True, False])
def test_model_drafts_commit_the_target_distribution(name, trimmed):
    params = PARAMS[name]
    target = ToyRuntime(V, seed=0)
    draft = ToyRuntime(V, seed=0, noise=0.5, keep=KEEP if trimmed else None)
    dec = SpeculativeDecoder(target, draft, id_map=KEEP if trimmed else None, policy=FixedK(1))
    accepted = assert_lossless(dec, target, PROMPT, params)
    assert 0 < accepted < 2500  # drafts kept and replaced


@pytest.mark.parametrize("name", ["top-k/top-p", "temperature"])
def test_point_mass_drafts_commit_the_target_distribution(name):
    params = PARAMS[name]
    target = ToyRuntime(V, seed=0)
    # lookup proposes x (what followed the earlier 3 14 15 9): the x the target likes most there
    prompts = [[3, 14, 15, 9, x, 5, 35, 8, 3, 14, 15, 9] for x in range(V)]
    prompt = max(prompts, key=lambda pr: _target_p(target, pr, params)[pr[4]])
    dec = SpeculativeDecoder(target, drafter="ngram", policy=FixedK(1))
    accepted = assert_lossless(dec, target, prompt, params)
    assert 0 < accepted < 2500


class HeadStub(Runtime):
    """A trained draft head's interface (HeadDrafter): hidden rows, a feature head and a K-wide
    head. Its "features" carry the ids seen so far, and its head is a noisy toy model's logits
    after them, so its drafts resemble the target's."""

    def __init__(self, vocab: int, keep: np.ndarray | None = None) -> None:
        self.toy = ToyRuntime(vocab, seed=0, noise=0.5, keep=keep)
        self.keep, self.vocab_size = keep, self.toy.vocab_size
        self.capabilities = Capabilities(backend="stub")

    def hidden_rows(self, tokens: list[int], n: int) -> np.ndarray:
        return np.array([tokens], dtype=np.float64)

    def feature_head(self, hidden: np.ndarray, index: np.ndarray) -> np.ndarray:
        j = int(index[0])  # a draft index: K for a token outside a trimmed head, read as token 0
        token = j if self.keep is None else (int(self.keep[j]) if j < len(self.keep) else 0)
        return np.append(hidden[0], token)[None]

    def head(self, hidden: np.ndarray) -> np.ndarray:
        self.toy.reset()
        return self.toy.forward(hidden[0].astype(int).tolist())[-1:]

    n_past = 0

    def forward(self, token_ids, n_logits=1):  # the head drafter never runs a body forward
        raise AssertionError("a head drafter ran a forward")

    def trim(self, n_past: int) -> None:
        pass

    def memory_bytes(self) -> dict[str, int]:
        return {"weights": 0, "kv": 0}


@pytest.mark.parametrize("name", ["top-k/top-p", "temperature"])
@pytest.mark.parametrize("trimmed", [True, False])
def test_head_drafts_commit_the_target_distribution(name, trimmed):
    params = PARAMS[name]
    target = ToyRuntime(V, seed=0)
    keep = KEEP if trimmed else None
    dec = SpeculativeDecoder(target, HeadStub(V, keep), id_map=keep, drafter="head", policy=FixedK(1))
    accepted = assert_lossless(dec, target, PROMPT, params)
    assert accepted > 0


@pytest.mark.parametrize("name", list(PARAMS))
def test_tree_candidates_commit_the_target_distribution(name):
    params = PARAMS[name]
    target = ToyRuntime(V, seed=0)
    p0 = _target_p(target, PROMPT, params)
    likely = [int(t) for t in np.argsort(-p0)[:3]]
    # three root candidates (the likeliest), the first with two children of its own
    p1 = _target_p(target, PROMPT + [likely[0]], params)
    kids = [int(t) for t in np.argsort(-p1)[:2]]
    tree = DraftTree((likely[0], kids[0], kids[1], likely[1], likely[2]), (0, 1, 1, 0, 0))
    # row i: the target's logits after node i's path (what a tree verify computes)
    paths = [[], [likely[0]], [likely[0], kids[0]], [likely[0], kids[1]], [likely[1]], [likely[2]]]
    logits = np.stack([_logits(target, PROMPT + path) for path in paths])
    n = 20_000
    first, second, n_accepted = np.zeros(V), np.zeros(V), 0
    for seed in range(n):
        nodes, token = accept_tree_coupled(tree, LazyDists(logits, params), Draws(seed), len(PROMPT))
        committed = [tree.tokens[v - 1] for v in nodes] + [token]
        n_accepted += len(nodes)
        first[committed[0]] += 1
        if committed[0] == likely[0]:
            second[committed[1]] += 1
    assert 0 < n_accepted
    assert chi_p(first, p0) > P_MIN
    assert second.sum() > 1000 and chi_p(second, p1) > P_MIN


def _logits(target: ToyRuntime, ids: list[int]) -> np.ndarray:
    target.reset()
    row = target.forward(ids)[-1].copy()
    target.reset()
    return row


class _Favouring(TokenDist):
    """A target distribution whose draw weighs one token double: a lossy acceptance that keeps
    that draft more often than the target would draw it."""

    def __init__(self, base: Candidates, token: int) -> None:
        self.base, self.token = base, token

    def prob(self, token: int) -> float:
        return self.base.prob(token)

    def probs_at(self, ids):
        return self.base.probs_at(ids)

    def sample(self, noise):
        return noise.race(self.base.ids, np.where(self.base.ids == self.token, 2.0, 1.0) * self.base.probs)

    def dense(self, vocab):
        return self.base.dense(vocab)


def test_the_chi_square_catches_a_biased_acceptance():
    # the same check the lossless tests make, failing on an acceptance that favours the draft
    params = PARAMS["top-k/top-p"]
    target, draft = ToyRuntime(V, seed=0), ToyRuntime(V, seed=0, noise=0.5)
    p, q = (distribution(rt.forward(PROMPT)[-1], params) for rt in (target, draft))
    fair, biased = np.zeros(V), np.zeros(V)
    for seed in range(5000):
        draws = Draws(seed)
        x = q.sample(draws.at(0))
        for counts, dist in ((fair, p), (biased, _Favouring(p, x))):
            n, nxt = accept_coupled([x], [dist, dist], draws, 0, [q])
            counts[x if n else nxt] += 1
    assert chi_p(fair, p.dense(V)) > P_MIN
    assert chi_p(biased, p.dense(V)) < 1e-6
