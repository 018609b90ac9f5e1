"""Decoding: sampling transforms, acceptance rules and the speculative loop on a toy model."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.decoding import (
    Candidates,
    Draws,
    FixedK,
    SamplingParams,
    SpeculativeDecoder,
    accept_coupled,
    accept_greedy,
    make_policy,
    map_draft_ids,
    probabilities,
    sample,
)
from edgespec.errors import ConfigError
from tests.chi2 import pooled_chi_square_p
from tests.toy import ToyRuntime, naive_greedy

V = 50
PROMPT = [3, 14, 15, 9, 26]
GREEDY = SamplingParams()
KEEP = np.arange(0, V, 2)  # a trimmed draft head: even target ids only


def dists(rows) -> list:
    """Dense probability rows as the distributions acceptance takes."""
    return [Candidates.from_row(r) for r in np.atleast_2d(rows)]


def make_draft(kind: str) -> tuple[ToyRuntime, np.ndarray | None]:
    if kind == "agreeing":
        return ToyRuntime(V, seed=0), None
    if kind == "noisy":
        return ToyRuntime(V, seed=0, noise=0.7), None
    if kind == "different":
        return ToyRuntime(V, seed=42), None
    if kind == "trimmed":
        return ToyRuntime(V, seed=0, noise=0.3, keep=KEEP), KEEP
    raise ValueError(kind)


def generate(dec: SpeculativeDecoder, tokens: list[int], n: int, params=GREEDY, stop_ids=()) -> list[int]:
    start = len(tokens)
    for _ in dec.stream(tokens, params, n, stop_ids):
        pass
    return tokens[start:]


def plain_greedy(prompt, n, stop_ids=()) -> list[int]:
    return generate(SpeculativeDecoder(ToyRuntime(V, seed=0)), list(prompt), n, stop_ids=stop_ids)


def assert_caches_are_prefixes(dec: SpeculativeDecoder, tokens: list[int]) -> None:
    for rt in filter(None, (dec.target, dec.draft)):
        assert rt.n_past <= len(tokens) - 1
        assert rt.cache == tokens[: rt.n_past]


# ---------------------------------------------------------------- greedy exactness


def test_plain_greedy_matches_naive_reference():
    assert plain_greedy(PROMPT, 30) == naive_greedy(ToyRuntime(V, seed=0), PROMPT, 30)


@pytest.mark.parametrize("kind", ["agreeing", "noisy", "different", "trimmed"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_greedy_equals_plain_greedy(k, kind):
    draft, id_map = make_draft(kind)
    dec = SpeculativeDecoder(ToyRuntime(V, seed=0), draft, id_map=id_map, policy=FixedK(k))
    tokens = list(PROMPT)
    steps = list(dec.stream(tokens, GREEDY, 40))
    assert tokens[len(PROMPT):] == plain_greedy(PROMPT, 40)
    assert [t for s in steps for t in s.tokens] == tokens[len(PROMPT):]
    assert all(s.accepted <= s.drafted <= k for s in steps)
    if kind == "agreeing":
        assert all(s.accepted == s.drafted for s in steps)
        assert len(steps) == -(-40 // (k + 1))  # every step commits k + 1 tokens
    assert_caches_are_prefixes(dec, tokens)


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_stops_exactly_at_budget(k):
    expected = plain_greedy(PROMPT, 12)
    for n in range(0, 12):
        draft, _ = make_draft("agreeing")
        dec = SpeculativeDecoder(ToyRuntime(V, seed=0), draft, policy=FixedK(k))
        assert generate(dec, list(PROMPT), n) == expected[:n]


@pytest.mark.parametrize("kind", ["agreeing", "noisy"])
def test_stops_right_after_stop_id(kind):
    expected = plain_greedy(PROMPT, 30)
    stop = expected[9]
    first = expected.index(stop)
    draft, _ = make_draft(kind)
    dec = SpeculativeDecoder(ToyRuntime(V, seed=0), draft, policy=FixedK(4))
    tokens = list(PROMPT)
    steps = list(dec.stream(tokens, GREEDY, 30, stop_ids={stop}))
    assert tokens[len(PROMPT):] == expected[: first + 1]
    assert steps[-1].tokens[-1] == stop
    assert_caches_are_prefixes(dec, tokens)


def test_target_batch_limit_is_respected():
    target = ToyRuntime(V, seed=0, max_batch_tokens=3)
    draft = ToyRuntime(V, seed=0, noise=0.5, max_batch_tokens=2)
    dec = SpeculativeDecoder(target, draft, policy=FixedK(5))
    prompt = list(range(1, 12))
    steps = list(dec.stream(tokens := list(prompt), GREEDY, 20))
    assert tokens[len(prompt):] == plain_greedy(prompt, 20)
    assert max(s.drafted for s in steps) == 2  # the verify batch (1 + drafts) fits 3 tokens


# ---------------------------------------------------------------- cache bookkeeping


@pytest.mark.parametrize("kind", ["noisy", "trimmed"])
def test_abandoned_stream_leaves_prefix_caches(kind):
    draft, id_map = make_draft(kind)
    dec = SpeculativeDecoder(ToyRuntime(V, seed=0), draft, id_map=id_map, policy=FixedK(4))
    tokens = list(PROMPT)
    for _ in dec.stream(tokens, GREEDY, 30):
        break  # the consumer presses Stop
    assert len(tokens) > len(PROMPT)
    assert_caches_are_prefixes(dec, tokens)
    generate(dec, tokens, 30 - (len(tokens) - len(PROMPT)))
    assert tokens[len(PROMPT):] == plain_greedy(PROMPT, 30)


def test_stream_closed_mid_generation_rewinds():
    dec = SpeculativeDecoder(ToyRuntime(V, seed=0), ToyRuntime(V, seed=0, noise=0.7), policy=FixedK(3))
    tokens = list(PROMPT)
    gen = dec.stream(tokens, GREEDY, 30)
    next(gen), next(gen)
    gen.close()
    assert_caches_are_prefixes(dec, tokens)
    generate(dec, tokens, 30 - (len(tokens) - len(PROMPT)))
    assert tokens[len(PROMPT):] == plain_greedy(PROMPT, 30)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_failed_forward_rewinds_and_recovers(role):
    fail = {"fail_at": 4}
    target = ToyRuntime(V, seed=0, **(fail if role == "target" else {}))
    draft = ToyRuntime(V, seed=0, noise=0.7, **(fail if role == "draft" else {}))
    dec = SpeculativeDecoder(target, draft, policy=FixedK(3))
    tokens = list(PROMPT)
    with pytest.raises(RuntimeError, match="toy backend failed"):
        generate(dec, tokens, 30)
    assert_caches_are_prefixes(dec, tokens)
    generate(dec, tokens, 30 - (len(tokens) - len(PROMPT)))
    assert tokens[len(PROMPT):] == plain_greedy(PROMPT, 30)


@pytest.mark.parametrize("k", [0, 3])
def test_second_call_reuses_shared_prefix(k):
    target = ToyRuntime(V, seed=0)
    draft = ToyRuntime(V, seed=0, noise=0.5) if k else None
    dec = SpeculativeDecoder(target, draft, policy=FixedK(k) if k else None)
    tokens = list(PROMPT)
    generate(dec, tokens, 10)
    first_len = len(tokens)
    tokens += [7, 8, 9]  # the user's next turn
    assert target.n_past == first_len - 1  # only the last committed token is left unfed
    held = {id(rt): (rt.n_past, len(rt.fed_positions)) for rt in (target, draft) if rt}
    generate(dec, tokens, 10)
    for rt in filter(None, (target, draft)):
        n_past, n_fed = held[id(rt)]
        assert min(rt.fed_positions[n_fed:]) == n_past, "shared prefix was re-fed"
    expected = plain_greedy(PROMPT, 10)
    assert tokens[:first_len] == PROMPT + expected
    assert tokens[first_len + 3:] == plain_greedy(PROMPT + expected + [7, 8, 9], 10)


def test_divergent_sequence_is_not_served_from_stale_cache():
    dec = SpeculativeDecoder(ToyRuntime(V, seed=0), ToyRuntime(V, seed=0, noise=0.5), policy=FixedK(2))
    generate(dec, list(PROMPT), 10)
    other = [3, 14, 40, 41, 42, 43, 44]  # shares only two tokens with the first sequence
    assert generate(dec, list(other), 10) == plain_greedy(other, 10)


# ---------------------------------------------------------------- acceptance rules


def one_hot_logits(ids: list[int], vocab: int = 6) -> np.ndarray:
    out = np.zeros((len(ids), vocab), dtype=np.float32)
    out[np.arange(len(ids)), ids] = 5.0
    return out


def test_accept_greedy_cases():
    assert accept_greedy([1, 2, 3], one_hot_logits([1, 2, 3, 4])) == (3, 4)  # bonus
    assert accept_greedy([1, 2, 3], one_hot_logits([1, 5, 3, 4])) == (1, 5)  # correction
    assert accept_greedy([1, 2, 3], one_hot_logits([0, 2, 3, 4])) == (0, 0)
    assert accept_greedy([], one_hot_logits([2])) == (0, 2)
    with pytest.raises(ValueError):
        accept_greedy([1, 2], one_hot_logits([1, 2]))


def test_coupled_acceptance_keeps_a_draft_exactly_when_it_is_the_targets_own_draw():
    """Each draft is kept iff it equals the target's draw at its position (draws.py); the first
    that is not is replaced by that draw; after a whole draft the bonus is the next position's."""
    p = np.array([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8], [0.0, 1.0, 0.0]])
    for seed in range(200):
        draws = Draws(seed)
        own = [dists(p)[i].sample(draws.at(10 + i)) for i in range(3)]  # the target alone, positions 10..12
        for drafts in ([2, 0], [own[0], 2], own[:2]):
            n, nxt = accept_coupled(drafts, dists(p), draws, 10)
            expect = next((i for i in range(2) if drafts[i] != own[i]), 2)
            assert (n, nxt) == (expect, own[expect])
    # a token the target gives no mass is never kept
    never = [accept_coupled([2], dists([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]), Draws(s), 0)[0] for s in range(200)]
    assert not any(never)
    with pytest.raises(ValueError, match="need 3 target rows"):
        accept_coupled([1, 2], dists(p[:2]), Draws(0), 0)


