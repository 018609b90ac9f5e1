"""Slow tier: speculative sampling on the real default model follows the target's law, at the
power the fast tier's oracle has (tests/oracle.py): 0.99 against a total variation of 0.01 on the
joint law of the first tokens, at a false-alarm rate of 1e-4.

The default engine (Gemma 3 270M: prompt lookup + the draft on the target's body under its
VocabTrim head, the cost policy) runs the prompt with seeds 0..918 and must write, token for
token, what plain decoding with each seed writes (check B: a path at TV >= 0.005 from it survives
919 seeds with probability <= 0.01; a correct one always does). Plain decoding's law is then
checked against the exact law enumerated from the model's own rows:

- top-k 3 at temperature 1: the first 4 tokens, 81 sequences; check A, a chi-square of
  1,083,792 seeded reference runs (numpy) against the exact law, has power 0.99 at TV 0.005.
- chat's sampler (temperature 0.7, top-p 0.95, top-k 40): the first 2 tokens, up to 1,600
  sequences, many too rare for a chi-square. Instead every row of the enumeration is compared
  with the specification: `distribution()` keeps the same tokens with the same probabilities (to
  1e-9). With a race against the keyed noise being an exact sampler (check A in the fast tier,
  model-independent), plain decoding's law is then the exact law.

What this costs: 919 runs of 4 and of 2 tokens, and 40 + 41 rows of the model for the reference,
a few minutes on 2 cores (printed)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from edgespec.decoding import SamplingParams, distribution
from tests import oracle

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea, there lived a"
SAMPLERS = {  # name -> (sampler, tokens whose joint law is checked)
    "top-k 3": (SamplingParams(temperature=1.0, top_k=3), 4),
    "chat defaults": (SamplingParams(temperature=0.7, top_p=0.95, top_k=40), 2),
}


def _rows_match_the_specification(rows, params: SamplingParams, length: int) -> int:
    """Every row of the enumeration: distribution() against the oracle's sampler. Returns the law's size."""
    law = oracle.exact_law(rows, params, length)
    for prefix in {seq[:t] for seq in law.sequences for t in range(length)}:
        row = rows(prefix)
        want = oracle.sampler_probs(row, params)
        got = distribution(row, params)
        ids = np.flatnonzero(want)
        assert np.array_equal(np.sort(got.ids), ids), prefix
        np.testing.assert_allclose(got.probs_at(ids), want[ids], rtol=1e-9, atol=0)
    return law.support


@pytest.fixture(scope="module")
def engine(default_cache):
    import edgespec

    with edgespec.load() as e:
        yield e


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_real_model_speculative_sampling_follows_the_target(engine, sampler):
    params, length = SAMPLERS[sampler]
    ids = engine.tokenizer.encode(PROMPT)
    rows = oracle.PlainRows(engine.target, ids, engine.opened.limits.max_batch)
    t0, cpu = time.perf_counter(), time.process_time()
    if sampler == "top-k 3":
        verdict = oracle.check_reference(sampler, rows, len(ids), params, length)
        what = verdict.statement()
    else:
        size = _rows_match_the_specification(rows, params, length)
        what = (f"{sampler}: law of the first {length} tokens, {size} sequences, each row's distribution the "
                f"specification's; B: {oracle.N_SEEDS} seeds identical to plain decoding, power "
                f"{1 - (1 - oracle.TV_SPLIT) ** oracle.N_SEEDS:.4f} at TV {oracle.TV_SPLIT}, no false alarms")
    law = oracle.exact_law(rows, params, length)
    assert not any(t in engine.tokenizer.stop_ids for seq in law.sequences for t in seq)
    rows.release()  # the rows of the law are memoised; the engine has its target back
    drafted = []

    def run(seed: int) -> list[int]:
        out = [t for r in engine.stream(ids, max_tokens=length, temperature=params.temperature, top_p=params.top_p,
                                        top_k=params.top_k, seed=seed) for t in r.token_ids]
        drafted.append(engine.last_stats.drafted)
        return out

    oracle.check_path(f"real model, {sampler}", run, rows, len(ids), params, length)
    print(f"\n{what} [{time.perf_counter() - t0:.0f} s, {time.process_time() - cpu:.0f} s of CPU; "
          f"{sum(drafted)} tokens drafted in {oracle.N_SEEDS} runs]")
    assert sum(drafted) > 0, "the default engine drafted nothing"
