"""Overlapped drafting (PEARL's post-verify): the draft model drafts on while the target verifies.

PEARL ("Parallel Speculative Decoding with Adaptive Draft Length") runs the target's verify of a
draft and the drafter's next draft at the same time. Here the verify forward runs in a worker
thread (onnxruntime, OpenVINO and llama.cpp release the GIL inside a forward) while the main
thread lets the draft model continue from the draft's end, one token further than a step
drafts: its first token is a guess of the verify's own next token. When the verify keeps the
whole draft, nothing cuts the commit (a stop id, the budget) and the target's token equals that
guess, the tokens drafted after it continue the committed sequence and are the next step's
draft, at no draft cost; otherwise they are dropped and the draft cache rolls back with the
rest.

Why this stays exact: the target verifies every draft, so greedy output is the target's own
whatever was drafted. Under sampling too: every committed token is the target's own draw at its
position (draws.py), so which drafts are kept changes only how many a verify commits. Keeping them
only where the guess came true is what makes them worth verifying: then they were drawn after the
committed sequence itself, each against its own position's noise, as a step would have drawn them.

It needs two runtimes that can compute at once, each with its own cache: a draft model on its
own body. A drafter on the target's body (runtimes/shared_body.py, the trained head) or with
no model (prompt lookup, Token Recycling: nearly free already) leaves nothing to overlap; the
decoder then runs the plain loop and says why once. Tree drafts verify without overlap.
"""
from __future__ import annotations

import logging
from collections.abc import Container, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from edgespec.decoding.draft import Draft, Drafter
from edgespec.decoding.drafters import ModelDrafter
from edgespec.decoding.draws import Draws
from edgespec.decoding.grammar import Constraint
from edgespec.decoding.policy import DraftPolicy
from edgespec.decoding.sampling import SamplingParams
from edgespec.decoding.speculative import SpeculativeDecoder, StepResult
from edgespec.runtimes.base import Runtime

__all__ = ["OverlapStats", "OverlappedDecoder", "ahead_drafter", "overlap_blocker", "kept_ahead"]

logger = logging.getLogger(__name__)
_told: set[str] = set()  # fallback reasons already logged in this process


@dataclass
class OverlapStats:
    """What the overlap did over a decoder's life: verifies run beside a draft, tokens drafted
    meanwhile (the guesses of the verify's own token included), and the drafts the next step used."""

    overlapped: int = 0  # verify forwards that ran while the draft model drafted on
    drafted_ahead: int = 0  # tokens the draft model drafted during those verifies
    steps_ahead: int = 0  # steps whose draft had been made during the previous verify
    used_ahead: int = 0  # drafts those steps took from the previous verify's time


def ahead_drafter(drafter: Drafter | None) -> ModelDrafter | None:
    """The draft model a drafter drafts with (itself, or the model part of a combined one)."""
    if isinstance(drafter, ModelDrafter):
        return drafter
    model = getattr(drafter, "model", None)
    return model if isinstance(model, ModelDrafter) else None


def overlap_blocker(drafter: Drafter | None) -> str | None:
    """Why drafting cannot overlap the verify with this drafter (None: it can)."""
    if drafter is None:
        return "no drafter: plain decoding has no draft to overlap"
    model = ahead_drafter(drafter)
    if model is None:
        return "the drafter has no draft model of its own (a lookup or a head costs no forward worth hiding)"
    if model.runtime.capabilities.extra.get("shared_body"):
        return "the draft runs on the target's body, which computes one forward at a time"
    return None


def kept_ahead(made: Draft, draft: Draft, new: list[int], stop_ids: Container[int]) -> Draft:
    """Of the tokens `made` during the verify of `draft` (its first a guess of the verify's own
    token), those that continue the committed sequence as the next step's draft: all of them after
    the guess when the step committed the whole draft and then the guess itself; else none."""
    if len(made.tokens) < 2 or new != [*draft.tokens, made.tokens[0]] or new[-1] in stop_ids:
        return Draft([])
    dists = None if made.dists is None else made.dists[1:]
    # no cost per token: their drafting ran inside the previous verify, whose time the policy
    # measured as that step's verify time, so counting it here would count it twice
    return Draft(made.tokens[1:], dists, made.source)


class _OneMore:
    """`policy` as the drafter reads it while a verify is in flight: one token more than the next
    step drafts, for the guess of the verify's own token (no draft, none: a plain step next)."""

    def __init__(self, policy: DraftPolicy) -> None:
        self._policy = policy

    def next_k(self, source: str = "model") -> int:
        k = self._policy.next_k(source)
        return k + 1 if k > 0 else 0

    def __getattr__(self, name: str):
        return getattr(self._policy, name)