def test_acceptance_reports_each_tested_drafts_chance():
    """min(1, p/q) of each sampled draft tested (the kept ones and the first not kept), and p(x)
    for a deterministic draft."""
    p = np.array([[0.2, 0.3, 0.5], [0.1, 0.6, 0.3], [1.0, 0.0, 0.0]])
    q = np.array([[0.1, 0.1, 0.8], [0.0, 0.3, 0.7]])
    for seed in range(50):
        ratios: list[float] = []
        n, _ = accept_coupled([2, 1], dists(p), Draws(seed), 0, dists(q), ratios)
        assert ratios == pytest.approx([0.5 / 0.8, 1.0][:min(n + 1, 2)])
        ratios = []
        n, _ = accept_coupled([1, 2], dists(p), Draws(seed), 0, None, ratios)
        assert ratios == pytest.approx([0.3, 0.3][:min(n + 1, 2)])


@pytest.mark.parametrize("k", [1, 3])
def test_coupled_drafts_are_kept_often_and_the_commit_is_the_target_draw(k):
    """Drafts raced on the same noise as the target: every commit is the target's own draw (so
    exact: its distribution is p), and a draft is kept with probability at least (1-d)/(1+d),
    d = TV(p, q), the bound of coupled sampling (rejection sampling's 1-d is the ceiling)."""
    p = np.array([0.05, 0.30, 0.00, 0.25, 0.15, 0.25])
    q = np.array([0.40, 0.05, 0.20, 0.05, 0.30, 0.00])  # deliberately different, with disjoint zeros
    target, draft = dists(np.tile(p, (k + 1, 1))), dists(np.tile(q, (k, 1)))
    n, kept, counts = 20000, 0, np.zeros(len(p))
    for seed in range(n):
        draws = Draws(seed)
        drafts = [draft[i].sample(draws.at(i)) for i in range(k)]
        n_acc, nxt = accept_coupled(drafts, target, draws, 0, draft)
        first = drafts[0] if n_acc > 0 else nxt
        assert first == target[0].sample(draws.at(0))
        kept += n_acc > 0
        counts[first] += 1
    d = 0.5 * np.abs(p - q).sum()
    assert counts[2] == 0 and chisquare(counts[p > 0], p[p > 0] * n).pvalue > 1e-3
    assert (1 - d) / (1 + d) - 0.02 < kept / n < 1 - d + 0.02


