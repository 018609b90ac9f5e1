"""Accept drafted tokens against the target, and map a trimmed draft vocabulary.

Pure functions: each takes distributions (token_dist.py) or arrays and returns numbers, so every
rule is testable alone.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from edgespec.decoding.draws import Draws
from edgespec.decoding.token_dist import TokenDist

__all__ = [
    "accept_greedy",
    "accept_coupled",
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


def accept_coupled(
    draft_tokens: Sequence[int],
    target_dists: Sequence[TokenDist],
    draws: Draws,
    start: int,
    draft_dists: Sequence[TokenDist] | None = None,
    ratios: list[float] | None = None,
) -> tuple[int, int]:
    """Coupled speculative sampling (draws.py): draft i, at sequence position start + i, is kept
    exactly when it is the token the target draws there itself, against the noise the drafter
    raced too; the first that is not is replaced by the target's token, and after a whole draft
    the target draws the bonus token. Every committed token is the target's own draw at its
    position: exact whatever the drafts were, and the same text as plain decoding with the seed.

    target_dists (k+1) are read in order and only while drafts are kept (a lazy sequence builds
    only those). Returns (n_accepted, next_token). `ratios`, when given, receives an estimate of
    each tested draft's chance of being kept: p(x) for a deterministic draft (draft_dists None:
    exactly its chance), min(1, p(x)/q(x)) for a sampled one (rejection sampling's chance, close
    to the coupled one where q is near p), estimates without the outcome's noise.
    """
    k = len(draft_tokens)
    if len(target_dists) != k + 1 or (draft_dists is not None and len(draft_dists) != k):
        raise ValueError(f"need {k + 1} target rows and {k} draft rows for {k} drafts, got {len(target_dists)} "
                         f"and {None if draft_dists is None else len(draft_dists)}")
    for i, tok in enumerate(draft_tokens):
        p_row = target_dists[i]
        if ratios is not None:
            p = p_row.prob(tok)
            q = 1.0 if draft_dists is None else draft_dists[i].prob(tok)
            ratios.append(min(1.0, p / q) if q > 0 else 1.0)
        token = p_row.sample(draws.at(start + i))
        if token != tok:
            return i, token
    return k, target_dists[k].sample(draws.at(start + k))


def map_draft_ids(ids: Sequence[int], id_map: np.ndarray | None) -> list[int]:
    """Draft ids → target ids (None is the identity)."""
    if id_map is None:
        return [int(i) for i in ids]
    return [int(id_map[i]) for i in ids]
