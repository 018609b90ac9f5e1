"""A draft on the target's own body (runtimes/shared_body.py), on the toy model: greedy output is
plain greedy output, no position is computed twice unless a draft there was rejected, and each
runtime keeps its own prefix of the one body's sequence. The OpenVINO split is tested in
test_openvino.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgespec.decoding import SamplingParams, SpeculativeDecoder
from edgespec.decoding.policy import FixedK
from edgespec.runtimes.shared_body import WINDOW, shared_pair
from tests.toy import ToyRuntime, naive_greedy

VOCAB = 40
PROMPT = [3, 17, 5, 9, 17, 5]


class MatrixHead:
    """hidden @ w: the toy body's "hidden rows" are its logits, so the identity is the target's
    head and a column subset (plus noise) a trimmed draft head."""

    def __init__(self, w: np.ndarray) -> None:
        self.w = w.astype(np.float32)
        self.vocab_size, self.weight_bytes = w.shape[1], w.nbytes
        self.rows: list[int] = []  # rows per call
        self.closed = False

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        self.rows.append(len(hidden))
        return hidden @ self.w

    def close(self) -> None:
        self.closed = True


def make_pair(noise: float = 0.0, n_keep: int = 30, **toy):
    """(body, target, draft, id map): the draft keeps `n_keep` of the 40 ids (shuffled, so the id
    map matters), `noise` makes it disagree."""
    rng = np.random.default_rng(3)
    keep = rng.permutation(VOCAB)[:n_keep]
    trimmed = np.eye(VOCAB)[:, keep] + noise * rng.standard_normal((VOCAB, len(keep)))
    body = ToyRuntime(VOCAB, **toy)
    target, draft = shared_pair(body, MatrixHead(np.eye(VOCAB)), MatrixHead(trimmed))
    return body, target, draft, keep


def fresh_logits(ids: list[int], n: int) -> np.ndarray:
    return ToyRuntime(VOCAB).forward(ids, n_logits=n)


@pytest.mark.parametrize("drafter", ["model", "both"])
@pytest.mark.parametrize("noise, n_keep", [(0.0, VOCAB), (1.5, 30)], ids=["faithful", "disagreeing"])
def test_greedy_on_a_shared_body_is_plain_greedy_and_computes_each_position_once(drafter, noise, n_keep):
    body, target, draft, keep = make_pair(noise, n_keep)
    dec = SpeculativeDecoder(target, draft, id_map=keep, drafter=drafter, policy=FixedK(4))
    tokens, drafted, accepted = list(PROMPT), 0, 0
    for step in dec.stream(tokens, SamplingParams(), 60):
        drafted, accepted = drafted + step.drafted, accepted + step.accepted
    assert tokens[len(PROMPT):] == naive_greedy(ToyRuntime(VOCAB), PROMPT, 60)
    assert drafted > 0
    if noise:
        assert accepted < drafted, "rollback went untested"
    # the body saw every committed position once (the last is never fed), and a position again
    # only where a rejected draft or a wrong lookahead guess had been: a draft with its own body
    # would feed each one twice
    model = dec.drafter if drafter == "model" else dec.drafter.model
    wrong_guesses = model.guessed - model.guess_hits
    assert (drafter == "both") == (model.guessed > 0)
    assert len(body.fed_positions) <= len(tokens) - 1 + (drafted - accepted) + wrong_guesses
    if drafter == "model" and not noise:  # the target's own hidden rows and head: all accepted
        assert accepted == drafted and sorted(body.fed_positions) == list(range(len(tokens) - 1))


def test_each_runtime_keeps_its_own_prefix_of_the_one_body():
    body, target, draft, keep = make_pair()
    a = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 20)]
    b = a[:8] + [(t + 1) % VOCAB for t in a[8:]]
    np.testing.assert_array_equal(target.forward(a[:12], n_logits=12), fresh_logits(a[:12], 12))
    # the draft reads the positions the target computed, then writes a diverging sequence
    calls = body.calls
    np.testing.assert_array_equal(draft.forward(a[:8], n_logits=2), fresh_logits(a[:8], 2)[:, keep])
    assert body.calls == calls, "held rows were recomputed"
    np.testing.assert_array_equal(draft.forward(b[8:15], n_logits=3), fresh_logits(b[:15], 3)[:, keep])
    # the target's prefix (a[:12]) no longer matches the body past 8: its next forward recomputes
    np.testing.assert_array_equal(target.forward(a[12:16], n_logits=4), fresh_logits(a[:16], 4))
    assert (target.n_past, draft.n_past, body.n_past) == (16, 15, 16)
    draft.trim(10)
    np.testing.assert_array_equal(draft.forward(b[10:13], n_logits=1), fresh_logits(b[:13], 1)[:, keep])


def test_rows_older_than_the_window_are_recomputed_and_wide_reads_work():
    body, target, _, _ = make_pair()
    ids = [int(t) for t in np.random.default_rng(1).integers(0, VOCAB, WINDOW + 40)]
    ref = fresh_logits(ids, len(ids))
    np.testing.assert_array_equal(target.forward(ids, n_logits=1), ref[-1:])
    # positions 10..39 are held by the body, but their rows have left the window: recomputed
    target.trim(10)
    np.testing.assert_array_equal(target.forward(ids[10:], n_logits=len(ids) - 10), ref[10:])
    assert body.calls == 2 and body.fed_positions[-1] == len(ids) - 1
    assert target.reused_rows == 0
    # a read as wide as it asks stays held: no body forward at all, and the runtime says so
    target.trim(10)
    np.testing.assert_array_equal(target.forward(ids[10:], n_logits=len(ids) - 10), ref[10:])
    assert body.calls == 2 and body.n_past == len(ids)
    assert target.reused_rows == len(ids) - 10


def test_rows_fed_ahead_by_the_draft_are_reused_by_the_target():
    body, target, draft, _ = make_pair()
    draft.forward(PROMPT, n_logits=1)  # the draft fed a guess run past what the target holds
    target.forward(PROMPT[:3])
    assert target.reused_rows == 3 and body.calls == 1
    np.testing.assert_array_equal(target.forward(PROMPT[3:] + [1], n_logits=2), fresh_logits(PROMPT + [1], 2))
    assert target.reused_rows == len(PROMPT) - 3 and body.calls == 2


def test_a_failed_body_forward_leaves_the_runtimes_consistent():
    body, target, draft, keep = make_pair(fail_at=2)  # the second body forward dies midway
    target.forward(PROMPT[:4])
    with pytest.raises(RuntimeError, match="toy backend failed"):
        draft.forward(PROMPT, n_logits=1)
    assert draft.n_past == 0 and target.n_past == 4
    np.testing.assert_array_equal(target.forward(PROMPT[4:], n_logits=2), fresh_logits(PROMPT, 2))


def test_memory_capabilities_and_close():
    body, target, draft, _ = make_pair()
    target.forward(PROMPT)
    assert target.capabilities.extra["shared_body"] == "target" and draft.capabilities.extra["shared_body"] == "draft"
    assert draft.memory_bytes() == {"weights": draft.head.weight_bytes, "kv": 0} and draft.kv_bytes_per_token == 0
    assert target.memory_bytes()["kv"] == body.memory_bytes()["kv"] > 0
    assert target.memory_bytes()["weights"] == body.memory_bytes()["weights"] + target.head.weight_bytes
    draft.close()
    assert draft.head.closed and not target.head.closed
    target.close()
    assert target.head.closed


class EchoFeatureHead:
    """A trained head's stand-in: the feature of (h, x) is x's one-hot row, so the draft's head
    proposes the token it was fed (a repeat), whatever the target would say."""

    weight_bytes = 0

    def __init__(self, keep: np.ndarray, vocab: int = VOCAB) -> None:
        self.to_target = np.append(keep, 0)  # draft index -> target id (K: outside, any row)
        self.hidden_size = vocab
        self.calls = 0

    def __call__(self, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        assert hidden.shape == (len(tokens), self.hidden_size)
        self.calls += 1
        return np.eye(self.hidden_size, dtype=np.float32)[self.to_target[tokens]]

    def close(self) -> None:
        pass


def test_the_head_drafter_reads_the_rows_the_verify_computed_and_never_runs_the_body():
    rng = np.random.default_rng(3)
    keep = rng.permutation(VOCAB)[:30]
    body = ToyRuntime(VOCAB)
    head = EchoFeatureHead(keep)
    target, draft = shared_pair(body, MatrixHead(np.eye(VOCAB)), MatrixHead(np.eye(VOCAB)[:, keep]), head)
    assert draft.feature_head is head and target.feature_head is None
    dec = SpeculativeDecoder(target, draft, id_map=keep, drafter="head", policy=FixedK(3))
    tokens = list(PROMPT)
    steps = list(dec.stream(tokens, SamplingParams(), 40))
    assert tokens[len(PROMPT):] == naive_greedy(ToyRuntime(VOCAB), PROMPT, 40)
    assert head.calls == sum(s.drafted for s in steps) > 0
    # one body forward for the prefill, then one per verify: the head's reads were all free
    assert target.shared.forwards == len(steps) + 1
    # hidden_rows: the body's rows, read without a forward, and this runtime's prefix unchanged
    rows = draft.hidden_rows(tokens[:-1], 2)
    np.testing.assert_array_equal(rows, fresh_logits(tokens[:-1], 2))
    assert target.shared.forwards == len(steps) + 1 and draft.n_past == 0


def test_a_draft_catching_up_on_a_long_prompt_never_runs_the_body_over_it_again():
    """A prompt many times the window and the prefill chunk: the draft's first forward catches up
    on the whole prompt, whose rows the body holds from the target's prefill; fed in chunks, each
    chunk's last hidden row would have left the window and the body would run the prefix again."""
    from edgespec.decoding.limits import DecoderLimits

    prompt = [int(t) for t in np.random.default_rng(5).integers(0, VOCAB, 6 * WINDOW)]
    body, target, draft, keep = make_pair(0.0, VOCAB)  # faithful: every draft accepted
    dec = SpeculativeDecoder(target, draft, id_map=keep, drafter="model", policy=FixedK(4),
                             limits=DecoderLimits(max_batch=WINDOW // 2))
    tokens = list(prompt)
    drafted = sum(step.drafted for step in dec.stream(tokens, SamplingParams(), 24))
    assert drafted > 0 and tokens[len(prompt):] == naive_greedy(ToyRuntime(VOCAB), prompt, 24)
    # a faithful draft: every committed position through the body once, in the order it came
    assert sorted(body.fed_positions) == list(range(len(tokens) - 1))


# ---------------------------------------------------------------- the context's tokens in the draft


def widened_pair(n_keep: int = 12):
    """A faithful draft that keeps `n_keep` of the 40 ids, and the target head's rows (the identity's)."""
    keep = np.random.default_rng(3).permutation(VOCAB)[:n_keep]
    body = ToyRuntime(VOCAB)
    target, draft = shared_pair(body, MatrixHead(np.eye(VOCAB)), MatrixHead(np.eye(VOCAB)[:, keep]),
                                vocab_rows=lambda ids: np.eye(VOCAB, dtype=np.float32)[ids])
    return target, draft, keep


def test_a_draft_with_the_target_rows_proposes_the_context_tokens_its_head_lacks():
    """Greedy: the drafts the widened draft adds are the target's own argmax wherever that token
    is in the context, so more are accepted, and the output is plain greedy output all the same."""
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB, 30)]
    accepted = {}
    for widened in (False, True):
        target, draft, keep = widened_pair()
        if not widened:
            draft.vocab_rows = None
        dec = SpeculativeDecoder(target, draft, id_map=keep, drafter="model", policy=FixedK(4))
        tokens = list(prompt)
        accepted[widened] = sum(s.accepted for s in dec.stream(tokens, SamplingParams(), 40))
        assert tokens[len(prompt):] == naive_greedy(ToyRuntime(VOCAB), prompt, 40)
    assert accepted[True] > accepted[False], accepted


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=6)],
                         ids=["pure-temperature", "top-k"])