@pytest.mark.parametrize("kind", ["noisy", "trimmed"])
def test_end_to_end_sampling_matches_target(kind):
    params = SamplingParams(temperature=1.0, top_k=20) if kind == "trimmed" else SamplingParams(temperature=1.0)
    draft, id_map = make_draft(kind)
    target = ToyRuntime(V, seed=0)
    dec = SpeculativeDecoder(target, draft, id_map=id_map, policy=FixedK(1))
    p = probabilities(target.forward(PROMPT)[-1], params)
    target.reset()
    n, counts, accepted = 3000, np.zeros(V), 0
    for i in range(n):
        tokens = list(PROMPT)
        step = next(dec.stream(tokens, SamplingParams(params.temperature, params.top_p, params.top_k, seed=i), 2))
        accepted += step.accepted
        counts[tokens[len(PROMPT)]] += 1
    assert 0 < accepted < n  # drafts were kept and replaced
    assert pooled_chi_square_p(counts, p) > 1e-3


# ---------------------------------------------------------------- sampling transforms


def test_greedy_probabilities_are_one_hot():
    logits = np.array([[0.1, 3.0, -1.0], [2.0, 2.0, 1.0]])
    assert np.array_equal(probabilities(logits, GREEDY), [[0, 1, 0], [1, 0, 0]])


