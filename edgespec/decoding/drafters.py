"""Drafters: who proposes the tokens the target then verifies in one forward.

  ModelDrafter   a small draft model, one forward per drafted token, with its own KV cache
  NgramDrafter   prompt lookup: copy what followed the latest earlier occurrence of the
                 sequence's last n tokens (llama.cpp `lookup`, transformers
                 `prompt_lookup_num_tokens`); no model, nearly free, strong on replies that
                 quote their input (summaries, rewrites, extraction, code edits)
  BothDrafter    prompt lookup when it finds a match the policy rates above the model, else
                 the model, whose draft the lookup then extends ("tail") for the cost of a
                 wider verify, and whose forwards also feed the lookup's guesses ("lookahead")
  RecyclingDrafter  Token Recycling (recycling.py): chains of the successors the target itself
                 ranked first after each token in earlier verifies; no model, nearly free
  HeadDrafter    a trained draft head (head_drafter.py) on the target's hidden rows: a drafted
                 token costs a small head, not a body forward (`edgespec distill`)

Drafts are target ids. A drafter that samples returns its distributions over target ids (a
trimmed head's through its id map, never scattered to the target vocabulary); deterministic
proposals (a lookup, an argmax draft) return none and are accepted as point masses, which keeps
sampling exactly lossless. A tail is deterministic too: after a sampled draft its rows are point
masses.

Why tails and lookahead: on a CPU each extra token in a forward costs a small part of a
one-token forward (docs/speculative-decoding.md), while each model-drafted token costs a forward
of the draft. What prompt lookup predicts
after the model's latest draft turns that spare width into tokens whenever the reply repeats
its context: verified as a tail, or fed along with a draft forward, so that a draft token the
lookup guessed needs no forward of its own.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edgespec.checks import integer
from edgespec.decoding.acceptance import map_draft_ids
from edgespec.decoding.cache import TrackedCache
from edgespec.decoding.context_vocab import ContextVocab, Extension
from edgespec.decoding.draft import Draft, Drafter
from edgespec.decoding.draws import Draws
from edgespec.decoding.grammar import Constraint
from edgespec.decoding.head_drafter import HeadDrafter, draft_distribution, draft_index
from edgespec.decoding.policy import DraftPolicy
from edgespec.decoding.recycling import RecyclingDrafter
from edgespec.decoding.sampling import top_probability
from edgespec.decoding.sources import lookup_source
from edgespec.decoding.token_dist import TokenDist, point_mass
from edgespec.errors import ConfigError
from edgespec.runtimes.base import Runtime

__all__ = [
    "DRAFTERS", "BothDrafter", "Draft", "Drafter", "DrafterKind", "DrafterLimits", "ModelDrafter", "NgramDrafter",
    "NgramIndex", "build_drafter", "lookup_source",
]

logger = logging.getLogger(__name__)

# tokens of prompt lookup a model drafter feeds after each draft (its lookahead): each costs a few
# percent of a one-token forward, each right one saves a whole forward
GUESSES = 3


# ---------------------------------------------------------------- draft model


def check_draft_model(draft: Runtime, target_vocab: int, id_map: np.ndarray | None) -> None:
    """Reject a draft runtime / id_map the decoder cannot use, naming the fix."""
    caps = draft.capabilities
    if not caps.can_trim:
        raise ConfigError(f"speculative decoding rolls back rejected drafts, but the draft backend "
                          f"{caps.backend!r} cannot trim its KV cache; run without a draft")
    if id_map is None:
        if draft.vocab_size > target_vocab:
            raise ConfigError(f"draft vocab ({draft.vocab_size}) is larger than target vocab ({target_vocab}); "
                              "pass an id_map")
        return
    if id_map.ndim != 1 or len(id_map) != draft.vocab_size:
        raise ConfigError(f"id_map must list one target id per draft id ({draft.vocab_size}), got shape {id_map.shape}")
    if id_map.size and (id_map.min() < 0 or id_map.max() >= target_vocab):
        raise ConfigError(f"id_map holds ids outside the target vocab [0, {target_vocab})")
    if len(np.unique(id_map)) != len(id_map):
        raise ConfigError("id_map maps two draft ids to the same target id")


class ModelDrafter(Drafter):
    """A draft model whose cache catches up lazily: only when it drafts does it feed what it lacks.

    `guess(tokens, drafts)`, when given, proposes what follows the draft so far (prompt lookup);
    each draft forward also feeds those guesses, for the cost of a wider forward, and every guess
    the draft then draws itself comes with its next row already computed: no forward of its own.
    """

    source = "model"
    constrained = True

    def __init__(self, runtime: Runtime, target_vocab: int, id_map: np.ndarray | None = None,
                 guess: Callable[[list[int], list[int]], list[int]] | None = None,
                 max_width: int | None = None, max_batch: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """max_width: the widest forward to run with lookahead guesses (None: the runtime's limit);
        a draft on the target's body keeps to the widths that are exact there. max_batch: most
        tokens per forward, below the runtime's own limit (a memory plan's prefill chunk). clock:
        seconds, read to measure the marginal cost of a drafted token."""
        id_map = None if id_map is None else np.asarray(id_map, dtype=np.int64)
        check_draft_model(runtime, target_vocab, id_map)
        self.runtime, self.target_vocab, self.id_map, self.guess = runtime, target_vocab, id_map, guess
        self.max_width = max_width
        self.clock = clock
        self.runtimes = (runtime,)
        # a trimmed draft keeps the full input embedding: it is fed target ids, and only its
        # outputs (K logits) need the id map. A draft on the target's body runs only its head over
        # rows the body holds already, so it catches up in one forward: fed in prefill chunks, each
        # chunk would ask for a hidden row the body no longer keeps, and the body would run the
        # whole prefix again (a long prompt's prefill, inside a decode step)
        shared = runtime.capabilities.extra.get("shared_body") == "draft"
        self._cache = TrackedCache(runtime, None if shared else max_batch)
        # lookahead tokens fed, the forwards that fed any, and the guesses the draft then drew
        self.guessed = self.guess_forwards = self.guess_hits = 0
        # a trimmed head on the target's body also scores the context's tokens it lacks
        rows = getattr(runtime, "vocab_rows", None)
        self._context = (ContextVocab(self.id_map, target_vocab, rows, lambda: self._index)
                         if rows is not None and self.id_map is not None else None)

    def propose(self, tokens, limit, policy, params, rng, constraint: Constraint | None = None) -> Draft:
        k = min(policy.next_k(self.source), limit)
        if k <= 0:
            return Draft([])
        drafts: list[int] = []
        dists: list[TokenDist] = []
        confidences: list[float] = []
        steady: list[float] = []
        ahead: list[tuple[int, np.ndarray]] = []  # guesses fed past the last draft, with the logits after each
        pending = self._cache.pending(tokens)  # fed next; empty when the last draft was a guess already fed
        ext = self._context.update(tokens) if self._context is not None else None
        # how many lookahead guesses a forward may feed: each costs a wider forward, each one drawn
        # saves one (likely under greedy decoding, rarer the flatter the sampler)
        n_guess = policy.lookahead(self.source, GUESSES) if self.guess is not None else 0
        before = self.guess_forwards, self.guess_hits
        for _ in range(k):
            t0 = self.clock()
            computed = 0  # catch-up rows this iteration's forward computed (a guess hit needs none)
            if pending:
                ahead = self._feed(tokens, drafts, pending, len(ahead), ext, n_guess)
                computed = len(pending) - min(self.runtime.reused_rows, len(pending))
            # a sampled token is raced on its position's noise (draws.py)
            drawn = self._draw(ahead.pop(0)[1], drafts, params, (rng, len(tokens) + len(drafts)), ext,
                               constraint, dists)
            if drawn is None:  # a grammar allows none of the draft's tokens here
                break
            new, logits = [drawn[0]], drawn[1]
            if policy.uses_confidence:
                confidences.append(top_probability(logits))
            # a long catch-up is not the cost of one more token; one the runtime held already
            # (a draft on the target's body, after a lookup step) costs what a draft forward does
            if computed <= 2:
                steady.append(self.clock() - t0)
            drafts.extend(new)
            pending = [] if ahead and ahead[0][0] == new[0] else new
            self.guess_hits += not pending
            if confidences and not policy.keep_drafting(confidences):
                break
        return self._drafted(drafts, dists, steady, policy, before)

    def _draw(self, logits: np.ndarray, drafts: list[int], params, at: tuple[Draws, int], ext: Extension | None,
              constraint: Constraint | None, dists: list[TokenDist]) -> tuple[int, np.ndarray] | None:
        """One drafted token (a target id) from a draft row, and the row it was drawn from: the
        argmax, or a draw from the sampler's distribution (appended to `dists`); under a grammar,
        from the row masked by it (None: it allows none of the row's tokens). `at`: the stream's
        draws and the token's sequence position, whose noise a sampled draft races on."""
        id_map = self.id_map if ext is None else ext.id_map
        if constraint is not None:
            logits = constraint.masked(logits, drafts, id_map)
            if logits is None:
                return None
        if params.greedy:
            return map_draft_ids([int(np.argmax(logits))], id_map)[0], logits
        index = (lambda: self._index) if ext is None else (lambda: ext.index)
        dists.append(draft_distribution(logits, params, id_map, index))
        rng, position = at
        return dists[-1].sample(rng.at(position)), logits

    def _drafted(self, drafts: list[int], dists: list[TokenDist], steady: list[float], policy: DraftPolicy,
                 before: tuple[int, int]) -> Draft:
        """The draft, its marginal cost per token, and what the lookahead's guesses earned (told
        to the policy): `before` holds the guess counters when the draft began."""
        forwards, hits = before
        if self.guess_forwards > forwards:
            policy.learn_lookahead(self.source, self.guess_forwards - forwards, self.guess_hits - hits)
        if not drafts:
            return Draft([])
        return Draft(drafts, dists or None, self.source, 1e3 * sum(steady) / len(steady) if steady else None)

    @cached_property
    def _index(self) -> np.ndarray:
        """Target id -> draft id: built once, and only for a dense (pure temperature) trimmed row."""
        return draft_index(self.id_map, self.target_vocab)

    def _feed(self, tokens: list[int], drafts: list[int], pending: list[int], stale: int,
              ext: Extension | None = None, n_guess: int = GUESSES) -> list[tuple[int, np.ndarray]]:
        """Drop the rows of `stale` guesses the draft did not draw, feed `pending` and new guesses;
        (fed id, logits after it) for the last pending id and each guess, widened by `ext`'s
        tokens when given (their scores from the hidden rows the forward just computed)."""
        if stale:
            self._cache.trim(len(self._cache.ids) - stale)
        guesses = self.guess(tokens, drafts)[:n_guess] if n_guess and len(pending) <= 2 else []
        # guesses are extra: they must fit the forward and the cache, never make either fail
        for cap in (self._cache.limit, self.max_width):
            if cap is not None:
                guesses = guesses[:max(cap - len(pending), 0)]
        if (capacity := self.runtime.kv_capacity) is not None:
            guesses = guesses[:max(capacity - len(self._cache.ids) - len(pending), 0)]
        out = self._cache.feed(pending + guesses, n_logits=1 + len(guesses))
        self.guessed += len(guesses)
        self.guess_forwards += bool(guesses)
        if ext is not None:  # only a runtime with vocab_rows builds an extension: it has last_hidden too
            out = ext.logits(out, self.runtime.last_hidden)
        # the rows are a view valid until the next forward: keep copies
        return [(t, np.array(row)) for t, row in zip([pending[-1], *guesses], out)]

    def sync(self, tokens: list[int]) -> None:
        self._cache.align(tokens)


# ---------------------------------------------------------------- prompt lookup


class NgramIndex:
    """For each n-gram (min_n <= n <= max_n) of a growing sequence, the position just after its
    latest occurrence that already has a continuation. O(max_n) dict updates per new token."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._seq: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}

    def update(self, tokens: list[int]) -> None:
        n = len(self._seq)
        if len(tokens) < n or tokens[:n] != self._seq:  # another sequence (a new conversation): start over
            self._seq, self._after, n = [], {}, 0
        for t in range(max(n, 1), len(tokens)):
            for size in range(self.min_n, min(self.max_n, t) + 1):
                self._after[tuple(tokens[t - size : t])] = t
        self._seq.extend(tokens[n:])

    def lookup(self, tokens: list[int], limit: int, extra: list[int] | None = None) -> tuple[list[int], int]:
        """Up to `limit` tokens that followed the longest matching suffix n-gram, and that n.
        `extra` (uncommitted drafts) continues `tokens` for the suffix but is not indexed."""
        self.update(tokens)
        seq = tokens + extra if extra else tokens
        end = len(seq)
        for size in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._after.get(tuple(seq[end - size :]))
            if start is not None:
                return overlapping_copy(seq, start, limit), size
        return [], 0


def overlapping_copy(tokens: list[int], start: int, n: int) -> list[int]:
    """tokens[start:start + n], continued past the end by copying the copy (LZ77-style), so a
    repeating cycle shorter than n is proposed n tokens deep."""
    out: list[int] = []
    for i in range(n):
        j = start + i
        out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
    return out


class NgramDrafter(Drafter):
    """Prompt lookup over the prompt and everything generated so far. Proposals are keyed by
    match length ("ngram:3"), so adaptive policies learn how far each kind of match carries."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, clock: Callable[[], float] = time.perf_counter) -> None:
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            integer(v, name, least=1)
        if min_ngram > max_ngram:
            raise ConfigError(f"min_ngram ({min_ngram}) exceeds max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.clock = clock
        self._index = NgramIndex(min_ngram, max_ngram)

    def propose(self, tokens, limit, policy, params, rng) -> Draft:
        t0 = self.clock()
        found, source = self.candidate(tokens, limit)
        return self.take(found, source, policy, t0)

    def take(self, found: list[int], source: str, policy: DraftPolicy, t0: float) -> Draft:
        """The draft of as much of a `candidate` as the policy wants (a lookup begun at `t0`)."""
        k = min(policy.next_k(source), len(found)) if found else 0
        if k <= 0:
            return Draft([])
        return Draft(found[:k], None, source, 1e3 * (self.clock() - t0) / k)

    def guess(self, tokens: list[int], drafts: list[int]) -> list[int]:
        """What the lookup predicts after `drafts` (uncommitted, continuing `tokens`): a model
        drafter's lookahead."""
        return self._index.lookup(tokens, GUESSES, drafts)[0]

    def candidate(self, tokens: list[int], limit: int) -> tuple[list[int], str]:
        """What a lookup finds (up to `limit` tokens) and its policy key, before the policy's say."""
        found, n = self._index.lookup(tokens, limit)
        return found, lookup_source(n)

    def extend(self, tokens: list[int], draft: Draft, limit: int, policy: DraftPolicy, vocab: int) -> Draft:
        """`draft` with the lookup's continuation of its last tokens appended as its tail, as
        long as `policy.next_tail` finds worth verifying (at most `limit` tokens in all)."""
        room = limit - len(draft.tokens)
        if room <= 0 or not draft.tokens:
            return draft
        found, n = self._index.lookup(tokens, room, draft.tokens)
        source = lookup_source(n)
        tail = found[:policy.next_tail(source, draft.source, len(draft.tokens))] if found else []
        if not tail:
            return draft
        dists = None if draft.dists is None else draft.dists + [point_mass(t) for t in tail]
        return Draft(draft.tokens + tail, dists, draft.source, draft.ms_per_token, len(tail), source)


class BothDrafter(Drafter):
    """Prompt lookup when it finds a match the policy wants to draft from (and prefers to the
    drafters after it), else Token Recycling's chain (when given, and preferred to the model),
    else the draft model (when given), whose draft the lookup then extends with a tail."""

    constrained = True  # masks its model's drafts; cuts the lookup's and recycling's before choosing

    def __init__(self, lookup: NgramDrafter, model: ModelDrafter | None = None,
                 recycle: RecyclingDrafter | None = None) -> None:
        if model is None and recycle is None:
            raise ConfigError("a combined drafter needs a draft model or Token Recycling after prompt lookup")
        self.lookup, self.model, self.recycle = lookup, model, recycle
        self.runtimes = model.runtimes if model is not None else ()
        self.trees = recycle is not None and recycle.trees  # its recycled drafts may be trees

    def propose(self, tokens, limit, policy, params, rng, constraint: Constraint | None = None) -> Draft:
        t0 = self.lookup.clock()
        found, source = self.lookup.candidate(tokens, limit)
        if constraint is not None:
            found = found[:constraint.valid_prefix(found)]
        rivals = [d.source for d in (self.recycle, self.model) if d is not None]
        if found and all(policy.prefers(source, rival) for rival in rivals):
            draft = self.lookup.take(found, source, policy, t0)
            if draft.tokens:
                return draft
        if self.recycle is not None and (self.model is None or policy.prefers(self.recycle.source, self.model.source)):
            draft = _fit(self.recycle.propose(tokens, limit, policy, params, rng), constraint)
            if draft.tokens:
                return draft
        if self.model is None:  # recycling found nothing: the lookup's match, if the policy wants it
            return self.lookup.take(found, source, policy, t0) if found else Draft([])
        draft = self.model.propose(tokens, limit, policy, params, rng, constraint)
        return _fit(self.lookup.extend(tokens, draft, limit, policy, self.model.target_vocab), constraint)

    def sync(self, tokens: list[int]) -> None:
        if self.model is not None:
            self.model.sync(tokens)

    def forget(self) -> None:
        if self.recycle is not None:
            self.recycle.forget()

    def observe(self, tokens: list[int], logits: np.ndarray) -> list[tuple[str, int, int]]:
        return self.recycle.observe(tokens, logits) if self.recycle is not None else []


def _fit(draft: Draft, constraint: Constraint | None) -> Draft:
    """A chain cut where a grammar refuses it (grammar.Constraint.fit); trees are masked at the verify."""
    return draft if constraint is None or draft.tree is not None else constraint.fit(draft)


# ---------------------------------------------------------------- registry


@dataclass(frozen=True)
class DrafterLimits:
    """What a built drafter is bounded by and reads its time from (see ModelDrafter)."""

    max_width: int | None = None  # a model drafter's widest forward, lookahead guesses included
    max_batch: int | None = None  # most tokens per forward, below the runtime's own limit
    clock: Callable[[], float] = time.perf_counter
    trees: bool = False  # the target verifies draft trees in one forward (Capabilities.trees)


@dataclass(frozen=True)
class DrafterKind:
    """A registered drafter: whether it needs a draft model, and how to build it."""

    needs_model: bool
    # (target_vocab, draft, id_map, limits)
    build: Callable[[int, Runtime | None, np.ndarray | None, DrafterLimits], Drafter]
    help: str


DRAFTERS: dict[str, DrafterKind] = {
    "model": DrafterKind(True, lambda v, d, m, lim: ModelDrafter(d, v, m, max_width=lim.max_width,
                                                                 max_batch=lim.max_batch, clock=lim.clock),
                         "the draft model"),
    "ngram": DrafterKind(False, lambda v, d, m, lim: NgramDrafter(clock=lim.clock), "prompt lookup, no model"),
    "recycle": DrafterKind(False, lambda v, d, m, lim: RecyclingDrafter(v, clock=lim.clock, trees=lim.trees),
                           "Token Recycling: chains of the target's own earlier top successors, no model"),
    "lookup-recycle": DrafterKind(False, lambda v, d, m, lim: BothDrafter(
        NgramDrafter(clock=lim.clock), recycle=RecyclingDrafter(v, clock=lim.clock, trees=lim.trees)),
                                  "prompt lookup when it pays more, else Token Recycling; no model"),
    "both": DrafterKind(True, lambda v, d, m, lim: _both(v, d, m, lim),
                        "prompt lookup when it pays more, else the draft model (with lookup tails and lookahead)"),
    "head": DrafterKind(True, lambda v, d, m, lim: HeadDrafter(d, v, m, clock=lim.clock),
                        "the bundle's trained draft head on the target's hidden states (edgespec distill)"),
    "both-recycle": DrafterKind(True, lambda v, d, m, lim: _both(v, d, m, lim, recycle=True),
                                "prompt lookup, else Token Recycling, else the draft model, whichever pays more"),
}


def _both(target_vocab: int, draft: Runtime, id_map: np.ndarray | None, lim: DrafterLimits,
          recycle: bool = False) -> BothDrafter:
    lookup = NgramDrafter(clock=lim.clock)
    return BothDrafter(lookup, ModelDrafter(draft, target_vocab, id_map, guess=lookup.guess, max_width=lim.max_width,
                                            max_batch=lim.max_batch, clock=lim.clock),
                       RecyclingDrafter(target_vocab, clock=lim.clock, trees=lim.trees) if recycle else None)


def build_drafter(spec: str | Drafter | None, target_vocab: int, draft: Runtime | None,
                  id_map: np.ndarray | None, max_width: int | None = None, max_batch: int | None = None,
                  clock: Callable[[], float] = time.perf_counter, trees: bool = False) -> Drafter | None:
    """The drafter named `spec` (None: the draft model if given, else no drafting); max_width
    bounds a model drafter's widest forward and max_batch its prefill chunks (ModelDrafter); the
    drafter reads `clock` for its costs; `trees`: the target verifies draft trees (Token Recycling
    may draft one)."""
    if isinstance(spec, Drafter):
        if draft is not None or id_map is not None:
            raise ConfigError("give the draft model inside the drafter or as draft=, not both")
        return spec
    if spec is None:
        if draft is None:
            if id_map is not None:
                raise ConfigError("id_map given without a draft model; pass draft= or drop id_map")
            return None
        spec = "model"
    kind = DRAFTERS.get(spec)
    if kind is None:
        raise ConfigError(f"unknown drafter {spec!r}; choose one of: {', '.join(DRAFTERS)}")
    if kind.needs_model and draft is None:
        raise ConfigError(f"drafter {spec!r} needs a draft model; pass draft= or use drafter='ngram'")
    if not kind.needs_model and (draft is not None or id_map is not None):
        raise ConfigError(f"drafter {spec!r} uses no draft model; drop draft= and id_map=")
    return kind.build(target_vocab, draft, id_map, DrafterLimits(max_width, max_batch, clock, trees))
