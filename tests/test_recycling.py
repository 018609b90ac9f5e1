"""Token Recycling: the successor table, its chain drafts, and losslessness through the decoder."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.decoding import FixedK, RecyclingDrafter, SamplingParams, SpeculativeDecoder, make_policy, probabilities
from edgespec.decoding.draft import Draft, Drafter
from edgespec.decoding.recycling import SuccessorTable, top_successors
from edgespec.errors import ConfigError
from tests.test_drafters import LoopingRuntime
from tests.toy import ToyRuntime, naive_greedy

V = 50
GREEDY = SamplingParams()
PROMPT = [3, 14, 15, 9, 26]


def plain(runtime_cls, prompt, n) -> list[int]:
    return naive_greedy(runtime_cls(V, seed=0), list(prompt), n)


def generate(dec: SpeculativeDecoder, prompt, n, params=GREEDY) -> tuple[list[int], list]:
    tokens = list(prompt)
    steps = list(dec.stream(tokens, params, n))
    return tokens[len(prompt):], steps


# ---------------------------------------------------------------- top-k and the table


@pytest.mark.parametrize(("vocab", "stride"), [(262144, 128), (5000, 64), (300, 128), (40, 1)])
def test_top_successors_are_the_exact_top_k_in_order(vocab, stride):
    rng = np.random.default_rng(vocab)
    logits = (3 * rng.standard_normal((4, vocab))).astype(np.float32)
    logits[1, ::7] = 10.0  # ties far above the rest, spread over the sampled and unsampled logits
    logits[2] = 0.0  # a flat row: any k ids are its top k
    got = top_successors(logits, 8, stride)
    assert got.shape == (4, 8)
    for row, ids in zip(logits, got):
        assert len(set(ids.tolist())) == 8
        assert np.all(np.diff(row[ids]) <= 0)  # largest first
        assert row[ids].min() >= np.sort(row)[-8]  # nothing outside the top k


def test_table_starts_empty_and_chains_top_one_successors():
    table = SuccessorTable(V, k=3)
    assert table.rows.shape == (V, 3) and table.rows.dtype == np.int32 and (table.rows == -1).all()
    assert table.chain(7, 5) == []
    logits = np.zeros((3, V), dtype=np.float32)
    logits[0, 11], logits[0, 12], logits[1, 13], logits[2, 7] = 5.0, 4.0, 5.0, 5.0
    table.update([7, 11, 13], logits)
    assert table.rows[7].tolist()[:2] == [11, 12]
    assert table.chain(7, 2) == [11, 13]
    assert table.chain(7, 5) == [11, 13, 7, 11, 13]  # a cycle is proposed as deep as asked
    assert table.chain(12, 5) == []  # never scored
    with pytest.raises(ValueError, match="3 tokens for 2"):
        table.update([1, 2, 3], logits[:2])


def test_a_later_row_for_the_same_token_wins():
    table = SuccessorTable(V, k=2)
    logits = np.zeros((2, V), dtype=np.float32)
    logits[0, 4], logits[1, 9] = 1.0, 1.0
    table.update([5, 5], logits)
    assert table.chain(5, 1) == [9]


def test_table_validation_and_size():
    with pytest.raises(ConfigError, match="k must be"):
        SuccessorTable(V, k=0)
    assert SuccessorTable(262144).rows.nbytes == 262144 * 8 * 4  # the paper's ~8 MB


# ---------------------------------------------------------------- through the decoder


class Recorder(Drafter):
    """Drafts a fixed guess and records what the decoder hands to `observe`."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], np.ndarray]] = []

    def propose(self, tokens, limit, policy, params, rng):
        return Draft([1, 2][:limit], None, "rec")

    def observe(self, tokens, logits):
        self.seen.append((list(tokens), np.array(logits)))
        return []


