"""The exact oracle (tests/oracle.py) on every decoding path, on numpy toy models: each drafter
alone, the default combination (prompt lookup + the draft model, the cost policy, lookahead, the
conversation's tokens in a trimmed draft on the target's body), Token Recycling's trees, the
overlapped decoder, prompts that repeat (prompt lookup drafting every step) and prompts that do
not, and each of the sampler's settings. Each test prints its power statement and its time.

The engine's tests on real backends and a conversation over several turns: test_oracle_engine.py.
The mistakes it catches: test_oracle_bites.py."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import pytest

from edgespec.decoding import Draws, SamplingParams, SpeculativeDecoder, StepResult, make_policy
from edgespec.decoding.overlap import OverlappedDecoder
from edgespec.decoding.recycling import RecyclingDrafter
from edgespec.runtimes.shared_body import shared_pair
from tests import oracle
from tests.test_sampling_sparse import HeadStub
from tests.test_shared_body import MatrixHead
from tests.toy import ToyRuntime, TreeToyRuntime

V = 24
PROMPT = [3, 14, 15, 9, 20, 7]
# every token of the vocabulary, twice in one order: prompt lookup finds a match at every step
REPEATING = [int(t) for t in np.random.default_rng(5).permutation(V)] * 2
KEEP = np.arange(0, V, 2)  # a trimmed draft: even target ids only
DEPTH = oracle.LENGTH  # tokens each seeded run generates and the reference checks


@dataclass(frozen=True)
class Config:
    """A target, a prompt and a sampler whose first tokens' law the oracle enumerates."""

    params: SamplingParams
    prompt: tuple[int, ...] = tuple(PROMPT)
    vocab: int = V
    length: int = oracle.LENGTH

    def target(self, tree: bool = False) -> ToyRuntime:
        return (TreeToyRuntime if tree else ToyRuntime)(self.vocab, seed=0)


CONFIGS = {
    "top-k": Config(SamplingParams(temperature=0.8, top_k=3)),
    "top-k, repeating": Config(SamplingParams(temperature=0.8, top_k=3), tuple(REPEATING)),
    "top-p": Config(SamplingParams(temperature=0.7, top_p=0.7)),
    "min-p": Config(SamplingParams(temperature=0.8, min_p=0.25)),
    "top-k, top-p, min-p": Config(SamplingParams(temperature=0.9, top_k=4, top_p=0.9, min_p=0.15)),
    # every token possible: a dense row, on a vocabulary of five
    "temperature": Config(SamplingParams(temperature=2.0), (1, 2, 3, 0), vocab=5, length=3),
}
_VERDICTS: dict[str, oracle.Verdict] = {}


def verified(name: str) -> oracle.Verdict:
    """Check A for a configuration, once per session (its cost does not depend on the path)."""
    if name not in _VERDICTS:
        c = CONFIGS[name]
        t0, cpu = time.perf_counter(), time.process_time()
        rows = oracle.PlainRows(c.target(), c.prompt)
        _VERDICTS[name] = oracle.check_reference(name, rows, len(c.prompt), c.params, c.length)
        print(f"\n[check A, {name}: {time.perf_counter() - t0:.1f} s, {time.process_time() - cpu:.1f} s of CPU]")
    return _VERDICTS[name]


def seeded_run(dec: SpeculativeDecoder, c: Config, steps: list[StepResult], depth: int = DEPTH):
    """run(seed): the first `depth` tokens the decoder commits after the prompt with that seed."""
    def run(seed: int) -> list[int]:
        tokens = list(c.prompt)
        steps.extend(dec.stream(tokens, dataclasses.replace(c.params, seed=seed), depth))
        return tokens[len(c.prompt):]

    return run


def assert_exact(path: str, config: str, dec: SpeculativeDecoder, depth: int = DEPTH) -> list[StepResult]:
    """Checks A (once per configuration) and B for `dec`; prints the power statement and the time.
    Returns every step the decoder ran, for the path's own evidence that it ran as named."""
    c = CONFIGS[config]
    verdict = verified(config)
    t0, cpu = time.perf_counter(), time.process_time()
    steps: list[StepResult] = []
    reference_rows = oracle.PlainRows(c.target(), c.prompt)
    oracle.check_path(path, seeded_run(dec, c, steps, depth), reference_rows, len(c.prompt), c.params,
                      max(depth, c.length))
    print(f"\n{path}: {verdict.statement()} [check B: {oracle.N_SEEDS} seeds x {depth} tokens, "
          f"{time.perf_counter() - t0:.1f} s, {time.process_time() - cpu:.1f} s of CPU]")
    assert sum(s.drafted for s in steps) > 0 or path == "plain decoding", f"{path}: nothing was drafted"
    return steps