def test_sampling_with_the_widened_draft_follows_the_target(params):
    """The first sampled token after a prompt, over many seeded runs, follows the target's
    distribution (chi-square), with the draft's row widened by the prompt's tokens; and the
    widened draft is accepted more often than the trimmed one."""
    from edgespec.decoding import probabilities
    from tests.chi2 import pooled_chi_square_p

    prompt = [int(t) for t in np.random.default_rng(8).integers(0, VOCAB, 24)]
    p = probabilities(fresh_logits(prompt, 1)[-1], params)
    n = 2000
    stats = {}
    for widened in (False, True):
        target, draft, keep = widened_pair(8)
        if not widened:
            draft.vocab_rows = None
        dec = SpeculativeDecoder(target, draft, id_map=keep, drafter="model", policy=FixedK(1))
        counts, accepted = np.zeros(VOCAB), 0
        for seed in range(n):
            tokens = list(prompt)
            step = next(dec.stream(tokens, dataclasses.replace(params, seed=seed), 2))
            counts[step.tokens[0]] += 1
            accepted += step.accepted
        stats[widened] = (pooled_chi_square_p(counts, p), accepted)
    assert stats[True][0] > 1e-3 and stats[False][0] > 1e-3, stats
    assert stats[True][1] > stats[False][1], stats