def test_the_decoder_hands_every_verified_row_to_observe():
    rec = Recorder()
    dec = SpeculativeDecoder(ToyRuntime(V, seed=0), drafter=rec, policy=FixedK(2))
    out, steps = generate(dec, PROMPT, 12)
    assert len(rec.seen) == len(steps)
    reference = ToyRuntime(V, seed=0)
    committed = list(PROMPT)
    for (rows, logits), step in zip(rec.seen, steps):
        # the last committed token, then each draft; row i is the target's logits after rows[i]
        assert rows == [committed[-1], 1, 2][:step.drafted + 1]
        reference.reset()
        expected = reference.forward(committed + rows[1:], n_logits=len(rows))
        np.testing.assert_allclose(logits, expected)
        committed += step.tokens


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "cost"])
@pytest.mark.parametrize("runtime_cls", [ToyRuntime, LoopingRuntime])
def test_recycling_greedy_equals_plain_and_starts_warm(runtime_cls, policy):
    dec = SpeculativeDecoder(runtime_cls(V, seed=0), drafter="recycle", policy=make_policy(policy, 4))
    expected = plain(runtime_cls, PROMPT, 80)
    runs = []
    for _ in range(2):  # the second generation drafts from the table the first one filled
        out, steps = generate(dec, PROMPT, 80)
        assert out == expected
        assert all(s.accepted <= s.drafted and s.source in ("", "recycle") for s in steps)
        assert dec.target.cache == (PROMPT + out)[:dec.target.n_past]
        runs.append(steps)
    if runtime_cls is LoopingRuntime:
        # logits that depend on the last token only: once seen, the table predicts them exactly
        assert sum(s.accepted for s in runs[0]) > 0
        assert all(s.accepted == s.drafted for s in runs[1]) and sum(s.drafted for s in runs[1]) > 0
        assert len(runs[1]) < len(runs[0])


def test_forget_makes_the_next_generation_start_cold():
    """What the bench calls between repeats: the second generation drafts as the first did."""
    dec = SpeculativeDecoder(LoopingRuntime(V, seed=0), drafter="recycle", policy=FixedK(4))
    first = generate(dec, PROMPT, 60)[1]
    dec.drafter.forget()
    assert dec.drafter.table.updates == 0 and (dec.drafter.table.rows == -1).all()
    again = generate(dec, PROMPT, 60)[1]
    assert [(s.drafted, s.accepted) for s in again] == [(s.drafted, s.accepted) for s in first]
    warm = generate(dec, PROMPT, 60)[1]  # without forget: the table the last run filled
    assert len(warm) < len(first)


def test_each_sampling_regime_learns_in_a_policy_of_its_own():
    """Acceptance and costs differ when sampling: a sampled stream must not teach the greedy
    policy (nor one temperature another), while repeating a setting keeps what it learned."""
    dec = SpeculativeDecoder(ToyRuntime(V, seed=0), drafter="recycle", policy=make_policy("cost", 4))
    greedy_before = dec.policy.snapshot()
    hot = SamplingParams(temperature=1.0, seed=1)
    generate(dec, PROMPT, 40, hot)
    assert dec.policy.snapshot() == greedy_before  # greedy's policy untouched
    sampled = dec.policy_for(hot)
    assert sampled is not dec.policy and sampled.snapshot() != greedy_before
    assert dec.policy_for(SamplingParams(temperature=1.0, seed=9)) is sampled  # the seed is no regime
    assert dec.policy_for(SamplingParams(temperature=0.7, top_k=40)) is not sampled
    assert dec.policy_for(GREEDY) is dec.policy
    for t in range(20):  # old sampled settings are dropped; greedy's policy never is
        dec.policy_for(SamplingParams(temperature=0.1 + t / 10))
    assert dec.policy_for(GREEDY) is dec.policy and dec.policy_for(hot) is not sampled


