"""Overlapped drafting (decoding/overlap.py): the draft model drafts on while the target verifies
in a thread of its own. Greedy output is plain greedy output, sampled output follows the
target's distribution, the caches hold the committed sequence afterwards, and the draft really
runs during the verify, its drafts used when the verify keeps everything."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import statistics
import threading
import time

import numpy as np
import pytest
from scipy.stats import chisquare

from edgespec.decoding import FixedK, ModelDrafter, SamplingParams, SpeculativeDecoder, make_policy, probabilities
from edgespec.decoding import overlap as overlap_mod
from edgespec.decoding.limits import DecoderLimits
from edgespec.decoding.overlap import OverlappedDecoder, overlap_blocker
from edgespec.errors import ConfigError
from tests.toy import ToyRuntime, naive_greedy

V = 40
KEEP = np.arange(0, V, 2)  # a trimmed draft's output ids (target ids)
GREEDY = SamplingParams()
PROMPTS = [[int(t) for t in np.random.default_rng(s).integers(0, V, 3 + s % 9)] for s in range(12)]


def run(dec, tokens: list[int], n: int, params=GREEDY, stop_ids=()) -> tuple[list[int], list]:
    start = len(tokens)
    steps = list(dec.stream(tokens, params, n, stop_ids))
    return tokens[start:], steps


def plain(prompt: list[int], n: int, stop_ids=()) -> list[int]:
    return run(SpeculativeDecoder(ToyRuntime(V, seed=0)), list(prompt), n, stop_ids=stop_ids)[0]


DRAFTS = {  # name -> (draft runtime, id map)
    "agreeing": lambda: (ToyRuntime(V, seed=0), None),
    "noisy": lambda: (ToyRuntime(V, seed=0, noise=0.7), None),
    "different": lambda: (ToyRuntime(V, seed=42), None),
    "trimmed": lambda: (ToyRuntime(V, seed=0, noise=0.3, keep=KEEP), KEEP),
}


@pytest.mark.parametrize("kind", list(DRAFTS))
@pytest.mark.parametrize("drafter,policy,k", [("model", "fixed", 1), ("model", "fixed", 3), ("model", "heuristic", 2),
                                              ("both", "cost", 2), ("model", "confidence", 2)])
def test_greedy_overlapped_is_plain_greedy(kind, drafter, policy, k):
    draft, id_map = DRAFTS[kind]()
    dec = OverlappedDecoder(ToyRuntime(V, seed=0), draft, id_map=id_map, drafter=drafter, policy=make_policy(policy, k))
    assert dec.blocker is None
    stop = (7,)
    for prompt in PROMPTS:
        got, steps = run(dec, list(prompt), 25, stop_ids=stop)
        assert got == plain(prompt, 25, stop_ids=stop), prompt
        assert sum(len(s.tokens) for s in steps) == len(got)
    assert dec.overlap.overlapped > 0 and dec.overlap.drafted_ahead > 0
    if kind == "agreeing" and policy == "fixed":  # every verify keeps everything: its drafts are used
        assert dec.overlap.steps_ahead > 0 and dec.overlap.used_ahead >= dec.overlap.steps_ahead


def test_drafts_made_ahead_keep_to_the_verify_width_the_budget_and_the_context():
    """The drafts made ahead are the next step's draft: the same limits hold for them."""
    target = ToyRuntime(V, seed=0, max_batch_tokens=3)  # a verify of at most 3 rows: 2 drafts
    dec = OverlappedDecoder(target, ToyRuntime(V, seed=0), policy=FixedK(5))
    for prompt in PROMPTS[:4]:
        got, steps = run(dec, list(prompt), 17)
        assert got == plain(prompt, 17) and len(got) == 17
        assert all(s.drafted <= 2 for s in steps), [s.drafted for s in steps]
    assert dec.overlap.steps_ahead > 0
    dec = OverlappedDecoder(ToyRuntime(V, seed=0), ToyRuntime(V, seed=0), policy=FixedK(4),
                            limits=DecoderLimits(context_limit=20, verify_width=3))
    tokens = list(PROMPTS[3])
    for step in dec.stream(tokens, GREEDY, 30):
        before = len(tokens) - len(step.tokens)
        # a verify writes before + drafted positions; past the context the decoder drafts nothing
        assert step.drafted <= 2 and (before + step.drafted <= 20 if before < 20 else step.drafted == 0)
    assert tokens[len(PROMPTS[3]):] == plain(PROMPTS[3], 30) and dec.overlap.steps_ahead > 0


