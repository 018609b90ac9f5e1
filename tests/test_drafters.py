"""Drafters: prompt lookup proposes copied continuations; every drafter × policy stays lossless."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.decoding import (
    DRAFTERS,
    POLICIES,
    Candidates,
    FixedK,
    NgramDrafter,
    SamplingParams,
    SpeculativeDecoder,
    make_policy,
    probabilities,
)
from edgespec.decoding.drafters import GUESSES, ModelDrafter, NgramIndex, overlapping_copy
from edgespec.engine.engine import resolve_drafting
from edgespec.errors import ConfigError
from tests.toy import ToyRuntime, naive_greedy

V = 50
GREEDY = SamplingParams()
# repeats a phrase, so prompt lookup finds matches from the first step
PROMPT = [3, 14, 15, 9, 26, 5, 35, 8, 3, 14, 15, 9, 26]


def dists(rows) -> list:
    """Dense probability rows as the distributions acceptance takes."""
    return [Candidates.from_row(r) for r in np.atleast_2d(rows)]


def lookup(tokens, limit=4, **kw):
    return NgramIndex(kw.get("min_n", 1), kw.get("max_n", 3)).lookup(list(tokens), limit)


# ---------------------------------------------------------------- prompt lookup


def test_lookup_copies_what_followed_the_suffix():
    assert lookup([1, 2, 3, 4, 5, 9, 1, 2, 3]) == ([4, 5, 9, 1], 3)
    assert lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], limit=2) == ([4, 5], 3)
    assert lookup([7, 8, 9]) == ([], 0)  # nothing repeats


def test_lookup_prefers_the_longest_then_the_latest_match():
    # "2" alone last occurred before 6, but "1 2" occurred before 4
    assert lookup([1, 2, 4, 0, 2, 6, 0, 1, 2], limit=1) == ([4], 2)
    # the latest occurrence of "5 5" wins
    assert lookup([5, 5, 1, 0, 5, 5, 2, 9, 5, 5], limit=1) == ([2], 2)
    assert lookup([1, 2, 4, 0, 2, 6, 0, 1, 2], limit=1, min_n=3) == ([], 0)


def test_lookup_continues_uncommitted_drafts_without_indexing_them():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 4, 9, 1, 2]
    assert index.lookup(tokens, 2, [3, 4]) == ([9, 1], 3)  # the suffix [2, 3, 4] runs into the drafts
    assert index.lookup(tokens, 3) == ([3, 4, 9], 2)  # ... which were not added to the index
    assert index._seq == tokens


def test_lookup_continues_a_repeating_cycle():
    assert lookup([9, 5, 6, 5, 6, 5], limit=5) == ([6, 5, 6, 5, 6], 3)
    assert overlapping_copy([1, 2, 3], 2, 4) == [3, 3, 3, 3]


def test_index_updates_incrementally_and_restarts_on_another_sequence():
    index, seq = NgramIndex(1, 3), [4, 1, 2, 3]
    assert index.lookup(seq, 2) == ([], 0)
    seq += [7, 1, 2]
    assert index.lookup(seq, 2) == ([3, 7], 2)
    seq += [3]
    assert index.lookup(seq, 2) == ([7, 1], 3)
    other = [1, 2, 8, 1, 2]  # not an extension: the index starts over
    assert index.lookup(other, 2) == lookup(other, 2) == ([8, 1], 2)


def test_ngram_drafter_validation_and_sources():
    with pytest.raises(ConfigError, match="min_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ConfigError, match="max_ngram must be an integer >= 1"):
        NgramDrafter(max_ngram=0)
    d = NgramDrafter()
    draft = d.propose([1, 2, 3, 4, 1, 2], 3, FixedK(2), GREEDY, np.random.default_rng(0))
    assert draft.tokens == [3, 4] and draft.source == "ngram:2" and draft.dists is None
    assert d.propose([1, 2, 3, 4, 1, 2], 3, FixedK(0), GREEDY, np.random.default_rng(0)).tokens == []


# ---------------------------------------------------------------- lossless under every drafter and policy


def plain_greedy(prompt, n):
    return naive_greedy(ToyRuntime(V, seed=0), prompt, n)


def make_decoder(drafter: str, policy: str, k: int = 4) -> SpeculativeDecoder:
    draft = ToyRuntime(V, seed=0, noise=0.7) if DRAFTERS[drafter].needs_model else None
    return SpeculativeDecoder(ToyRuntime(V, seed=0), draft, drafter=drafter, policy=make_policy(policy, k))


# the trained head drafts on a draft sharing the target's body: its own test below
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("drafter", [d for d in DRAFTERS if d != "head"])
def test_greedy_identity_under_every_policy_and_drafter(drafter, policy):
    dec = make_decoder(drafter, policy)
    expected = plain_greedy(PROMPT, 60)
    for _ in range(2):  # a second generation reuses the policy's learned state
        tokens = list(PROMPT)
        steps = list(dec.stream(tokens, GREEDY, 60))
        assert tokens[len(PROMPT):] == expected
        assert all(s.accepted <= s.drafted for s in steps)
        for rt in filter(None, (dec.target, dec.draft)):
            assert rt.n_past <= len(tokens) - 1 and rt.cache == tokens[: rt.n_past]
    sources = {s.source.split(":")[0] for s in steps if s.drafted}
    if policy == "fixed":  # every drafter the combination holds drafted (lookup first when it matches)
        assert sources == {"model": {"model"}, "ngram": {"ngram"}, "both": {"model", "ngram"}, "recycle": {"recycle"},
                           "lookup-recycle": {"ngram", "recycle"}, "both-recycle": {"ngram", "recycle"}}[drafter]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_identity_of_the_head_drafter_under_every_policy(policy):
    from edgespec.runtimes.shared_body import shared_pair
    from tests.test_shared_body import EchoFeatureHead, MatrixHead

    keep = np.random.default_rng(1).permutation(V)[:40]
    target, draft = shared_pair(ToyRuntime(V, seed=0), MatrixHead(np.eye(V)), MatrixHead(np.eye(V)[:, keep]),
                                EchoFeatureHead(keep, V))
    dec = SpeculativeDecoder(target, draft, id_map=keep, drafter="head", policy=make_policy(policy, 4))
    for _ in range(2):
        tokens = list(PROMPT)
        steps = list(dec.stream(tokens, GREEDY, 60))
        assert tokens[len(PROMPT):] == plain_greedy(PROMPT, 60)
        assert all(s.accepted <= s.drafted for s in steps)
    assert {s.source for s in steps if s.drafted} <= {"head"}


class LoopingRuntime(ToyRuntime):
    """Logits depend on the last token only, so greedy decoding soon cycles (as small models do)."""

    def _logits(self) -> np.ndarray:
        return self.w[0, self.cache[-1]]


def test_lookup_drafts_whole_cycles_of_a_repeating_target():
    dec = SpeculativeDecoder(LoopingRuntime(V, seed=0), drafter="ngram", policy=FixedK(6))
    tokens = [1, 2]
    steps = list(dec.stream(tokens, GREEDY, 120))
    assert tokens[2:] == naive_greedy(LoopingRuntime(V, seed=0), [1, 2], 120)
    late = steps[len(steps) // 2:]
    assert all(s.drafted == 6 and s.accepted == 6 for s in late[:-1])  # every draft accepted whole
    assert len(steps) < 120 / 4


def test_confidence_stop_shortens_model_drafts():
    draft = ToyRuntime(V, seed=0, noise=0.7)
    dec = SpeculativeDecoder(ToyRuntime(V, seed=0), draft, policy=FixedK(8, min_joint=0.5))
    tokens = list(PROMPT)
    steps = list(dec.stream(tokens, GREEDY, 60))
    assert tokens[len(PROMPT):] == plain_greedy(PROMPT, 60)
    assert max(s.drafted for s in steps) <= 8 and np.mean([s.drafted for s in steps[:-1]]) < 4


# ---------------------------------------------------------------- tails and lookahead


@dataclass
class TailK(FixedK):
    """Model drafts of k tokens, always followed by a `tail`-token lookup continuation; records
    what it is told."""

    tail: int = 2
    learned: list = field(default_factory=list)
    updates: list = field(default_factory=list)

    def next_tail(self, source, head_source, head_k):
        return self.tail

    def prefers(self, first, second):
        return first == "model"  # the lookup drafts only as a tail

    def update(self, drafted, accepted, draft_ms, verify_ms, *, source="model", ms_per_token=None, width=None,
               expected=None):
        self.updates.append((source, drafted, accepted, width))

    def learn(self, source, drafted, accepted, expected=None):
        self.learned.append((source, drafted, accepted))


def tail_decoder(k=2, tail=2, noise=0.7, **toy):
    return SpeculativeDecoder(ToyRuntime(V, seed=0), ToyRuntime(V, seed=0, noise=noise, **toy), drafter="both",
                              policy=TailK(k, tail=tail))


def test_tails_extend_model_drafts_losslessly_and_are_learned_apart():
    dec = tail_decoder()
    tokens = list(PROMPT)
    steps = list(dec.stream(tokens, GREEDY, 80))
    assert tokens[len(PROMPT):] == plain_greedy(PROMPT, 80)
    tailed = [s for s in steps if s.tail]
    assert tailed and all(s.source == "model" and s.drafted == 2 + s.tail for s in tailed)
    assert any(s.accepted > 2 for s in tailed), "no tail token was ever accepted"
    # the model's update counts its own tokens; the whole verify's width goes with it
    updates = [u for u in dec.policy.updates if u[0] == "model"]
    assert all(d == 2 and a <= 2 for _, d, a, _ in updates)
    assert {w for *_, w in updates} >= {3, 5}
    # a tail is learned exactly when the model's draft before it was accepted whole
    assert len(dec.policy.learned) == sum(s.accepted >= 2 for s in tailed)
    assert all(src.startswith("ngram:") and 0 <= a <= d for src, d, a in dec.policy.learned)


def test_sampling_with_tails_after_sampled_drafts_matches_the_target():
    # the second new token is the first tail token whenever the model's one draft was accepted:
    # its marginal must be the target's, summed over the first token. Every token occurs in the
    # prompt with a continuation, so each first token gets a tail.
    prompt = list(range(V)) + [7]
    params = SamplingParams(temperature=1.0)
    target = ToyRuntime(V, seed=0)
    p1 = probabilities(target.forward(prompt)[-1], params)
    p2 = np.zeros(V)
    for x in range(V):
        target.reset()
        p2 += p1[x] * probabilities(target.forward(prompt + [x])[-1], params)
    dec = tail_decoder(k=1, tail=1, noise=0.3)
    n, counts, tails_tested = 3000, np.zeros(V), 0
    for i in range(n):
        tokens = list(prompt)
        step = list(dec.stream(tokens, SamplingParams(1.0, seed=i), 3))[0]
        tails_tested += bool(step.tail) and step.accepted >= 1
        counts[tokens[len(prompt) + 1]] += 1
    assert tails_tested > n // 2
    expected = p2 * n
    assert (expected >= 5).all() and counts.sum() == n
    assert chisquare(counts, expected).pvalue > 1e-3


def test_lookahead_guesses_save_draft_forwards_when_right():
    # a looping target drafted by itself: after the first cycle, prompt lookup guesses right,
    # so most drafts come from rows fed as guesses instead of forwards of their own
    draft = LoopingRuntime(V, seed=0)
    dec = SpeculativeDecoder(LoopingRuntime(V, seed=0), draft, drafter="both", policy=TailK(6, tail=0))
    model = dec.drafter.model
    tokens = [1, 2]
    steps = list(dec.stream(tokens, GREEDY, 120))
    assert tokens[2:] == naive_greedy(LoopingRuntime(V, seed=0), [1, 2], 120)
    drafted = sum(s.drafted for s in steps if s.source == "model")
    assert model.guessed > 0 and model.guess_hits > drafted // 2
    assert draft.calls < drafted // 2


def test_lookahead_fits_the_draft_forward_and_cache():
    # a draft taking 2 tokens per forward (static width) and one with little room left
    for toy, cap in (({"max_batch_tokens": 2}, None), ({}, len(PROMPT) + 3)):
        draft = ToyRuntime(V, seed=0, noise=0.7, **toy)
        draft.kv_capacity = cap
        model = ModelDrafter(draft, V, guess=lambda tokens, drafts: [7] * GUESSES)
        out = model.propose(list(PROMPT), 4, FixedK(4), GREEDY, np.random.default_rng(0))
        assert len(out.tokens) == 4 and model.guessed > 0
        assert draft.n_past <= (cap or 99)


# ---------------------------------------------------------------- sampling with point-mass drafts


def test_sampling_with_lookup_drafts_matches_the_target():
    params = SamplingParams(temperature=1.0)
    target = ToyRuntime(V, seed=0)

    def prompt_and_p(x: int):  # lookup after the repeated phrase proposes x
        prompt = PROMPT[:5] + [x] + PROMPT[6:]
        p = probabilities(target.forward(prompt)[-1], params)
        target.reset()
        return prompt, p

    # the x the target itself finds most likely there, so both accept and reject happen often
    prompt, p = max((prompt_and_p(x) for x in range(V)), key=lambda pp: pp[1][pp[0][5]])
    assert 0.1 < p[prompt[5]] < 0.9
    dec = SpeculativeDecoder(target, drafter="ngram", policy=FixedK(1))
    n, counts, drafted, accepted = 3000, np.zeros(V), 0, 0
    for i in range(n):
        tokens = list(prompt)
        step = next(dec.stream(tokens, SamplingParams(1.0, seed=i), 2))
        drafted, accepted = drafted + step.drafted, accepted + step.accepted
        counts[tokens[len(prompt)]] += 1
    assert drafted == n and 0.05 * n < accepted < 0.95 * n  # both branches ran, every time a lookup draft
    assert counts[p == 0].sum() == 0
    expected = p * n
    big, rare = expected >= 5, (expected > 0) & (expected < 5)
    obs = np.append(counts[big], counts[rare].sum())
    exp = np.append(expected[big], expected[rare].sum())
    assert chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "confidence", "cost"])
def test_seeded_sampling_gives_plain_decodings_text_under_every_policy(policy):
    """Draws keyed by seed and position (draws.py): the cost policy's draft lengths follow the
    measured timings, yet the text is plain decoding's with the same seed, run after run."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    plain = list(PROMPT)
    list(SpeculativeDecoder(ToyRuntime(V, seed=0)).stream(plain, params, 40))
    for _ in range(2):
        dec = make_decoder("both", policy)
        tokens = list(PROMPT)
        drafted = sum(s.drafted for s in dec.stream(tokens, params, 40))
        assert tokens == plain and drafted > 0