class Learning(FixedK):
    """A fixed policy that records what it is told to learn."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.learned: list[tuple[str, int, int]] = []

    def learn(self, source, drafted, accepted, expected=None):
        self.learned.append((source, drafted, accepted))


@pytest.mark.parametrize("runtime_cls", [ToyRuntime, LoopingRuntime])
def test_steps_recycling_did_not_draft_are_free_trials_for_the_policy(runtime_cls):
    policy = Learning(0)  # never drafts: every step is plain, and every one with a known guess a trial
    dec = SpeculativeDecoder(runtime_cls(V, seed=0), drafter="recycle", policy=policy)
    out, steps = generate(dec, PROMPT, 60)
    assert all(s.drafted == 0 for s in steps)
    assert policy.learned and all(src == "recycle" and d == 1 for src, d, _ in policy.learned)
    # the guess was the table's successor of the last committed token, before this step wrote it
    seen: dict[int, int] = {}
    expected = []
    for last, nxt in zip([PROMPT[-1], *out], out):
        if last in seen:
            expected.append(int(seen[last] == nxt))
        seen[last] = nxt
    assert [a for _, _, a in policy.learned] == expected
    if runtime_cls is LoopingRuntime:  # the next token depends on the last one only: every guess is right
        assert all(expected)


def test_recycle_needs_no_model():
    with pytest.raises(ConfigError, match="uses no draft model"):
        SpeculativeDecoder(ToyRuntime(V, seed=0), ToyRuntime(V, seed=1), drafter="recycle")
    dec = SpeculativeDecoder(ToyRuntime(V, seed=0), drafter="recycle")
    assert isinstance(dec.drafter, RecyclingDrafter) and dec.drafter.table.rows.shape == (V, 8)


def test_sampling_with_recycled_drafts_matches_the_target():
    params = SamplingParams(temperature=1.0)
    target = ToyRuntime(V, seed=0)
    p = probabilities(target.forward(PROMPT)[-1], params)
    target.reset()
    dec = SpeculativeDecoder(target, drafter="recycle", policy=FixedK(1))
    n, counts, drafted, accepted = 3000, np.zeros(V), 0, 0
    for i in range(n):
        tokens = list(PROMPT)
        step = next(dec.stream(tokens, SamplingParams(1.0, seed=i), 2))
        drafted, accepted = drafted + step.drafted, accepted + step.accepted
        counts[tokens[len(PROMPT)]] += 1
    # every run after the first drafts the target's own top-1 after the prompt, a point mass
    assert drafted == n - 1 and dec.drafter.table.chain(PROMPT[-1], 1) == [int(np.argmax(p))]
    assert 0.05 * n < accepted < 0.95 * n  # drafts were kept and replaced
    assert counts[p == 0].sum() == 0
    expected = p * n
    big, rare = expected >= 5, (expected > 0) & (expected < 5)
    obs, exp = np.append(counts[big], counts[rare].sum()), np.append(expected[big], expected[rare].sum())
    assert chisquare(obs, exp).pvalue > 1e-3


# ---------------------------------------------------------------- real tiny bundles


def decode(decoder, ids: list[int], n: int) -> tuple[list[int], int, int]:
    tokens, drafted, accepted = list(ids), 0, 0
    for step in decoder.stream(tokens, GREEDY, n):
        drafted, accepted = drafted + step.drafted, accepted + step.accepted
    return tokens[len(ids):], drafted, accepted


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_recycling_on_a_tiny_bundle_equals_plain_decoding(zoo, backend):
    if backend == "openvino":
        pytest.importorskip("openvino")
    from edgespec.engine.engine import load
    from tests.tiny import PROMPTS

    path = zoo.bundle("gemma3", None, formats=("onnx", "openvino"))
    with load(path, backend=backend, drafter="recycle", k=3) as engine:
        assert engine.drafter_name == "recycle" and engine.draft is None
        plain = engine.variant(plain=True)
        drafted = accepted = 0
        for text in PROMPTS:
            ids = engine.tokenizer.encode(text)
            engine.target.reset()
            expected, _, _ = decode(plain, ids, 40)
            for _ in range(2):  # the engine's decoder, and with it the table, lives on: the second run starts warm
                engine.target.reset()
                out, d, a = decode(engine.decoder, ids, 40)
                assert out == expected
                drafted, accepted = drafted + d, accepted + a
    assert accepted > 0 and drafted > accepted  # drafts were kept and rolled back, and output did not change
