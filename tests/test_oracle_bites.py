"""The oracle bites: small, realistic mistakes injected into the decoding, each failing the
oracle's test (tests/oracle.py: check A, the reference against the exact law, or check B, a path
against plain decoding with the same seed), and one harmless change that passes.

Rejection sampling's own mistakes (an acceptance ratio a little low, a residual not renormalised,
lookup drafts judged with the wrong q) need a rule the engine no longer has: a draft is kept when
it is the target's own draw (edgespec/decoding/draws.py), so nothing is divided by q, and a race
is the same whatever scale its weights have. Their counterparts in that rule are injected instead:
the drafted token's probability 0.98 times what it is, the correction drawn from the row without
the rejected draft on fresh noise (what porting a residual would do), lookup drafts judged by
the greedy rule."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from edgespec.decoding import Candidates, SamplingParams, SpeculativeDecoder, sampling, speculative
from edgespec.decoding.acceptance import accept_coupled
from tests import oracle
from tests.test_oracle import CONFIGS, drafter_decoder, seeded_run


def _support(dist) -> tuple[np.ndarray, np.ndarray]:
    assert isinstance(dist, Candidates)
    return dist.ids, dist.probs


def _lenient(draft_tokens, target_dists, draws, start, draft_dists=None, ratios=None):
    """Acceptance x 0.98: the drafted token raced at 0.98 times its probability."""
    for i, tok in enumerate(draft_tokens):
        ids, w = _support(target_dists[i])
        token = draws.at(start + i).race(ids, np.where(ids == tok, 0.98 * w, w))
        if token != tok:
            return i, token
    return len(draft_tokens), target_dists[len(draft_tokens)].sample(draws.at(start + len(draft_tokens)))


def _residual(draft_tokens, target_dists, draws, start, draft_dists=None, ratios=None):
    """After a rejected draft, the correction drawn from p without the draft, on the next
    position's noise (as rejection sampling draws its residual with a fresh number)."""
    n, token = accept_coupled(draft_tokens, target_dists, draws, start, draft_dists, ratios)
    if n < len(draft_tokens):
        ids, w = _support(target_dists[n])
        rest = ids != draft_tokens[n]
        token = draws.at(start + n + 1).race(ids[rest], w[rest])
    return n, token


def _greedy_lookup(draft_tokens, target_dists, draws, start, draft_dists=None, ratios=None):
    """Lookup drafts (no distributions) judged by the greedy rule: kept when the target's likeliest."""
    if draft_dists is not None:
        return accept_coupled(draft_tokens, target_dists, draws, start, draft_dists, ratios)
    for i, tok in enumerate(draft_tokens):
        ids, w = _support(target_dists[i])
        if ids[np.argmax(w)] != tok:
            return i, target_dists[i].sample(draws.at(start + i))
    return len(draft_tokens), target_dists[len(draft_tokens)].sample(draws.at(start + len(draft_tokens)))


def _shifted(draft_tokens, target_dists, draws, start, draft_dists=None, ratios=None):
    """The target's draws at drafted positions on the next position's noise (an off-by-one)."""
    for i, tok in enumerate(draft_tokens):
        token = target_dists[i].sample(draws.at(start + i + 1))
        if token != tok:
            return i, token
    return len(draft_tokens), target_dists[len(draft_tokens)].sample(draws.at(start + len(draft_tokens)))


def _one_noise(draft_tokens, target_dists, draws, start, draft_dists=None, ratios=None):
    """One position's noise for every draw of a step."""
    for i, tok in enumerate(draft_tokens):
        token = target_dists[i].sample(draws.at(start))
        if token != tok:
            return i, token
    return len(draft_tokens), target_dists[len(draft_tokens)].sample(draws.at(start))


def _bonus_from_the_draft(real: Callable):
    def accept(draft, logits, params, rng, start, ratios, constraint=None):
        n, token = real(draft, logits, params, rng, start, ratios, constraint)
        if draft.dists and n == len(draft.tokens):  # every draft kept: the bonus, from the draft's last row
            token = draft.dists[-1].sample(rng.at(start + n))
        return n, token
    return staticmethod(accept)


