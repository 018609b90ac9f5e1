"""The speculative decoding loop: prefill, then draft → verify → accept → commit → rollback.

Invariant: each runtime's KV cache holds a prefix of `tokens` (the committed sequence) and
never all of it, so the last committed token is always fed again to obtain fresh logits.
Each cache is tracked with the target ids it holds (`TrackedCache`), so a later stream on an
extended sequence reuses the shared prefix instead of re-feeding it. A drafter (drafters.py)
owns its own caches; plain decoding (no drafter, or k == 0) runs through the same loop with
an empty draft.
"""
from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass

import numpy as np

from edgespec.decoding.acceptance import accept_coupled, accept_greedy
from edgespec.decoding.cache import TrackedCache, batch_limit, common_prefix
from edgespec.decoding.draft import Draft, Drafter
from edgespec.decoding.drafters import build_drafter
from edgespec.decoding.draws import Draws
from edgespec.decoding.grammar import Constraint, MaskedRows
from edgespec.decoding.limits import UNLIMITED, DecoderLimits
from edgespec.decoding.policy import DraftPolicy, FixedK
from edgespec.decoding.sampling import LazyDists, SamplingParams
from edgespec.decoding.tree import DraftTree, accept_tree_coupled, accept_tree_greedy
from edgespec.errors import ConfigError
from edgespec.runtimes.base import Runtime

__all__ = ["DEFAULT_K", "StepResult", "SpeculativeDecoder", "common_prefix", "sampling_regime", "truncate_commit"]

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # batch-variance reasons already reported

DEFAULT_K = 4
MAX_REGIMES = 8  # sampling settings whose policies a decoder keeps (a chat uses one, a server a few)


GREEDY_REGIME = ("greedy",)


def sampling_regime(params: SamplingParams, constrained: bool = False) -> tuple:
    """What a draft-length policy's estimates depend on in `params`: greedy, or the sampler's
    settings (the seed changes neither acceptance nor cost); and whether a grammar constrains the
    reply (masked drafts, forced tokens: another acceptance)."""
    regime = GREEDY_REGIME if params.greedy else ("sampled", params.temperature, params.top_p, params.top_k,
                                                  params.min_p)
    return (*regime, "grammar") if constrained else regime


@dataclass
class StepResult:
    """One decoding step; metrics travel with every step."""

    tokens: list[int]  # newly committed: accepted drafts, then the target's own token
    drafted: int
    accepted: int  # drafts the target accepted (a stop id may still cut the commit shorter)
    draft_ms: float
    verify_ms: float  # the target side: verify forward, acceptance and rollback
    source: str = ""  # which drafter proposed ("model", "ngram:3"; "" when nothing was drafted)
    tail: int = 0  # of the drafted tokens, how many a prompt lookup appended to the drafter's own
    forced: int = 0  # of `tokens`, how many a grammar forced (the first ones): committed without a forward


def truncate_commit(new: list[int], stop_ids: Container[int], budget: int) -> list[int]:
    """Cut a step's tokens at the budget and just after the first stop id (kept)."""
    new = new[:budget]
    for i, tok in enumerate(new):
        if tok in stop_ids:
            return new[: i + 1]
    return new


def _check_target(target: Runtime, drafter: Drafter | None, policy: DraftPolicy | None,
                  max_batch: int | None = None) -> None:
    """Reject a target that cannot verify, or a policy with nothing to steer, naming the fix."""
    if drafter is None:
        if policy is not None:
            raise ConfigError("a draft-length policy needs a draft model or a drafter; "
                              "pass draft= or drafter=, or drop policy")
        return
    if any(rt is target for rt in drafter.runtimes):
        raise ConfigError("draft and target must be separate runtimes (each owns its own KV cache)")
    caps = target.capabilities
    if not caps.can_trim:
        raise ConfigError(f"speculative decoding rolls back rejected drafts, but the target backend "
                          f"{caps.backend!r} cannot trim its KV cache; run without drafting")
    if drafter.trees and not caps.trees:
        raise ConfigError(f"this drafter drafts trees, but the target ({caps.backend}) "
                          "verifies chains only; export the bundle with --tree for onnxruntime")
    if batch_limit(target, max_batch) == 1:
        raise ConfigError("the target backend takes one token per forward, so it cannot verify drafts")
    variance = caps.batch_variance
    if variance and variance not in _warned:  # once per process: a chat builds decoders often
        _warned.add(variance)
        logger.warning("greedy output with drafting may differ from plain decoding on near-ties: %s", variance)


