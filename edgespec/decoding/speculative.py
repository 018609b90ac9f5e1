"""The speculative decoding loop: prefill, then draft → verify → accept → commit → rollback.

Invariant: each runtime's KV cache holds a prefix of `tokens` (the committed sequence) and
never all of it, so the last committed token is always fed again to obtain fresh logits.
The decoder tracks, per runtime, the target ids its cache holds (`_cached`), so a later
stream on an extended sequence reuses the shared prefix instead of re-feeding it.
Plain decoding (no draft, or k == 0) runs through the same loop with an empty draft phase.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from edgespec.decoding.acceptance import (
    accept_greedy,
    accept_sampled,
    invert_id_map,
    map_draft_ids,
    scatter_to_target,
)
from edgespec.decoding.policy import DraftPolicy, FixedK
from edgespec.decoding.sampling import SamplingParams, probabilities, sample
from edgespec.errors import ConfigError
from edgespec.runtimes.base import Runtime

__all__ = ["DEFAULT_K", "StepResult", "SpeculativeDecoder", "common_prefix", "truncate_commit"]

logger = logging.getLogger(__name__)

DEFAULT_K = 4


@dataclass
class StepResult:
    """One decoding step; metrics travel with every step."""

    tokens: list[int]  # newly committed: accepted drafts, then the target's own token
    drafted: int
    accepted: int  # drafts the target accepted (a stop id may still cut the commit shorter)
    draft_ms: float
    verify_ms: float


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def truncate_commit(new: list[int], stop_ids: Container[int], budget: int) -> list[int]:
    """Cut a step's tokens at the budget and just after the first stop id (kept)."""
    new = new[:budget]
    for i, tok in enumerate(new):
        if tok in stop_ids:
            return new[: i + 1]
    return new


def _batch_limit(rt: Runtime) -> int | None:
    caps = getattr(rt, "capabilities", None)
    return getattr(caps, "max_batch_tokens", None)


def _check_pair(target: Runtime, draft: Runtime | None, id_map: np.ndarray | None, policy) -> None:
    """Reject unusable target/draft/id_map/policy combinations, naming the fix."""
    if draft is None:
        if id_map is not None:
            raise ConfigError("id_map given without a draft model; pass draft= or drop id_map")
        if policy is not None:
            raise ConfigError("a draft-length policy needs a draft model; pass draft= or drop policy")
        return
    if draft is target:
        raise ConfigError("draft and target must be separate runtimes (each owns its own KV cache)")
    for role, rt in (("target", target), ("draft", draft)):
        caps = getattr(rt, "capabilities", None)
        if caps is not None and not caps.can_trim:
            raise ConfigError(f"speculative decoding rolls back rejected drafts, but the {role} backend "
                              f"{caps.backend!r} cannot trim its KV cache; run without a draft")
    if _batch_limit(target) == 1:
        raise ConfigError("the target backend takes one token per forward, so it cannot verify drafts")
    if id_map is None:
        if draft.vocab_size > target.vocab_size:
            raise ConfigError(f"draft vocab ({draft.vocab_size}) is larger than target vocab "
                              f"({target.vocab_size}); pass an id_map")
        return
    if id_map.ndim != 1 or len(id_map) != draft.vocab_size:
        raise ConfigError(f"id_map must list one target id per draft id ({draft.vocab_size}), got shape {id_map.shape}")
    if id_map.size and (id_map.min() < 0 or id_map.max() >= target.vocab_size):
        raise ConfigError(f"id_map holds ids outside the target vocab [0, {target.vocab_size})")
    if len(np.unique(id_map)) != len(id_map):
        raise ConfigError("id_map maps two draft ids to the same target id")