def drafter_decoder(drafter: str, policy: str = "cost", k: int = 3, *, trimmed: bool = False,
                    config: str = "top-k", **kw) -> SpeculativeDecoder:
    c = CONFIGS[config]
    draft = None
    if drafter in ("model", "both", "both-recycle"):
        draft = ToyRuntime(c.vocab, seed=0, noise=0.5, keep=KEEP if trimmed else None)
    return SpeculativeDecoder(c.target(), draft, id_map=KEEP if trimmed and draft is not None else None,
                              drafter=drafter, policy=make_policy(policy, k), **kw)


def sources(steps: list[StepResult]) -> set[str]:
    return {s.source.split(":")[0] for s in steps if s.drafted}


# ---------------------------------------------------------------- the oracle itself


def test_the_reference_races_the_engines_noise():
    """check A's numpy noise is the engine's (draws.py), seed by seed."""
    seeds = np.array([0, 1, 918, 10 ** 9 + 7, 2 ** 62])
    ids = np.array([0, 3, 31, 32, 33, 100, 5000, 262_143])
    want = np.stack([Draws(int(s)).at(17).at(ids) for s in seeds])
    np.testing.assert_array_equal(oracle.noise(seeds, 17, ids), want)


def test_the_sample_sizes_follow_from_the_power():
    """919 seeds: (1 - 0.005)^919 <= 0.01; check A's n reaches power 0.99 at d = 0.005, alpha 1e-4."""
    assert oracle.N_SEEDS == 919 and (1 - oracle.TV_SPLIT) ** oracle.N_SEEDS <= 1 - oracle.POWER
    for df in (1, 26, 80, 124):
        n, _ = oracle.chi_square_size(df)
        assert oracle.power_at(df, n, oracle.TV_SPLIT) >= oracle.POWER > oracle.power_at(df, n - 200, oracle.TV_SPLIT)
        assert oracle.power_at(df, n, 2 * oracle.TV_SPLIT) > 0.999999


def test_the_exact_law_is_the_samplers_specification():
    """The oracle's sampler against hand-worked rows: top-k keeps ties, top-p counts mass before a
    token, min-p compares with the likeliest after top-p."""
    row = np.log([0.5, 0.3, 0.2])
    for params in (SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.75),
                   SamplingParams(temperature=1.0, min_p=0.5)):
        np.testing.assert_allclose(oracle.sampler_probs(row, params), [0.625, 0.375, 0])
    law = oracle.exact_law(lambda prefix: np.log([0.5, 0.3, 0.2]), SamplingParams(temperature=1.0), 2)
    assert law.support == 9 and law.probs.sum() == pytest.approx(1.0) and law.probs.max() == pytest.approx(0.25)


# ---------------------------------------------------------------- every path


def test_plain_decoding():
    assert_exact("plain decoding", "top-k", SpeculativeDecoder(CONFIGS["top-k"].target()))


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "top-k, repeating"])
def test_every_sampler_setting_with_the_default_drafting(config):
    """The default combination (lookup + model, cost policy) under each sampler setting."""
    assert_exact(f"both, cost, {config}", config, drafter_decoder("both", config=config))


@pytest.mark.parametrize("trimmed", [False, True], ids=["full", "trimmed"])
def test_the_draft_model_alone(trimmed):
    assert_exact(f"model{', trimmed' if trimmed else ''}", "top-k", drafter_decoder("model", "fixed", trimmed=trimmed))


@pytest.mark.parametrize("drafter", ["ngram", "recycle", "lookup-recycle", "both-recycle"])
def test_each_drafter_alone_on_a_repeating_prompt(drafter):
    steps = assert_exact(f"{drafter}, repeating prompt", "top-k, repeating", drafter_decoder(drafter, "fixed"))
    if drafter == "ngram":  # prompt lookup drafted at every step but those with one token left to make
        assert sum(s.drafted > 0 for s in steps) >= 0.75 * len(steps)