class SpeculativeDecoder:
    """Generate with a target model, optionally accelerated by a drafter.

    `drafter` is a name from DRAFTERS ("model", "ngram", "recycle", "both") or a Drafter; by default the
    draft model when one is given, else plain decoding. Greedy output is token-identical to
    plain greedy decoding of the target; sampled output is token-identical to plain sampled
    decoding with the same seed, which follows the target's distribution exactly (draws.py). The
    decoder assumes it is the only user of its runtimes' caches.
    """

    # a stream keeps only the cached rows whole prefill chunks computed (TrackedCache.align), so
    # its greedy output cannot depend on earlier streams; the server turns it on, a chat leaves
    # it off to reuse its whole conversation
    independent_requests = False

    def __init__(
        self,
        target: Runtime,
        draft: Runtime | None = None,
        *,
        id_map: np.ndarray | None = None,
        policy: DraftPolicy | None = None,
        drafter: str | Drafter | None = None,
        limits: DecoderLimits = UNLIMITED,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """limits: what the decoder is bounded by (DecoderLimits, validated when it was built: the
        context, drafts per step, the exact verify widths, prefill chunks, whether trees may be
        drafted). clock: seconds, read around each phase (the drafters and the cost policy learn
        from it; a replay passes a virtual one)."""
        if draft is not None and draft is target:
            raise ConfigError("draft and target must be separate runtimes (each owns its own KV cache)")
        if not isinstance(limits, DecoderLimits):
            raise ConfigError(f"limits must be a DecoderLimits, got {type(limits).__name__}")
        id_map = None if id_map is None else np.asarray(id_map, dtype=np.int64)
        trees = limits.trees and target.capabilities.trees
        self.drafter = build_drafter(drafter, target.vocab_size, draft, id_map, max_width=limits.draft_width,
                                     max_batch=limits.max_batch, clock=clock, trees=trees)
        _check_target(target, self.drafter, policy, limits.max_batch)
        self.target, self.draft, self.id_map = target, draft, id_map
        self.policy = policy if policy is not None else FixedK(DEFAULT_K if self.drafter is not None else 0)
        # Acceptance and step costs differ between greedy and sampled decoding (and between
        # temperatures): each sampling regime learns in a policy of its own, a copy of `policy`
        # as given. `policy` itself serves greedy decoding.
        self._fresh_policy = copy.deepcopy(self.policy)
        self._policies: OrderedDict[tuple, DraftPolicy] = OrderedDict({GREEDY_REGIME: self.policy})
        self._target = TrackedCache(target, limits.max_batch)
        self.clock = clock
        self.limits = limits
        self._told_reach = False  # whether the log said once that drafting stops at the probe's reach

    @property
    def context_limit(self) -> int | None:
        return self.limits.context_limit

    @property
    def max_batch(self) -> int | None:
        return self.limits.max_batch

    def stream(
        self,
        tokens: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        stop_ids: Container[int] = (),
        constraint: Constraint | None = None,
    ) -> Iterator[StepResult]:
        """Extend `tokens` in place, yielding one StepResult per decoding step.

        Ends after `max_new_tokens` tokens or right after a stop id (which is committed).
        Do not modify `tokens` while the stream runs; extending it between streams is fine.
        `constraint` (grammar.Constraint, fresh for this stream): the reply follows its grammar.
        """
        if max_new_tokens < 0:
            raise ConfigError(f"max-new-tokens must be >= 0, got {max_new_tokens}")
        if not tokens:
            raise ConfigError("the prompt must hold at least one token")
        return self._steps(tokens, params, max_new_tokens, stop_ids, constraint)

    def _steps(
        self, tokens: list[int], params: SamplingParams, max_new_tokens: int, stop_ids: Container[int],
        constraint: Constraint | None = None,
    ) -> Iterator[StepResult]:
        rng = Draws(params.seed)  # keyed by position: no step's draws move another's
        policy = self.policy_for(params, constrained=constraint is not None)
        n_new = 0
        try:
            self._prefill(tokens)
            while n_new < max_new_tokens:
                # 0. what a grammar forces needs no forward: committed now, fed with the next verify
                forced = constraint.force(max_new_tokens - n_new) if constraint is not None else []
                tokens.extend(forced)
                n_new += len(forced)
                if forced and (forced[-1] in stop_ids or n_new >= max_new_tokens):
                    yield StepResult(forced, 0, 0, 0.0, 0.0, forced=len(forced))
                    return
                if forced:
                    self._catch_up(tokens)
                budget = max_new_tokens - n_new
                # 1. draft
                t0 = self.clock()
                draft = self._propose(tokens, budget, params, rng, policy, constraint)
                t1 = self.clock()
                # 2-4. verify (one target forward scores every draft plus the bonus position),
                #      accept / resample, commit
                ratios: list[float] = []  # each tested draft's acceptance probability (sampled chains)
                if draft.tree is not None:
                    new, n_acc, trials, reused = self._tree_step(tokens, draft.tree, params, rng, budget, stop_ids,
                                                                 constraint)
                else:
                    pending = self._target.pending(tokens) + draft.tokens
                    logits = self._target.feed(pending, n_logits=len(draft.tokens) + 1)
                    new, n_acc, trials, reused = self._judge(draft, pending, logits, params, rng, budget, stop_ids,
                                                             ratios, constraint)
                if constraint is not None:
                    constraint.commit(new)
                tokens.extend(new)
                n_new += len(new)
                # 5. rollback: drop rejected drafts from every cache
                self._rollback(tokens)
                yield self._record(policy, draft, new, n_acc, (t0, t1, self.clock()), reused, ratios, trials, forced)
                if new[-1] in stop_ids:
                    return
        finally:
            # a consumer that stops the stream, or a failed forward, must leave no uncommitted tokens cached
            self._rollback(tokens)

    def _judge(self, draft: Draft, pending: list[int], logits: np.ndarray, params: SamplingParams,
               rng: Draws, budget: int, stop_ids: Container[int],
               ratios: list[float], constraint: Constraint | None = None) -> tuple[list[int], int, list, int]:
        """Phases 3-4 for a chain whose verify fed `pending` and returned `logits`: (committed ids,
        accepted drafts, the drafter's free trials, rows the verify reused)."""
        reused = self.target.reused_rows
        # what the target computed anyway, for a drafter that learns from it
        trials = self.drafter.observe(pending[len(pending) - len(logits):], logits) if self.drafter else []
        start = len(self._target.ids) - len(draft.tokens)  # the first draft's position: the verify fed them all
        n_acc, nxt = self._accept(draft, logits, params, rng, start, ratios, constraint)
        return truncate_commit(draft.tokens[:n_acc] + [nxt], stop_ids, budget), n_acc, trials, reused

    def _prefill(self, tokens: list[int]) -> None:
        """Phase 0: keep the target's common prefix with `tokens`, feed all but the last token (a
        model drafter catches up by itself the next time it drafts)."""
        self._target.align(tokens, new_request=self.independent_requests)
        self._rollback(tokens)
        self._target.feed(self._target.pending(tokens)[:-1], n_logits=1)

    def policy_for(self, params: SamplingParams, constrained: bool = False) -> DraftPolicy:
        """The draft-length policy that learns under `params`' sampling regime (sampling_regime):
        the given policy for greedy decoding, a fresh copy of it for each sampled setting and for
        each under a grammar."""
        key = sampling_regime(params, constrained)
        policy = self._policies.get(key)
        if policy is None:
            policy = self._policies[key] = copy.deepcopy(self._fresh_policy)
            while len(self._policies) > MAX_REGIMES:  # the oldest sampled setting; greedy's stays
                oldest = next(k for k in self._policies if k != GREEDY_REGIME)
                del self._policies[oldest]
        self._policies.move_to_end(key)
        return policy

    def _catch_up(self, tokens: list[int]) -> None:
        """Tokens a grammar forced wait, with the last committed one, to be fed with the next
        verify. Where that would make it wider than the exact verify width, feed all but the last
        one first, in forwards of at most that width."""
        width = self.limits.verify_width
        head = self._target.pending(tokens)[:-1]
        if width is None or len(head) < width:
            return
        for i in range(0, len(head), width):
            self._target.feed(head[i:i + width], n_logits=1)

    def _propose(self, tokens: list[int], budget: int, params: SamplingParams, rng: Draws,
                 policy: DraftPolicy, constraint: Constraint | None = None) -> Draft:
        """Phase 1: the drafter's proposal, capped so the commit fits the budget and the verify one
        batch; under a grammar, only what it allows (a tree's refused nodes are masked at the verify)."""
        limit = self._draft_limit(len(tokens), budget, len(self._target.pending(tokens)))
        if self.drafter is None or limit <= 0:
            return Draft([])
        if constraint is None:
            return self.drafter.propose(tokens, limit, policy, params, rng)
        if self.drafter.constrained:
            draft = self.drafter.propose(tokens, limit, policy, params, rng, constraint=constraint)
        else:
            draft = self.drafter.propose(tokens, limit, policy, params, rng)
        return draft if draft.tree is not None else constraint.fit(draft)

    def _draft_limit(self, n_tokens: int, budget: int, pending: int = 1) -> int:
        """Most tokens a step may draft after `n_tokens` committed ones with `budget` left to
        generate, the verify feeding `pending` committed ids before the drafts (the last one, and
        any a grammar forced); overlap.py sizes the drafts it makes ahead with it too."""
        limit = budget - 1  # verify always adds one token of its own
        if (cap := self._target.limit) is not None:
            limit = min(limit, cap - pending)
        lim = self.limits
        if lim.max_draft is not None:
            limit = min(limit, lim.max_draft)
        if lim.verify_width is not None:  # wider verifies would round unlike plain decoding here
            limit = min(limit, lim.verify_width - pending)
        if lim.context_limit is not None:  # the verify writes len(tokens) + drafts positions
            limit = min(limit, lim.context_limit - n_tokens)
        if lim.exact_reach is not None and limit > lim.exact_reach - n_tokens:  # past where the probe looked
            if not self._told_reach:
                self._told_reach = True
                logger.warning("drafting stops at %d tokens: the exactness probe checked verifies up to %d keys "
                               "here; from there on this sequence decodes plainly (--probe-context N probes "
                               "farther once, cached)", max(n_tokens, lim.exact_reach), lim.exact_reach)
            limit = lim.exact_reach - n_tokens
        return limit

    def _record(self, policy: DraftPolicy, draft: Draft, new: list[int], n_acc: int, times: tuple[float, float, float],
                reused: int, ratios: list[float], trials: list, forced: list[int] = ()) -> StepResult:
        """The finished step (`times`: its start, the draft's end, the step's end, in seconds), after
        the policy has learned from it and from the drafter's free trials; `forced`: what a grammar
        committed before the draft."""
        t0, t1, t2 = times
        step = StepResult([*forced, *new], len(draft.tokens), n_acc, (t1 - t0) * 1e3, (t2 - t1) * 1e3, draft.source,
                          draft.tail, len(forced))
        self._learn(policy, step, draft, reused, ratios)
        for source, drafted, accepted in trials:
            policy.learn(source, drafted, accepted)
        return step

    def _learn(self, policy: DraftPolicy, step: StepResult, draft: Draft, reused: int,
               ratios: list[float]) -> None:
        """Tell the policy the step's cost and each drafter's acceptance. A plain step whose row
        was computed ahead (a lookahead guess on a shared body) is no measure of a plain step; a
        tail was tested only if the draft before it was accepted whole. Under sampling the
        drafts' acceptance probabilities (`ratios`) stand for their coin flips: the same mean,
        without the flips' noise, which would otherwise stop a good draft on one unlucky step."""
        head = step.drafted - draft.tail
        verify_ms = None if reused and not step.drafted else step.verify_ms
        expected = sum(ratios[:head]) if ratios and head else None
        policy.update(head, min(step.accepted, head), step.draft_ms, verify_ms, source=draft.source,
                      ms_per_token=draft.ms_per_token, width=step.drafted + 1, expected=expected)
        if draft.tail and step.accepted >= head:
            policy.learn(draft.tail_source, draft.tail, step.accepted - head)

    def _tree_step(self, tokens: list[int], tree: DraftTree, params: SamplingParams, rng: Draws,
                   budget: int, stop_ids: Container[int],
                   constraint: Constraint | None = None) -> tuple[list[int], int, list, int]:
        """Phases 2-4 for a draft tree: one forward over root and nodes, a walk down one path,
        the cache keeping that path. Returns (committed ids, accepted drafts, free trials, reused rows)."""
        logits = self._target.feed_tree(self._target.pending(tokens), tree)
        reused = self.target.reused_rows
        judged = logits if constraint is None else constraint.masked_tree(tree, logits)
        if params.greedy:
            nodes, nxt = accept_tree_greedy(tree, judged)
        else:
            # only the rows on the walked path are built
            nodes, nxt = accept_tree_coupled(tree, LazyDists(judged, params), rng, len(tokens))
        # the table learns every row; the accepted path's last, so its context is what a later row
        # for the same token keeps (SuccessorTable.update: a later row wins)
        on_path = set(nodes)
        order = [i for i in range(1, tree.n + 1) if i not in on_path] + [0, *nodes]
        rows = [tokens[-1], *tree.tokens]
        trials = self.drafter.observe([rows[i] for i in order], logits[order]) if self.drafter else []
        self._target.keep_path(tree, nodes)
        new = truncate_commit([tree.tokens[n - 1] for n in nodes] + [nxt], stop_ids, budget)
        return new, len(nodes), trials, reused

    @staticmethod
    def _accept(draft: Draft, logits: np.ndarray, params: SamplingParams, rng: Draws, start: int,
                ratios: list[float], constraint: Constraint | None = None) -> tuple[int, int]:
        """Phase 3: how many drafts (the first at sequence position `start`) the target keeps, and
        its own next token; under sampling each tested draft's chance of being kept goes to `ratios`.
        Under a grammar each row is the target's masked by it (the constrained distribution), masked
        only when it is read."""
        if params.greedy:
            return accept_greedy(draft.tokens, logits) if constraint is None else \
                constraint.accept_greedy(draft.tokens, logits)
        # row i is built only if drafts 0..i-1 were accepted; deterministic drafts have no dists
        target = LazyDists(logits if constraint is None else MaskedRows(logits, constraint, draft.tokens), params)
        return accept_coupled(draft.tokens, target, rng, start, draft.dists, ratios)

    def _rollback(self, tokens: list[int]) -> None:
        """Trim every cache to its common prefix with `tokens` (keeping the last token unfed)."""
        self._target.align(tokens)
        if self.drafter is not None:
            self.drafter.sync(tokens)