def _top_p_before_temperature(real: Callable):
    def distribution(row, params):
        if params.greedy or params.top_p == 1:
            return real(row, params)
        nucleus = real(row, dataclasses.replace(params, temperature=1.0, min_p=0.0)).ids  # top-p at temperature 1
        x = np.asarray(row, dtype=np.float64)[nucleus] / params.temperature
        return Candidates.build(nucleus, np.exp(x - x.max()))
    return distribution


def _rows_off_by_one(real: Callable):
    def accept(draft, logits, params, rng, start, ratios, constraint=None):
        """Each draft judged by the verify's row after it (the bonus row twice)."""
        return real(draft, np.concatenate([logits[1:], logits[-1:]]), params, rng, start, ratios, constraint)
    return staticmethod(accept)


MISTAKES = {  # name -> (what to patch, its replacement, the path and configuration it runs on)
    "acceptance x0.98": (speculative, "accept_coupled", _lenient, ("model", "top-k")),
    "residual drawn on fresh noise": (speculative, "accept_coupled", _residual, ("model", "top-k")),
    "lookup drafts judged by the greedy rule": (speculative, "accept_coupled", _greedy_lookup,
                                                ("ngram", "top-k, repeating")),
    "bonus token from the draft": (speculative.SpeculativeDecoder, "_accept",
                                   _bonus_from_the_draft(speculative.SpeculativeDecoder._accept), ("model", "top-k")),
    "top-p before temperature": (sampling, "distribution", _top_p_before_temperature(sampling.distribution),
                                 ("both", "top-p")),
    "draws on the next position's noise": (speculative, "accept_coupled", _shifted, ("model", "top-k")),
    "one noise for a whole step": (speculative, "accept_coupled", _one_noise, ("model", "top-k")),
    "the verify's rows off by one": (speculative.SpeculativeDecoder, "_accept",
                                     _rows_off_by_one(speculative.SpeculativeDecoder._accept), ("model", "top-k")),
}


def _oracle_verdict(drafter: str, config: str) -> str | None:
    """Run the oracle's test on a fresh decoder: None if it passes, else which check failed and why."""
    c = CONFIGS[config]
    dec = drafter_decoder(drafter, "fixed", 3, config=config)
    try:  # check B first: it stops at the first seed that differs
        oracle.check_path(drafter, seeded_run(dec, c, []), oracle.PlainRows(c.target(), c.prompt), len(c.prompt),
                          c.params, c.length)
    except AssertionError as e:
        return f"check B: {str(e).splitlines()[0]}"
    try:
        oracle.check_reference(config, oracle.PlainRows(c.target(), c.prompt), len(c.prompt), c.params, c.length)
    except AssertionError as e:
        return f"check A: {str(e).splitlines()[0]}"
    return None


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_fails_the_oracle(monkeypatch, mistake):
    where, name, wrong, (drafter, config) = MISTAKES[mistake]
    monkeypatch.setattr(where, name, wrong)
    failed = _oracle_verdict(drafter, config)
    print(f"\n{mistake}: caught by {failed}")
    assert failed is not None, f"the oracle missed: {mistake}"


def test_a_harmless_change_passes(monkeypatch):
    """Drafts raced on another seed's noise: fewer are kept, but every commit is still the target's
    own draw, so the text is plain decoding's: the oracle passes (and is no stricter than exactness)."""
    from edgespec.decoding import drafters

    real = drafters.ModelDrafter.propose
    monkeypatch.setattr(drafters.ModelDrafter, "propose",
                        lambda self, tokens, limit, policy, params, rng: real(self, tokens, limit, policy, params,
                                                                              type(rng)(rng.seed + 1)))
    assert _oracle_verdict("model", "top-k") is None


def test_the_mistakes_change_what_they_claim(monkeypatch):
    """The injected distribution really moves top-p's cut (so the mistake is the one named)."""
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    params = SamplingParams(temperature=0.5, top_p=0.5)
    right = sampling.distribution(row, params)
    wrong = _top_p_before_temperature(sampling.distribution)(row, params)
    assert right.ids.tolist() == [0] and wrong.ids.tolist() == [0, 1]
    assert isinstance(SpeculativeDecoder.__dict__["_accept"], staticmethod)