# ---------------------------------------------------------------- configuration


def test_decoder_rejects_bad_drafter_combinations():
    target, draft = ToyRuntime(V, seed=0), ToyRuntime(V, seed=0, noise=0.5)
    with pytest.raises(ConfigError, match="needs a draft model"):
        SpeculativeDecoder(target, drafter="both")
    with pytest.raises(ConfigError, match="uses no draft model"):
        SpeculativeDecoder(target, draft, drafter="ngram")
    with pytest.raises(ConfigError, match="unknown drafter 'psychic'"):
        SpeculativeDecoder(target, drafter="psychic")
    with pytest.raises(ConfigError, match="not both"):
        SpeculativeDecoder(target, draft, drafter=NgramDrafter())
    assert SpeculativeDecoder(target, drafter=NgramDrafter(2, 2)).policy.next_k() == 4


@pytest.mark.parametrize("args, expected", [
    (("auto", None, None, True, True), ("both", "cost", 4)),
    (("auto", None, None, False, True), ("ngram", "cost", 4)),
    (("auto", None, None, True, False), (None, "cost", 4)),  # --no-draft: plain decoding
    (("ngram", None, None, True, False), ("ngram", "cost", 4)),  # lookup needs no draft model
    (("auto", None, 3, True, True), ("both", "fixed", 3)),  # an explicit k asks for that length
    (("model", "heuristic", 6, True, True), ("model", "heuristic", 6)),
    (("both", None, 0, True, True), (None, "fixed", 0)),  # k = 0: plain decoding
    (("none", None, None, True, True), (None, "cost", 4)),
])
def test_resolve_drafting(args, expected):
    drafter, policy, k, has_draft, use_draft = args
    assert resolve_drafting(drafter, policy, k, has_draft=has_draft, use_draft=use_draft) == expected


