"""The arithmetic of the draft-length policies (policy.py), as pure functions: each rule is
testable on synthetic numbers alone."""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

__all__ = ["best_k", "best_tail", "confidence_stop", "decayed_counts", "expected_tokens", "heuristic_k",
           "isotonic", "step_rate", "verify_table"]


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one step commits on average when each of k drafts is accepted with probability
    alpha (until the first rejection), counting the target's own token: (1 − α^(k+1)) / (1 − α)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def step_rate(alpha: float, k: int, draft_ms_per_token: float, verify_ms: Sequence[float]) -> float:
    """Expected tokens per millisecond of a step drafting k tokens (verify_ms as in `best_k`)."""
    return expected_tokens(alpha, k) / (k * draft_ms_per_token + verify_ms[k])


def best_k(alpha: float, draft_ms_per_token: float, verify_ms: Sequence[float]) -> int:
    """The draft length maximising expected tokens per millisecond.

    verify_ms[i] is the target-side cost of a step that verifies i + 1 tokens (i drafts plus
    the bonus position), so k ranges over [0, len(verify_ms) - 1]. Ties go to the shorter draft.
    """
    rates = [step_rate(alpha, k, draft_ms_per_token, verify_ms) for k in range(len(verify_ms))]
    return max(range(len(rates)), key=lambda k: (rates[k], -k))


def best_tail(head_alpha: float, head_k: int, head_ms_per_token: float, tail_alpha: float,
              verify_ms: Sequence[float]) -> int:
    """How many free tokens to append after a draft of `head_k` tokens, maximising expected
    tokens per millisecond of the whole step.

    A tail (a prompt-lookup continuation of the draft's end) costs no drafting, only the wider
    verify; it is tested only when the whole head was accepted (probability head_alpha^head_k),
    and then stands where the bonus token would. verify_ms as in `best_k`; the tail ranges over
    [0, len(verify_ms) - 1 - head_k]. With head_k = 0 this is `best_k` of a free drafter.
    """
    head = expected_tokens(head_alpha, head_k)
    reach = head_alpha ** head_k
    cost = head_k * head_ms_per_token
    rates = [(head + reach * (expected_tokens(tail_alpha, t) - 1.0)) / (cost + verify_ms[head_k + t])
             for t in range(len(verify_ms) - head_k)]
    return max(range(len(rates)), key=lambda t: (rates[t], -t))


def verify_table(measured: dict[int, float], max_width: int, slope: float) -> list[float]:
    """Target-side cost of widths 1..max_width from the widths measured so far.

    The measured costs are first made non-decreasing in width by pooling neighbours that
    disagree (isotonic regression), so neither a noisy cheap sample at a wide verify nor a noisy
    dear one at a narrow verify steers the plan alone. Between measured widths: linear
    interpolation. Beyond them: the prior that each extra verified token costs `slope` times a
    one-token step.
    """
    if not measured:
        raise ValueError("need at least one measured width")
    widths = sorted(measured)
    measured = dict(zip(widths, isotonic([measured[w] for w in widths])))
    out: list[float] = []
    for w in range(1, max_width + 1):
        # the nearest measured widths at or below and at or above w (bisect: this runs every step)
        below, above = bisect.bisect_right(widths, w), bisect.bisect_left(widths, w)
        lo = widths[below - 1] if below else None
        hi = widths[above] if above < len(widths) else None
        if lo is not None and hi is not None:
            est = measured[lo] if lo == hi else measured[lo] + (measured[hi] - measured[lo]) * (w - lo) / (hi - lo)
        else:
            near = lo if lo is not None else hi
            # the one-token cost: measured, or what the prior implies
            unit = measured[1] if 1 in measured else measured[near] / (1.0 + slope * (near - 1))
            est = measured[near] + slope * unit * (w - near)
        out.append(max(est, out[-1]) if out else est)
    return out


def heuristic_k(k: int, drafted: int, accepted: int, k_min: int, k_max: int) -> int:
    """+2 after a fully accepted draft, −1 otherwise (transformers' "heuristic" schedule)."""
    if drafted == 0:
        return k
    return min(k + 2, k_max) if accepted == drafted else max(k - 1, k_min)


def confidence_stop(confidences: Sequence[float], min_joint: float) -> bool:
    """Training-free SpecDec++ stop (arXiv 2405.19715): the product of the draft's top
    probabilities stands in for P(every drafted token is accepted); stop once it drops below
    `min_joint`, i.e. once a rejection somewhere in the draft has become likely."""
    return min_joint > 0 and math.prod(confidences) < min_joint


def decayed_counts(hits: float, trials: float, drafted: int, accepted: int, decay: float,
                   expected: float | None = None) -> tuple[float, float]:
    """Exponentially forgetting acceptance counts; hits / trials estimates alpha.

    A draft is tested token by token until its first rejection, so one step contributes
    `accepted` successes and one failure when the draft was not accepted in full: that many
    trials. `expected` (the tested tokens' acceptance probabilities, summed) counts as their
    successes instead, where the sampler knows them: the same mean, less noise.
    """
    tested = accepted + (1 if accepted < drafted else 0)
    return decay * hits + (accepted if expected is None else expected), decay * trials + tested


def isotonic(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]