def test_the_default_combination_with_and_without_repetition():
    """Drafter `auto` on a bundle with a draft: prompt lookup + the draft model, the cost policy;
    lookup firing every step on a repeating prompt, the model drafting where nothing repeats."""
    busy = assert_exact("both, cost, repeating prompt", "top-k, repeating", drafter_decoder("both"))
    quiet = assert_exact("both, cost, no repetition", "top-k", drafter_decoder("both"))
    assert "ngram" in sources(busy) and "model" in sources(quiet)


def test_the_trained_head():
    for keep in (None, KEEP):
        c = CONFIGS["top-k"]
        dec = SpeculativeDecoder(c.target(), HeadStub(V, keep), id_map=keep, drafter="head",
                                 policy=make_policy("fixed", 3))
        assert_exact(f"head{'' if keep is None else ', trimmed'}", "top-k", dec)


def test_the_draft_on_the_targets_body_with_the_conversations_tokens_and_lookahead():
    """The default engine on onnxruntime/OpenVINO: the draft is the target's body under a trimmed
    head widened by the sequence's own tokens (context_vocab.py); prompt lookup + the model with
    lookahead guesses; the cost policy."""
    keep = np.random.default_rng(3).permutation(V)[:8]
    body = ToyRuntime(V, seed=0)
    eye = np.eye(V, dtype=np.float32)
    target, draft = shared_pair(body, MatrixHead(eye), MatrixHead(eye[:, keep] + 0.3 * np.random.default_rng(4)
                                                                  .standard_normal((V, len(keep)))),
                                vocab_rows=lambda ids: eye[ids])
    dec = SpeculativeDecoder(target, draft, id_map=keep, drafter="both", policy=make_policy("cost", 3))
    for config in ("top-k, repeating", "top-k"):
        assert_exact(f"shared body, context vocabulary, lookahead ({config})", config, dec)
    model = dec.drafter.model
    assert model._context is not None and model._context.update(list(PROMPT)) is not None
    assert model.guessed > 0  # lookahead guesses were fed


def test_trees():
    """Token Recycling's draft trees on a target that verifies them: a forced shape, and shapes
    the cost policy picks."""
    c = CONFIGS["top-k, repeating"]
    for name, drafter in (("tree (2, 1)", RecyclingDrafter(V, shape=(2, 1))),
                          ("trees by cost", RecyclingDrafter(V, trees=True))):
        target = c.target(tree=True)
        dec = SpeculativeDecoder(target, drafter=drafter, policy=make_policy("cost", 3))
        assert_exact(name, "top-k, repeating", dec, depth=8)  # room for a tree in the first step
        if name.startswith("tree ("):
            assert target.trees > 0


def test_the_overlapped_decoder():
    for config in ("top-k", "top-k, repeating"):
        # a draft close to the target and a fixed length: whole drafts are kept, so drafts made
        # during a verify are used
        dec = OverlappedDecoder(CONFIGS[config].target(), ToyRuntime(V, seed=0, noise=0.1), drafter="both",
                                policy=make_policy("fixed", 2))
        assert dec.blocker is None
        assert_exact(f"overlapped, both, fixed k=2 ({config})", config, dec, depth=10)  # room to draft ahead
        assert dec.overlap.overlapped > 0 and dec.overlap.steps_ahead > 0, dec.overlap


def test_a_lying_clock_changes_the_draft_lengths_not_the_text():
    """The cost policy decides from a clock; a clock that lies makes it pick other lengths, and
    every seed still gives plain decoding's text (issue: seeds that repeat)."""
    rng = np.random.default_rng(0)
    t = [0.0]

    def lying() -> float:
        t[0] += float(rng.exponential(0.01))
        return t[0]

    honest, liar = drafter_decoder("both"), drafter_decoder("both", clock=lying)
    steps = {name: assert_exact(f"both, cost, {name} clock", "top-k", dec)
             for name, dec in (("honest", honest), ("lying", liar))}
    lengths = {name: [s.drafted for s in st] for name, st in steps.items()}
    assert lengths["honest"] != lengths["lying"]