class SpeculativeDecoder:
    """Generate with a target model, optionally accelerated by a draft model.

    Greedy output is token-identical to plain greedy decoding of the target; sampled output
    follows the target's distribution exactly (rejection sampling). The decoder assumes it is
    the only user of its runtimes' caches.
    """

    def __init__(
        self,
        target: Runtime,
        draft: Runtime | None = None,
        *,
        id_map: np.ndarray | None = None,
        policy: DraftPolicy | None = None,
    ) -> None:
        id_map = None if id_map is None else np.asarray(id_map, dtype=np.int64)
        _check_pair(target, draft, id_map, policy)
        self.target, self.draft, self.id_map = target, draft, id_map
        self.policy = policy if policy is not None else FixedK(DEFAULT_K if draft is not None else 0)
        self._runtimes = [target] if draft is None else [target, draft]
        # target ids → ids the draft can be fed
        self._to_draft = None if draft is None else invert_id_map(id_map, target.vocab_size, draft.vocab_size)
        # per runtime (keyed by id: runtimes need not be hashable): the target ids its KV cache holds
        self._cached: dict[int, list[int]] = {id(rt): [] for rt in self._runtimes}

    def stream(
        self,
        tokens: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        stop_ids: Container[int] = (),
    ) -> Iterator[StepResult]:
        """Extend `tokens` in place, yielding one StepResult per decoding step.

        Ends after `max_new_tokens` tokens or right after a stop id (which is committed).
        Do not modify `tokens` while the stream runs; extending it between streams is fine.
        """
        if max_new_tokens < 0:
            raise ConfigError(f"max-new-tokens must be >= 0, got {max_new_tokens}")
        if not tokens:
            raise ConfigError("the prompt must hold at least one token")
        return self._steps(tokens, params, max_new_tokens, stop_ids)

    def _steps(
        self, tokens: list[int], params: SamplingParams, max_new_tokens: int, stop_ids: Container[int]
    ) -> Iterator[StepResult]:
        rng = np.random.default_rng(params.seed)
        n_new = 0
        try:
            # 0. prefill: keep each cache's common prefix with `tokens`, feed all but the last token
            for rt in self._runtimes:
                self._align(rt, tokens)
                self._feed(rt, tokens[len(self._cached[id(rt)]) : -1], n_logits=1)
            while n_new < max_new_tokens:
                budget = max_new_tokens - n_new
                # 1. draft
                t0 = time.perf_counter()
                drafts, draft_probs = self._draft(tokens, self._draft_len(budget), params, rng)
                t1 = time.perf_counter()
                # 2. verify: one target forward scores every draft plus the bonus position
                pending = tokens[len(self._cached[id(self.target)]) :] + drafts
                logits = self._feed(self.target, pending, n_logits=len(drafts) + 1)
                t2 = time.perf_counter()
                # 3. accept / resample
                if params.greedy:
                    n_acc, nxt = accept_greedy(drafts, logits)
                else:
                    n_acc, nxt = accept_sampled(drafts, draft_probs, probabilities(logits, params), rng)
                # 4. commit
                new = truncate_commit(drafts[:n_acc] + [nxt], stop_ids, budget)
                tokens.extend(new)
                n_new += len(new)
                # 5. rollback: drop rejected drafts from both caches
                for rt in self._runtimes:
                    self._align(rt, tokens)
                draft_ms, verify_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
                self.policy.update(len(drafts), n_acc, draft_ms, verify_ms)
                yield StepResult(new, len(drafts), n_acc, draft_ms, verify_ms)
                if new[-1] in stop_ids:
                    return
        finally:
            # a consumer that stops the stream, or a failed forward, must leave no uncommitted tokens cached
            for rt in self._runtimes:
                self._align(rt, tokens)

    def _draft_len(self, budget: int) -> int:
        """Draft length for this step: the policy's choice, capped so commits fit the budget."""
        if self.draft is None:
            return 0
        k = min(self.policy.next_k(), budget - 1)  # verify always adds one token of its own
        limit = _batch_limit(self.target)
        if limit is not None:
            k = min(k, limit - 1)  # the verify forward must fit one batch
        return max(k, 0)

    def _draft(
        self, tokens: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> tuple[list[int], np.ndarray | None]:
        """Phase 1: propose up to k target ids, one draft forward each.

        Returns the drafts and, when sampling, the draft's distributions scattered to the
        target vocabulary `(k, V_target)`.
        """
        drafts: list[int] = []
        rows: list[np.ndarray] = []
        pending = tokens[len(self._cached[id(self.draft)]) :] if k else []
        for _ in range(k):
            logits = self._feed(self.draft, pending, n_logits=1)[-1]  # (K,)
            if params.greedy:
                draft_id = int(np.argmax(logits))
            else:
                rows.append(probabilities(logits, params))
                draft_id = sample(rows[-1], rng)
            pending = map_draft_ids([draft_id], self.id_map)
            drafts.extend(pending)
        if not rows:
            return drafts, None
        return drafts, scatter_to_target(np.stack(rows), self.id_map, self.target.vocab_size)

    def _feed(self, rt: Runtime, target_ids: list[int], n_logits: int) -> np.ndarray | None:
        """Append target ids to `rt`'s cache (mapped for the draft), in chunks the backend accepts."""
        if not target_ids:
            return None
        ids = target_ids if rt is self.target else self._to_draft[np.asarray(target_ids)].tolist()
        cached = self._cached[id(rt)]
        limit = _batch_limit(rt) or len(ids)
        # every chunk but the last is prefill whose logits are discarded
        split = max(len(ids) - limit, 0)
        for start in range(0, split, limit):
            end = min(start + limit, split)
            rt.forward(ids[start:end], n_logits=1)
            cached.extend(target_ids[start:end])
        logits = rt.forward(ids[split:], n_logits=n_logits)
        cached.extend(target_ids[split:])
        return logits

    def _align(self, rt: Runtime, tokens: list[int]) -> None:
        """Trim `rt` to its common prefix with `tokens`, leaving at least the last token unfed."""
        cached = self._cached[id(rt)]
        if rt.n_past < len(cached):  # trimmed by someone else: a trim keeps a prefix
            del cached[rt.n_past :]
        elif rt.n_past > len(cached):  # a forward failed midway: contents unknown
            logger.debug("%s cache holds %d untracked positions; resetting it", type(rt).__name__, rt.n_past)
            rt.reset()
            cached.clear()
        keep = min(common_prefix(cached, tokens), len(tokens) - 1)
        if keep < len(cached):
            rt.trim(keep)
            del cached[keep:]