def test_a_draft_that_ends_on_a_lookahead_guess_already_fed():
    """A model drafter that feeds guesses along (as "both" does with prompt lookup) may end its
    draft on a guess whose row it holds already; drafting on from there starts from a clean cache."""
    oracle = ToyRuntime(V, seed=0, noise=0.7)

    def guess(tokens: list[int], drafts: list[int]) -> list[int]:  # the draft's own greedy continuation
        return naive_greedy(oracle, tokens + drafts, 2)

    drafter = ModelDrafter(ToyRuntime(V, seed=0, noise=0.7), V, guess=guess)
    dec = OverlappedDecoder(ToyRuntime(V, seed=0), drafter=drafter, policy=FixedK(3))
    for prompt in PROMPTS[:6]:
        assert run(dec, list(prompt), 20)[0] == plain(prompt, 20), prompt
    assert drafter.guess_hits > 0 and dec.overlap.overlapped > 0 and dec.overlap.steps_ahead > 0


@pytest.mark.parametrize("kind", ["noisy", "different", "trimmed"])
def test_each_cache_holds_the_committed_prefix_after_rejections(kind):
    draft, id_map = DRAFTS[kind]()
    target = ToyRuntime(V, seed=0)
    dec = OverlappedDecoder(target, draft, id_map=id_map, policy=FixedK(3))
    rejected = 0
    for prompt in PROMPTS:
        tokens = list(prompt)
        for step in dec.stream(tokens, GREEDY, 20):
            rejected += step.accepted < step.drafted
            assert target.cache == tokens[:-1]  # between steps: exactly the committed sequence, last unfed
        assert draft.cache == tokens[:len(draft.cache)] and len(draft.cache) < len(tokens)
        # a stream stopped midway: both caches trimmed to a prefix of what was committed
        tokens = list(prompt)
        stream = dec.stream(tokens, GREEDY, 20)
        next(stream)
        next(stream)
        stream.close()
        assert target.cache == tokens[:-1]
        assert draft.cache == tokens[:len(draft.cache)] and len(draft.cache) < len(tokens)
        # and the next stream on the extended sequence continues as plain decoding does
        start = list(tokens)
        assert run(dec, tokens, 10)[0] == plain(start, 10)
    assert rejected > 0


@pytest.mark.parametrize("who,fail_at", [("target", 3), ("target", 5), ("draft", 4), ("draft", 9)])
def test_a_failed_forward_in_either_thread_leaves_consistent_caches(who, fail_at):
    target = ToyRuntime(V, seed=0, fail_at=fail_at if who == "target" else None)
    draft = ToyRuntime(V, seed=0, noise=0.7, fail_at=fail_at if who == "draft" else None)
    dec = OverlappedDecoder(target, draft, policy=FixedK(2))
    tokens = list(PROMPTS[5])
    with pytest.raises(RuntimeError, match="toy backend failed"):
        run(dec, tokens, 30)
    for rt in (target, draft):  # a prefix of the committed sequence (a cache of unknown rows is reset)
        assert rt.cache == tokens[:len(rt.cache)] and len(rt.cache) < len(tokens)
    start = list(tokens)
    assert run(dec, tokens, 12)[0] == plain(start, 12)


