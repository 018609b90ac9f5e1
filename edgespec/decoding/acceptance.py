"""Accept/resample drafted tokens against the target, and map a trimmed draft vocabulary.

Pure functions: each takes arrays and returns numbers, so every rule is testable alone.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from edgespec.decoding.sampling import sample

__all__ = [
    "accept_greedy",
    "accept_point_masses",
    "accept_sampled",
    "scatter_to_target",
    "map_draft_ids",
    "point_masses",
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
    draft_probs: np.ndarray,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    draft_probs (k, V) and target_probs (k+1, V) are both in the TARGET vocabulary. Every
    committed token is then distributed exactly as if sampled from the target alone.
    Returns (n_accepted, next_token).
    """
    k = len(draft_tokens)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1:
        raise ValueError(
            f"need {k} draft rows and {k + 1} target rows, got {draft_probs.shape[0]} and {target_probs.shape[0]}"
        )
    for i, tok in enumerate(draft_tokens):
        p, q = target_probs[i, tok], draft_probs[i, tok]
        # accept with probability min(1, p/q), written without a division by q
        if rng.random() * q < p:
            continue
        residual = np.maximum(target_probs[i] - draft_probs[i], 0.0)
        # a zero residual only happens through rounding (p <= q everywhere): fall back to p
        row = residual if residual.sum() > 0 else target_probs[i]
        return i, sample(row, rng)
    return k, sample(target_probs[k], rng)


def accept_point_masses(
    draft_tokens: Sequence[int], target_probs: np.ndarray, rng: np.random.Generator
) -> tuple[int, int]:
    """`accept_sampled` for drafts proposed deterministically (prompt lookup).

    The draft distribution is a point mass q = one_hot(x), so the test accepts x with
    probability p(x) and the residual max(0, p − q) is p with x removed: still exactly lossless.
    Draws the same random numbers as `accept_sampled` given one-hot rows, without building them.
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} drafts, got {target_probs.shape[0]}")
    for i, tok in enumerate(draft_tokens):
        p = target_probs[i, tok]
        if rng.random() < p:
            continue
        residual = target_probs[i].copy()
        residual[tok] = 0.0
        # p(x) == 1 up to rounding leaves nothing else: fall back to p, as accept_sampled does
        return i, sample(residual if residual.sum() > 0 else target_probs[i], rng)
    return k, sample(target_probs[k], rng)


def point_masses(tokens: Sequence[int], vocab: int) -> np.ndarray:
    """One-hot rows (len(tokens), vocab): the draft distribution of deterministic proposals,
    for a draft whose other rows were sampled (`accept_sampled` then treats them as
    `accept_point_masses` would)."""
    rows = np.zeros((len(tokens), vocab), dtype=np.float64)
    rows[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)] = 1.0
    return rows


def scatter_to_target(draft_probs: np.ndarray, id_map: np.ndarray | None, target_vocab: int) -> np.ndarray:
    """Place a draft head's K probabilities `(..., K)` into zeros of the target vocabulary.

    id_map[j] is the target id of draft id j; None means identity, padding a smaller draft
    vocabulary with zeros.
    """
    draft_probs = np.asarray(draft_probs, dtype=np.float64)
    n_draft = draft_probs.shape[-1]
    out = np.zeros(draft_probs.shape[:-1] + (target_vocab,), dtype=np.float64)
    if id_map is None:
        if n_draft > target_vocab:
            raise ValueError(f"draft vocab {n_draft} exceeds target vocab {target_vocab}; pass an id_map")
        out[..., :n_draft] = draft_probs
    else:
        if len(id_map) != n_draft:
            raise ValueError(f"id_map has {len(id_map)} entries but the draft gives {n_draft} probabilities")
        out[..., id_map] = draft_probs
    return out


def map_draft_ids(ids: Sequence[int], id_map: np.ndarray | None) -> list[int]:
    """Draft ids → target ids (None is the identity)."""
    if id_map is None:
        return [int(i) for i in ids]
    return [int(id_map[i]) for i in ids]