class OverlappedDecoder(SpeculativeDecoder):
    """SpeculativeDecoder whose draft model drafts the next step while the target verifies
    (module docstring). Built with the same arguments; output is the plain loop's (greedy:
    token-identical; sampled: the target's distribution). Where the drafter cannot overlap
    (`blocker`), it runs the plain loop.

    Between steps of a stream the draft cache may also hold drafts made ahead for the next step;
    when the stream ends, every cache holds a prefix of the committed sequence as in the plain loop."""

    def __init__(self, target: Runtime, draft: Runtime | None = None, **kwargs) -> None:
        super().__init__(target, draft, **kwargs)
        self.blocker = overlap_blocker(self.drafter)
        self.overlap = OverlapStats()
        if self.blocker is not None and self.blocker not in _told:  # once per process: a chat builds decoders often
            _told.add(self.blocker)
            logger.warning("overlapped drafting off, decoding step by step: %s", self.blocker)

    def _steps(self, tokens: list[int], params: SamplingParams, max_new_tokens: int,
               stop_ids: Container[int], constraint: Constraint | None = None) -> Iterator[StepResult]:
        # a grammar's masks follow one path at a time: drafting ahead under one runs step by step
        if self.blocker is not None or constraint is not None:
            return (yield from super()._steps(tokens, params, max_new_tokens, stop_ids, constraint))
        rng = Draws(params.seed)
        policy = self.policy_for(params)
        n_new = 0
        ahead = Draft([])  # drafted during the previous verify, continuing the committed sequence
        # one thread runs the stream's verifies; each is waited for within its step
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-verify")
        try:
            self._prefill(tokens)
            while n_new < max_new_tokens:
                budget = max_new_tokens - n_new
                t0 = self.clock()
                draft = ahead if ahead.tokens else self._propose(tokens, budget, params, rng, policy)
                if ahead.tokens:
                    self.overlap.steps_ahead += 1
                    self.overlap.used_ahead += len(ahead.tokens)
                t1 = self.clock()
                ratios: list[float] = []
                if draft.tree is not None:
                    new, n_acc, trials, reused = self._tree_step(tokens, draft.tree, params, rng, budget, stop_ids)
                    ahead = Draft([])
                else:
                    new, n_acc, trials, reused, ahead = self._chain_step(tokens, draft, params, rng, budget,
                                                                         stop_ids, policy, ratios, pool)
                tokens.extend(new)
                n_new += len(new)
                self._target.align(tokens)
                self.drafter.sync(tokens + ahead.tokens)  # keeps the rows of the drafts made ahead
                yield self._record(policy, draft, new, n_acc, (t0, t1, self.clock()), reused, ratios, trials)
                if new[-1] in stop_ids:
                    return
        finally:
            pool.shutdown()
            # a consumer that stops the stream, or a failed forward, must leave no uncommitted tokens cached
            self._rollback(tokens)

    def _chain_step(self, tokens: list[int], draft: Draft, params: SamplingParams, rng: Draws,
                    budget: int, stop_ids: Container[int], policy: DraftPolicy,
                    ratios: list[float], pool: ThreadPoolExecutor) -> tuple[list[int], int, list, int, Draft]:
        """Phases 2-4 for a chain, the draft model drafting on while the verify runs on `pool`'s
        thread. Returns (committed ids, accepted drafts, free trials, reused rows, the next step's drafts)."""
        pending = self._target.pending(tokens) + draft.tokens
        made = Draft([])
        if draft.tokens:
            job = pool.submit(self._target.feed, pending, len(draft.tokens) + 1)
            try:
                made = self._draft_ahead(tokens, draft, budget, params, rng, policy)
            finally:
                wait([job])  # the target's cache is touched again only once its forward is done
            logits = job.result()  # its error, if it failed, raised on this thread
        else:  # a plain step: nothing drafted, nothing worth drafting on (the policy said so)
            logits = self._target.feed(pending, n_logits=1)
        new, n_acc, trials, reused = self._judge(draft, pending, logits, params, rng, budget, stop_ids, ratios)
        return new, n_acc, trials, reused, kept_ahead(made, draft, new, stop_ids)

    def _draft_ahead(self, tokens: list[int], draft: Draft, budget: int, params: SamplingParams,
                     rng: Draws, policy: DraftPolicy) -> Draft:
        """While the verify runs: the draft model's guess of the target's token after the whole
        draft, then the next step's draft after it, within that step's limits."""
        limit = self._draft_limit(len(tokens) + len(draft.tokens) + 1, budget - len(draft.tokens) - 1)
        if limit <= 0:
            return Draft([])
        model, extended = ahead_drafter(self.drafter), tokens + draft.tokens
        # as before any proposal, the cache holds a prefix of the sequence with its last id unfed:
        # a draft that ended on a lookahead guess has that guess's row (and stale ones) cached
        model.sync(extended)
        made = model.propose(extended, limit + 1, _OneMore(policy), params, rng)
        self.overlap.overlapped += 1
        self.overlap.drafted_ahead += len(made.tokens)
        return made