def _exact_joint(prompt: list[int], params: SamplingParams, n: int, vocab: int) -> dict[tuple, float]:
    """P(first n tokens) under the target alone, by enumeration."""
    model = ToyRuntime(vocab, seed=0)
    out = {}
    for seq in itertools.product(range(vocab), repeat=n):
        p = 1.0
        for i in range(n):
            model.reset()
            p *= probabilities(model.forward(prompt + list(seq[:i]))[-1], params)[seq[i]]
            if p == 0:
                break
        out[seq] = p
    model.reset()
    return out


@pytest.mark.parametrize("kind", ["noisy", "trimmed"])
def test_sampled_overlapped_follows_the_target(kind):
    """The first three sampled tokens, over many seeded runs, follow the target's joint
    distribution (chi-square). With one draft per step the third token is the draft made during
    the first verify whenever that verify kept everything and its own token was the guess."""
    vocab, n_tok, runs = 6, 3, 3000
    params = SamplingParams(temperature=1.0)
    prompt = [1, 4, 2]
    exact = _exact_joint(prompt, params, n_tok, vocab)
    keep = np.array([0, 2, 3, 5]) if kind == "trimmed" else None
    draft = ToyRuntime(vocab, seed=0, noise=0.4, keep=keep)
    dec = OverlappedDecoder(ToyRuntime(vocab, seed=0), draft, id_map=keep, policy=FixedK(1))
    counts: dict[tuple, int] = {}
    for seed in range(runs):
        got, _ = run(dec, list(prompt), n_tok + 1, dataclasses.replace(params, seed=seed))
        counts[tuple(got[:n_tok])] = counts.get(tuple(got[:n_tok]), 0) + 1
    assert all(exact[s] > 0 for s in counts), "a sequence the target cannot produce"
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [s for s in cells if exact[s] * runs >= 5]
    rest = [s for s in cells if 0 < exact[s] * runs < 5]
    obs = [counts.get(s, 0) for s in big] + [sum(counts.get(s, 0) for s in rest)]
    exp = [exact[s] * runs for s in big] + [sum(exact[s] for s in rest) * runs]
    assert len(big) >= 10
    assert chisquare(obs, exp).pvalue > 1e-3, (chisquare(obs, exp).pvalue, dec.overlap)
    # the path under test ran: drafts made ahead were used, and others dropped
    assert dec.overlap.steps_ahead > runs // 10
    assert dec.overlap.steps_ahead < dec.overlap.overlapped


