"""One timed greedy/sampled decoding run on given runtimes, and a peak-RSS sampler.

Configurations are compared by running them alternately in one process on the same
runtimes (see benchmarks/), so a busy neighbour slows all of them alike."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..decoding import FixedK, SamplingParams, SpeculativeDecoder
from ..memory.measure import PeakRSS  # re-exported: benchmarks sample peak RSS with it
from ..runtimes.base import Runtime
from .measure import measure_run

__all__ = ["RunResult", "PeakRSS", "timed_decode"]


@dataclass(frozen=True)
class RunResult:
    tokens: list[int]
    tok_s: float  # decode speed after the first token
    first_token_s: float
    steps: int
    drafted: int
    accepted: int
    draft_ms: float
    verify_ms: float

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return len(self.tokens) / self.steps if self.steps else 0.0


def timed_decode(target: Runtime, draft: Runtime | None, prompt: list[int], max_tokens: int, *, k: int = 4,
                 id_map: np.ndarray | None = None, policy=None, params: SamplingParams = SamplingParams(),
                 stop_ids=()) -> RunResult:
    """Decode from empty caches and time it (no stop ids by default: fixed-length runs)."""
    if draft is not None:
        policy = policy or FixedK(k)
    dec = SpeculativeDecoder(target, draft, id_map=id_map if draft is not None else None, policy=policy)
    rec = measure_run(dec, [rt for rt in (target, draft) if rt is not None], prompt, max_tokens, stop_ids,
                      params=params)
    return RunResult(rec.tokens, rec.tok_s, rec.ttft_s, rec.steps, rec.drafted, rec.accepted, rec.draft_ms,
                     rec.verify_ms)
