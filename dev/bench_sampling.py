"""Hand-run micro-benchmark (not a maintained benchmark): the reference sampler vs the sparse one
on one random 262,144-wide float32 row, and a sampled acceptance step with k = 4 drafts.

    python dev/bench_sampling.py        # medians of 30 runs, ms
"""
from __future__ import annotations

import time

import numpy as np

from edgespec.decoding.acceptance import accept_coupled
from edgespec.decoding.draws import Draws
from edgespec.decoding.sampling import LazyDists, SamplingParams, distribution, probabilities, sample
from edgespec.decoding.token_dist import Candidates

V, K, RUNS = 262_144, 4, 30


def median_ms(fn) -> float:
    fn()  # warm-up
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def bench(row: np.ndarray, rows: np.ndarray, drafts: np.ndarray, params: SamplingParams) -> str:
    r, draws = np.random.default_rng(1), Draws(1)
    old = median_ms(lambda: sample(probabilities(row, params), r))
    new = median_ms(lambda: distribution(row, params).sample(draws.at(0)))

    def old_step():  # the reference path: float64 rows of the vocabulary for every draft and target row
        q = [Candidates.from_row(x) for x in probabilities(drafts, params)]
        toks = [qi.sample(draws.at(i)) for i, qi in enumerate(q)]
        accept_coupled(toks, [Candidates.from_row(x) for x in probabilities(rows, params)], draws, 0, q)

    def new_step():
        q = [distribution(d, params) for d in drafts]
        toks = [qi.sample(draws.at(i)) for i, qi in enumerate(q)]
        accept_coupled(toks, LazyDists(rows, params), draws, 0, q)

    return (f"T {params.temperature} top-p {params.top_p} top-k {params.top_k}: sample {old:.2f} -> {new:.2f} ms; "
            f"k={K} step (draft sampling + acceptance) {median_ms(old_step):.1f} -> {median_ms(new_step):.1f} ms")


def main() -> None:
    rng = np.random.default_rng(0)
    for scale in (1.0, 4.0):  # a flat row, and a peaked one (nearer a language model's)
        row = (rng.standard_normal(V) * scale).astype(np.float32)
        rows = (rng.standard_normal((K + 1, V)) * scale).astype(np.float32)
        drafts = (rows[:K] + rng.standard_normal((K, V)).astype(np.float32)).astype(np.float32)
        for params in (SamplingParams(0.7, 0.95, 40), SamplingParams(1.0), SamplingParams(0.7, 0.95, 0)):
            print(f"logit scale {scale}: {bench(row, rows, drafts, params)}")


if __name__ == "__main__":
    main()