class Sleepy(ToyRuntime):
    """A toy runtime whose forwards sleep (releasing the GIL, as a backend's forward does) and
    record (thread, start, end); the thread object itself, as an ident may be reused."""

    def __init__(self, *args, delay: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay
        self.spans: list[tuple[threading.Thread, float, float]] = []

    def forward(self, token_ids, n_logits=1):
        t0 = time.perf_counter()
        time.sleep(self.delay)
        out = super().forward(token_ids, n_logits)
        self.spans.append((threading.current_thread(), t0, time.perf_counter()))
        return out


def test_the_draft_runs_while_the_verify_is_in_flight_and_its_drafts_are_used():
    target = Sleepy(V, seed=0, delay=0.03)
    draft = Sleepy(V, seed=0, delay=0.004)  # the target itself: every verify keeps everything
    dec = OverlappedDecoder(target, draft, policy=FixedK(2))
    prompt = PROMPTS[2]
    got, steps = run(dec, list(prompt), 30)
    assert got == plain(prompt, 30)
    assert len(steps) == 10 and all(s.accepted == s.drafted == 2 for s in steps)
    # each step after the first drafted nothing of its own: its draft was made during the last verify
    assert dec.overlap.steps_ahead == len(steps) - 1 and dec.overlap.used_ahead == 2 * (len(steps) - 1)
    # ... so its draft phase ran no forward (a median: a busy machine may preempt one step)
    assert statistics.median(s.draft_ms for s in steps[1:]) < 1.0 < steps[0].draft_ms, [s.draft_ms for s in steps]
    main = threading.current_thread()
    verifies = [(t, a, b) for t, a, b in target.spans if t is not main]
    assert len(verifies) == len(steps)  # every verify ran in the worker, the prefill in the caller
    assert len({id(t) for t, _, _ in verifies}) == 1  # one worker for the stream, not a thread per verify
    assert not [t for t in threading.enumerate() if t.name.startswith("edgespec-verify")]  # and it is gone
    during = [(a, b) for t, a, b in draft.spans
              if t is main and any(a < vb and va < b for _, va, vb in verifies)]
    assert len(during) >= 2 * (len(steps) - 1)  # draft forwards that ran while a verify was running


def test_a_draft_on_the_targets_body_or_no_draft_model_runs_the_plain_loop(monkeypatch, caplog):
    monkeypatch.setattr(overlap_mod, "_told", set())
    draft = ToyRuntime(V, seed=0)
    draft.capabilities = dataclasses.replace(draft.capabilities, extra={"shared_body": "draft"})
    with caplog.at_level(logging.INFO, logger="edgespec.decoding.overlap"):
        dec = OverlappedDecoder(ToyRuntime(V, seed=0), draft, policy=FixedK(2))
    assert "target's body" in dec.blocker and dec.blocker in caplog.text
    assert run(dec, list(PROMPTS[1]), 20)[0] == plain(PROMPTS[1], 20)
    assert dec.overlap.overlapped == 0 and dec.overlap.steps_ahead == 0
    ngram = OverlappedDecoder(ToyRuntime(V, seed=0), drafter="ngram", policy=FixedK(2))
    assert "no draft model" in ngram.blocker
    assert run(ngram, list(PROMPTS[1]), 20)[0] == plain(PROMPTS[1], 20)
    assert overlap_blocker(None).startswith("no drafter")


def test_the_overlap_option_is_validated_and_has_its_flag():
    from edgespec.engine.config import OPTIONS, EngineConfig

    assert EngineConfig().overlap is False and EngineConfig(overlap=True).overlap is True
    assert OPTIONS["overlap"].flags == ("--overlap",) and OPTIONS["overlap"].kind == "true"
    with pytest.raises(ConfigError, match="overlap must be True or False"):
        EngineConfig(overlap="yes")


@pytest.mark.parametrize("drafter", ["model", "both"])
def test_an_engine_with_overlap_decodes_as_plain(zoo, drafter):
    """On exported tiny models; "both" also feeds prompt-lookup guesses with each draft forward,
    so a draft may end on a guess its cache holds already."""
    from edgespec.engine.engine import load
    from tests.zoo import DISAGREEING

    with load(zoo.bundle("llama", DISAGREEING), drafter=drafter, k=2, draft_body="own", overlap=True) as e:
        assert isinstance(e.decoder, OverlappedDecoder) and e.decoder.blocker is None
        ref = e.variant(plain=True)
        for ids in ([5, 9, 2, 44, 3], [17, 8, 8, 1], [60, 2, 33, 7, 7, 7, 12]):
            want = run(ref, list(ids), 16)[0]
            e.target.reset()
            e.draft.reset()
            assert run(e.decoder, list(ids), 16)[0] == want, ids
        assert e.decoder.overlap.overlapped > 0


def test_the_cli_flag_reaches_the_decoder(zoo):
    """`--overlap` on the command line: the same text as plain decoding."""
    import os
    import subprocess
    import sys

    from tests.zoo import DISAGREEING

    bundle = str(zoo.bundle("llama", DISAGREEING))

    def generate(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgespec", "generate", bundle, "the dog", "--max-tokens", "20",
                               *flags, "-v"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "EDGESPEC_TUNE": "0"})

    a = generate("-k", "3", "--draft-body", "own", "--overlap")
    b = generate("--no-draft")
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