@pytest.mark.parametrize("args, match", [
    (("model", None, None, False, True), "the bundle has no draft model"),
    (("both", None, None, True, False), "--no-draft was given"),
])
def test_resolve_drafting_errors(args, match):
    drafter, policy, k, has_draft, use_draft = args
    with pytest.raises(ConfigError, match=match):
        resolve_drafting(drafter, policy, k, has_draft=has_draft, use_draft=use_draft)


@pytest.mark.parametrize("args, match", [
    (("lookup", None, None), "unknown drafter 'lookup'"),
    (("auto", "psychic", None), "unknown draft policy"),
    (("auto", None, -1), "k must be an integer >= 0"),
])
def test_drafting_names_and_k_are_checked_once_by_the_config(args, match):
    from edgespec.engine.choices import check_drafting
    from edgespec.engine.config import EngineConfig

    drafter, policy, k = args
    with pytest.raises(ConfigError, match=match):
        check_drafting(drafter, policy, k)
    with pytest.raises(ConfigError, match=match):
        EngineConfig(drafter=drafter, policy=policy, k=k)


class HeldRuntime(ToyRuntime):
    """Reports every fed token but the last as already computed, as a draft on the target's body
    does after the target committed them (runtimes/shared_body.py)."""

    def forward(self, token_ids, n_logits=1):
        out = super().forward(token_ids, n_logits)
        self.reused_rows = len(token_ids) - 1
        return out


@pytest.mark.parametrize("runtime, measured", [(ToyRuntime, False), (HeldRuntime, True)])
def test_a_catch_up_the_runtime_held_is_a_draft_forward_cost(runtime, measured):
    # a 12-token catch-up is prefill, not the cost of a drafted token, unless the runtime held
    # those rows already: then the forward computed one row, like any draft forward
    drafter = ModelDrafter(runtime(V, seed=0), V)
    draft = drafter.propose(list(PROMPT), 1, FixedK(1), GREEDY, np.random.default_rng(0))
    assert len(draft.tokens) == 1
    assert (draft.ms_per_token is not None) == measured