def test_temperature_softmax_and_flattening():
    logits = np.array([1.0, 2.0, 4.0])
    p = probabilities(logits, SamplingParams(temperature=2.0))
    ref = np.exp(logits / 2) / np.exp(logits / 2).sum()
    np.testing.assert_allclose(p, ref)
    hot = probabilities(logits, SamplingParams(temperature=5.0))
    cold = probabilities(logits, SamplingParams(temperature=0.5))
    assert cold.max() > p.max() > hot.max()


def test_top_k_keeps_k_largest():
    logits = np.random.default_rng(0).standard_normal((4, 30))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=5))
    assert ((p > 0).sum(axis=-1) == 5).all()
    for row, lrow in zip(p, logits):
        assert set(np.flatnonzero(row)) == set(np.argsort(lrow)[-5:])
    np.testing.assert_allclose(p.sum(axis=-1), 1.0)


def test_top_p_keeps_smallest_nucleus():
    logits = np.log(np.array([0.1, 0.5, 0.15, 0.25]))
    params = SamplingParams(temperature=1.0, top_p=0.7)
    np.testing.assert_allclose(probabilities(logits, params), [0, 0.5 / 0.75, 0, 0.25 / 0.75])
    # exactly reaching top_p is enough
    np.testing.assert_allclose(probabilities(logits, SamplingParams(temperature=1.0, top_p=0.75)),
                               [0, 0.5 / 0.75, 0, 0.25 / 0.75])
    # a tiny top_p still keeps the top token
    np.testing.assert_allclose(probabilities(logits, SamplingParams(temperature=1.0, top_p=1e-6)), [0, 1, 0, 0])


def test_probabilities_row_wise_and_stable():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 40)) * 1e4  # would overflow a naive softmax
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=10)
    p = probabilities(logits, params)
    assert p.dtype == np.float64 and np.isfinite(p).all()
    np.testing.assert_allclose(p.sum(axis=-1), 1.0)
    for row, lrow in zip(p, logits):
        np.testing.assert_array_equal(row, probabilities(lrow, params))
    masked = probabilities(np.array([0.0, -np.inf, 1.0]), SamplingParams(temperature=1.0))
    assert masked[1] == 0 and np.isclose(masked.sum(), 1.0)


def test_sample_follows_probabilities_and_skips_zeros():
    rng = np.random.default_rng(0)
    p = np.array([0.0, 0.2, 0.0, 0.8, 0.0])
    draws = np.array([sample(p, rng) for _ in range(5000)])
    assert set(draws) == {1, 3}
    assert abs((draws == 3).mean() - 0.8) < 0.03


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature must be >= 0, got -1"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"top_p": 1.5}, r"top-p must be in \(0, 1\], got 1.5"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_k": -2}, "top-k must be an integer >= 0"),
        ({"top_k": 2.5}, "top-k"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_greedy_flag():
    assert SamplingParams().greedy and not SamplingParams(temperature=0.8).greedy


# ---------------------------------------------------------------- vocab mapping, policies, config


def test_id_map_helpers():
    id_map = np.array([4, 0, 7])
    assert map_draft_ids([0, 2, 1], id_map) == [4, 7, 0]
    assert map_draft_ids([3, 1], None) == [3, 1]


def test_policies():
    assert FixedK(3).next_k() == 3
    assert make_policy("fixed", 2).next_k() == 2
    with pytest.raises(ConfigError, match="k must be an integer >= 0"):
        FixedK(-1)
    with pytest.raises(ConfigError, match="unknown draft policy 'nope'; choose one of: fixed"):
        make_policy("nope", 2)


def test_decoder_rejects_bad_configs():
    target = ToyRuntime(V, seed=0)
    with pytest.raises(ConfigError, match="needs a draft model"):
        SpeculativeDecoder(target, policy=FixedK(2))
    with pytest.raises(ConfigError, match="id_map given without a draft"):
        SpeculativeDecoder(target, id_map=KEEP)
    with pytest.raises(ConfigError, match="separate runtimes"):
        SpeculativeDecoder(target, target)
    with pytest.raises(ConfigError, match="pass an id_map"):
        SpeculativeDecoder(ToyRuntime(10), ToyRuntime(20))
    trimmed = ToyRuntime(V, keep=KEEP)
    with pytest.raises(ConfigError, match="one target id per draft id"):
        SpeculativeDecoder(target, trimmed, id_map=KEEP[:-1])
    with pytest.raises(ConfigError, match="same target id"):
        SpeculativeDecoder(target, trimmed, id_map=np.zeros(len(KEEP), dtype=int))
    with pytest.raises(ConfigError, match="outside the target vocab"):
        SpeculativeDecoder(target, trimmed, id_map=KEEP + 100)
    dec = SpeculativeDecoder(target)
    with pytest.raises(ConfigError, match="max-new-tokens"):
        dec.stream(list(PROMPT), GREEDY, -1)
    with pytest.raises(ConfigError, match="at least one token"):
        dec.stream([], GREEDY, 5)
