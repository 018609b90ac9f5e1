"""Accept/resample drafted tokens against the target, and map a trimmed draft vocabulary.

Pure functions: each takes distributions (token_dist.py) or arrays and returns numbers, so every
rule is testable alone.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from edgespec.decoding.token_dist import TokenDist

__all__ = [
    "accept_greedy",
    "accept_point_masses",
    "accept_sampled",
    "map_draft_ids",
]

logger = logging.getLogger(__name__)


def accept_greedy(draft_tokens: Sequence[int], target_logits: np.ndarray) -> tuple[int, int]:
    """Longest prefix of drafts equal to the target's argmax, and the target's next token.

    target_logits: (k+1, V); row i predicts the token after the i-th fed position, so row 0
    judges draft_tokens[0] and row k is the bonus position. The returned token is the
    correction at the first mismatch, or the bonus token when every draft was accepted.
    """
    k = len(draft_tokens)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of target logits for {k} drafts, got {target_logits.shape[0]}")
    best = np.argmax(target_logits, axis=-1)
    n = 0
    while n < k and int(draft_tokens[n]) == int(best[n]):
        n += 1
    return n, int(best[n])


def accept_sampled(
    draft_tokens: Sequence[int],
    draft_dists: Sequence[TokenDist],
    target_dists: Sequence[TokenDist],
    rng: np.random.Generator,
    ratios: list[float] | None = None,
) -> tuple[int, int]:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    draft_dists (k) and target_dists (k+1) are distributions over TARGET ids (a trimmed draft's
    through its id map; a point mass for a deterministic proposal). Draft i is accepted with
    probability min(1, p(x)/q(x)); at the first rejection the token is drawn from max(0, p - q)
    renormalised, computed on p's support (token_dist.py), never on a full-vocabulary row. Every
    committed token is then distributed exactly as if sampled from the target alone. Target
    rows are read in order and only while drafts are accepted (a lazy sequence builds only those).
    Returns (n_accepted, next_token). `ratios`, when given, receives min(1, p/q) of each draft
    tested: the probability it had of being accepted, whose mean over drafts from q is the
    acceptance rate sum(min(p, q)), an estimate without the coin flip's noise.
    """
    k = len(draft_tokens)
    if len(draft_dists) != k or len(target_dists) != k + 1:
        raise ValueError(f"need {k} draft rows and {k + 1} target rows, got {len(draft_dists)} and {len(target_dists)}")
    for i, tok in enumerate(draft_tokens):
        p_row = target_dists[i]
        p, q = p_row.prob(tok), draft_dists[i].prob(tok)
        if ratios is not None:
            ratios.append(min(1.0, p / q) if q > 0 else 1.0)
        # accept with probability min(1, p/q), written without a division by q
        if rng.random() * q < p:
            continue
        # a residual without mass only happens through rounding (p <= q everywhere): fall back to p
        residual = p_row.minus(draft_dists[i])
        return i, (residual if residual is not None else p_row).sample(rng)
    return k, target_dists[k].sample(rng)


def accept_point_masses(
    draft_tokens: Sequence[int], target_dists: Sequence[TokenDist], rng: np.random.Generator,
    ratios: list[float] | None = None,
) -> tuple[int, int]:
    """`accept_sampled` for drafts proposed deterministically (prompt lookup).

    The draft distribution is a point mass q = one_hot(x), so the test accepts x with
    probability p(x) and the residual max(0, p − q) is p with x removed: still exactly lossless.
    Draws the same random numbers as `accept_sampled` given point masses, without building them;
    `ratios` receives p(x) of each draft tested, as there.
    """
    k = len(draft_tokens)
    if len(target_dists) != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} drafts, got {len(target_dists)}")
    for i, tok in enumerate(draft_tokens):
        p_row = target_dists[i]
        p = p_row.prob(tok)
        if ratios is not None:
            ratios.append(min(1.0, p))
        if rng.random() < p:
            continue
        residual = p_row.without([tok])
        # p(x) == 1 up to rounding leaves nothing else: fall back to p, as accept_sampled does
        return i, (residual if residual is not None else p_row).sample(rng)
    return k, target_dists[k].sample(rng)


def map_draft_ids(ids: Sequence[int], id_map: np.ndarray | None) -> list[int]:
    """Draft ids → target ids (None is the identity)."""
    if id_map is None:
        return [int(i) for i in ids]
    return [int(id_map[i]) for i in ids]
