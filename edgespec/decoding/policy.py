"""Draft-length policies: how many tokens to draft next, learning from each step's outcome.

A policy answers four questions for the decoder:
  next_k(source)        how many tokens may this drafter propose now (0 means plain decoding)
  keep_drafting(confs)  should a model draft go on, given the draft's own top probabilities
  prefers(a, b)         of two drafters that could draft now, should `a` rather than `b`
  next_tail(...)        how many free tokens (a prompt-lookup continuation) to append to a draft
  lookahead(source, n)  how many prompt-lookup guesses a model draft's forward may feed along
  update(...), learn()  what the finished step cost and how much of its draft was accepted
A source is a drafter label ("model", "ngram:3", ...); adaptive policies keep their estimates
per source, so a long prompt-lookup match and a model draft earn separate acceptance rates.
The arithmetic lives in pure functions so each rule is testable on synthetic numbers. Add a
policy by subclassing DraftPolicy and registering a factory `k -> policy` in POLICIES.
"""
from __future__ import annotations

import abc
import dataclasses
import logging
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from edgespec.checks import integer
from edgespec.decoding.policy_rules import (
    best_k,
    best_tail,
    confidence_stop,
    decayed_counts,
    expected_tokens,
    heuristic_k,
    isotonic,
    step_rate,
    verify_table,
)
from edgespec.decoding.sources import family
from edgespec.errors import ConfigError

__all__ = [
    "DEFAULT_POLICY", "POLICIES", "CostAwareK", "DraftPolicy", "FixedK", "HeuristicK",
    "best_k", "best_tail", "confidence_stop", "decayed_counts", "expected_tokens", "family", "heuristic_k",
    "isotonic", "make_policy", "step_rate", "verify_table",
]

logger = logging.getLogger(__name__)

DEFAULT_POLICY = "cost"  # see dev/bench_policies.py: the only policy never slower than plain here
DEFAULT_MIN_JOINT = 0.3  # confidence stop: end a draft once P(all accepted) looks below this


# the pure rules live in policy_rules.py; imported here, where the policies use them and callers
# have always found them
# ---------------------------------------------------------------- policies


class DraftPolicy(abc.ABC):
    """Chooses the draft length for each speculative step."""

    min_joint: float = 0.0  # confidence stop threshold; 0 disables it
    # verifies up to this wide cost one plain step (the target pads its forwards to a fixed
    # width): the target's Capabilities.free_batch_tokens, given when the policy is built
    # (make_policy's free_width); only policies that weigh costs read it
    free_width: int = 1

    @abc.abstractmethod
    def next_k(self, source: str = "model") -> int:
        """Number of tokens `source` may draft in the next step (0 means plain decoding)."""

    @property
    def uses_confidence(self) -> bool:
        """Whether drafters should compute their top probabilities for `keep_drafting`."""
        return self.min_joint > 0

    def keep_drafting(self, confidences: Sequence[float]) -> bool:
        """Whether a draft whose tokens had these top probabilities should go on."""
        return not confidence_stop(confidences, self.min_joint)

    def prefers(self, first: str, second: str) -> bool:
        """Whether to draft from `first` rather than `second` when both could draft now.
        Policies that do not weigh costs keep the caller's order."""
        return True

    def next_tail(self, source: str, head_source: str, head_k: int) -> int:
        """How many tokens `source` (a free drafter: prompt lookup) may append after `head_k`
        tokens drafted by `head_source`. Policies that do not weigh costs append none."""
        return 0

    def lookahead(self, source: str, most: int) -> int:
        """How many lookahead guesses (prompt lookup's continuation of the draft) each forward of
        `source`, a model drafter, may feed along, at most `most`. Policies that do not weigh
        costs feed them all."""
        return most

    def learn_lookahead(self, source: str, forwards: int, hits: int) -> None:  # noqa: B027
        """Learn that `forwards` forwards of `source` fed guesses, and `hits` guesses were drawn
        (each then needed no forward of its own)."""

    def update(self, drafted: int, accepted: int, draft_ms: float, verify_ms: float | None, *,  # noqa: B027
               source: str = "model", ms_per_token: float | None = None, width: int | None = None,
               expected: float | None = None) -> None:
        """Learn from one finished step; stateless policies ignore it.

        drafted/accepted count `source`'s own tokens (a tail's are reported through `learn`);
        verify_ms is the target side of the step (verify forward, acceptance, rollback), None
        when its time is no measure of one (a plain step whose row was computed ahead);
        `width` is the tokens that verify scored (default drafted + 1; more with a tail);
        ms_per_token is the drafter's marginal cost per drafted token, when it measured one;
        `expected`, under sampling, the summed acceptance probabilities of the drafts tested
        (the accepted ones and the first rejected), which policies may learn instead of `accepted`.
        """

    def verify_costs(self, source: str, max_width: int) -> list[float] | None:
        """What verifies of 1..max_width rows cost after `source`'s drafts, in plain steps, as
        measured (None: this policy does not measure costs)."""
        return None

    def learn(self, source: str, drafted: int, accepted: int, expected: float | None = None) -> None:  # noqa: B027
        """Learn the acceptance of `drafted` tokens of `source` that cost no step of their own, of which
        the target kept `accepted`: a tail (called only when it was tested: the draft before it was
        kept whole), or a free trial a drafter scored against a step it did not draft (Drafter.observe).
        `expected`: as in `update`."""


def _check_min_joint(value: float) -> None:
    if not 0 <= value < 1:
        raise ConfigError(f"confidence threshold must be in [0, 1), got {value}")


@dataclass
class FixedK(DraftPolicy):
    """Always draft `k` tokens (fewer when the confidence stop, if enabled, fires)."""

    k: int = 4
    min_joint: float = 0.0

    def __post_init__(self) -> None:
        integer(self.k, "draft length k", least=0)
        _check_min_joint(self.min_joint)

    def next_k(self, source: str = "model") -> int:
        return self.k


@dataclass
class HeuristicK(DraftPolicy):
    """Start at `k`; +2 after a fully accepted draft, −1 otherwise, within [k_min, k_max], per source."""

    k: int = 4
    k_min: int = 1
    k_max: int = 8
    min_joint: float = 0.0
    _k: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("k", "k_min", "k_max"):
            integer(getattr(self, name), name, least=0)
        if not self.k_min <= self.k <= self.k_max:
            raise ConfigError(f"need k_min <= k <= k_max, got {self.k_min}, {self.k}, {self.k_max}")
        _check_min_joint(self.min_joint)

    def next_k(self, source: str = "model") -> int:
        return self._k.get(source, self.k)

    def update(self, drafted, accepted, draft_ms, verify_ms, *, source="model", ms_per_token=None,
               width=None, expected=None) -> None:
        self._k[source] = heuristic_k(self.next_k(source), drafted, accepted, self.k_min, self.k_max)


@dataclass
class _SourceStats:
    hits: float
    trials: float
    cost: deque = field(default_factory=deque)  # recent ms per drafted token, in plain steps
    idle: int = 0  # consecutive steps this source chose not to draft
    interval: int = 0  # idle steps until the next probe (doubles while probes keep losing)
    drafting: int = 0  # steps this source drafted (every explore_every-th tries one token more)
    look_hits: float = 0.0  # lookahead guesses drawn (decayed counts), over
    look_forwards: float = 0.0  # forwards that fed guesses
    look_idle: int = 0  # forwards planned without guesses since the last that fed them


@dataclass
class CostAwareK(DraftPolicy):
    """Draft the k that maximises expected tokens per ms, from costs and acceptance measured online.

    Costs (the target's per verify width, a drafter's per drafted token) are kept in units of a
    plain one-token step at the time of measuring, and estimated as the median of the last
    `window` samples: a busy neighbour on a shared CPU slows every forward alike, so samples from
    a quiet minute and a busy one stay comparable, and one outlier does not steer the plan.
    Acceptance alpha is kept per source (decayed counts). Every `explore_every`-th
    drafting step drafts one token more than planned, so the next wider verify stays measured.
    A model drafter's forwards feed prompt lookup's guesses along (`lookahead`) while the guesses
    it draws save more draft forwards than the wider forwards cost, measured per regime.
    When plain decoding wins (k = 0), a source still drafts `probe_k` tokens now and then so its
    alpha stays fresh; the interval doubles while probes keep losing, so a draft that never pays
    costs almost nothing. The unit itself, a plain step, is measured `warmup` times before any
    drafting (the first forward after loading carries one-off costs) and again at least every
    `refresh_every` steps: a drafter that always finds something to draft would otherwise leave
    every cost measured against one stale plain step. Verify costs are kept per drafter family
    ("model", "ngram"): on a shared body a model draft's verify reuses the rows its drafting
    computed and costs much less than a lookup's verify of the same width. A tail (`next_tail`)
    after a draft may take up to `k_max` more tokens, planned by `best_tail` from the same
    estimates: the head's verify as its family's, plus what each token adds to a lookup's verify.
    """

    k_max: int = 8
    min_joint: float = 0.0
    probe_every: int = 16
    max_probe_every: int = 256
    probe_k: int = 2
    explore_every: int = 8
    window: int = 5
    accept_decay: float = 0.8  # per-step forgetting of acceptance counts (a property of the text)
    prior_alpha: float = 0.5
    prior_trials: float = 1.0
    # prior for widths not measured yet: each extra verified token costs this fraction of a one-token
    # step; on the low side, so wider drafts get tried and measured rather than ruled out unseen
    verify_slope: float = 0.1
    warmup: int = 3
    refresh_every: int = 32
    look_decay: float = 0.9  # per-draft forgetting of the lookahead's hit rate
    free_width: int = 1  # see DraftPolicy
    _since_plain: int = field(default=0, init=False, repr=False)  # steps since the last plain one
    _plain: deque = field(default_factory=deque, init=False, repr=False)  # ms of recent one-token steps
    # drafter family -> verify width -> its cost in plain steps
    _wide: dict[str, dict[int, deque]] = field(default_factory=dict, init=False, repr=False)
    _sources: dict[str, _SourceStats] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("k_max", "probe_every", "max_probe_every", "probe_k", "explore_every", "window",
                     "warmup", "refresh_every", "free_width"):
            integer(getattr(self, name), name, least=0)
        if self.probe_every < 1 or self.max_probe_every < self.probe_every:
            raise ConfigError("need 1 <= probe_every <= max_probe_every")
        if min(self.window, self.explore_every, self.warmup, self.refresh_every) < 1:
            raise ConfigError("window, explore_every, warmup and refresh_every must be >= 1")
        if self.free_width < 1:
            raise ConfigError(f"free_width must be >= 1, got {self.free_width}")
        for name in ("accept_decay", "prior_alpha", "look_decay"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not self.prior_trials > 0 or not self.verify_slope >= 0:
            raise ConfigError("prior_trials must be > 0 and verify_slope >= 0")
        _check_min_joint(self.min_joint)
        self._plain = deque(maxlen=self.window)

    def acceptance(self, source: str) -> float:
        """Current estimate of the per-token acceptance of `source` (the prior if never drafted)."""
        s = self._stats(source)
        return (s.hits + self.prior_alpha * self.prior_trials) / (s.trials + self.prior_trials)

    def relative_verify(self, family: str = "model") -> dict[int, float]:
        """Target-side cost per verify width measured so far after drafts of `family`, in plain
        steps (width 1 is 1)."""
        return {1: 1.0, **{w: statistics.median(d) for w, d in sorted(self._wide.get(family, {}).items())}}

    def snapshot(self) -> dict:
        """What the policy has learned: ms of a plain step; verify cost per width and per source
        the cost per drafted token, both in plain steps; per source alpha and the planned k."""
        sources = {src: {"alpha": round(self.acceptance(src), 3), "cost": _median(s.cost, 3), "k": self.plan(src)}
                   for src, s in sorted(self._sources.items())}
        verify = {fam: {w: round(v, 2) for w, v in self.relative_verify(fam).items()} for fam in sorted(self._wide)}
        return {"plain_ms": _median(self._plain, 1), "verify": verify, "sources": sources}

    def plan(self, source: str) -> int | None:
        """The cost-optimal k for `source` now, or None while a cost is still unknown."""
        planned = self._plan(source)
        return None if planned is None else planned[0]

    def rate(self, source: str) -> float | None:
        """Expected tokens per plain step's time of `source`'s planned draft (None: unknown)."""
        planned = self._plan(source)
        return None if planned is None else planned[1]

    def _plan(self, source: str) -> tuple[int, float] | None:
        """(the cost-optimal k, its expected tokens per plain step's time), from one verify table."""
        s = self._stats(source)
        if not self._plain or not s.cost:
            return None
        alpha, cost = self.acceptance(source), statistics.median(s.cost)
        table = self._verify_table(source, self.k_max + 1)
        k = best_k(alpha, cost, table)
        return k, step_rate(alpha, k, cost, table)

    def prefers(self, first: str, second: str) -> bool:
        # a prompt-lookup match of one token is right about a third of the time here, a model
        # draft nine in ten: drafting whichever matched first left tokens on the table
        a, b = self.rate(first), self.rate(second)
        return a is None or b is None or a >= b

    def next_tail(self, source: str, head_source: str, head_k: int) -> int:
        head = self._stats(head_source)
        if head_k <= 0 or not self._plain or not head.cost:
            return 0
        # the head's verify as its family measured it; each tail token adds what a token adds to
        # a verify of `source`'s family (on a shared body the tail's rows are computed at verify)
        table = self._verify_table(head_source, head_k + 1)
        tail = self._verify_table(source, head_k + self.k_max + 1)
        table += [table[-1] + tail[w] - tail[head_k] for w in range(head_k + 1, len(tail))]
        return best_tail(self.acceptance(head_source), head_k, statistics.median(head.cost),
                         self.acceptance(source), table)

    def lookahead(self, source: str, most: int) -> int:
        s = self._stats(source)
        if most <= 0 or s.look_forwards < self.warmup or not s.cost or not self._plain:
            return most
        # a guess row costs what a row adds to a lookup's verify (the body runs it alike); a hit
        # saves a draft forward. Without guesses, one draft in probe_every feeds them again, so the
        # hit rate stays measured as the text changes
        table = self._verify_table("ngram", most + 1)
        if (s.look_hits / s.look_forwards) * statistics.median(s.cost) >= table[most] - table[0]:
            s.look_idle = 0
            return most
        s.look_idle += 1
        if s.look_idle >= self.probe_every:
            s.look_idle = 0
            return most
        return 0

    def learn_lookahead(self, source: str, forwards: int, hits: int) -> None:
        s = self._stats(source)
        s.look_hits = self.look_decay * s.look_hits + hits
        s.look_forwards = self.look_decay * s.look_forwards + forwards

    def verify_costs(self, source: str, max_width: int) -> list[float] | None:
        return self._verify_table(source, max_width) if self._plain else None

    def _verify_table(self, source: str, max_width: int) -> list[float]:
        """verify_table of what was measured after `source`'s family of drafts, widths up to
        free_width costing a plain step."""
        table = verify_table(self.relative_verify(family(source)), max_width, self.verify_slope)
        free = min(self.free_width, len(table))
        table[:free] = [table[0]] * free
        return table

    def next_k(self, source: str = "model") -> int:
        if self.k_max == 0 or len(self._plain) < min(self.warmup, self.window) \
                or self._since_plain >= self.refresh_every:
            return 0  # (re)learn what a plain step costs
        s = self._stats(source)
        k = self.plan(source)
        if k is None:  # never measured this drafter: try it
            return min(self.probe_k, self.k_max)
        if k > 0:
            s.idle, s.interval, s.drafting = 0, self.probe_every, s.drafting + 1
            return min(k + 1, self.k_max) if s.drafting % self.explore_every == 0 else k
        s.idle += 1
        if s.idle < s.interval:
            return 0
        s.idle, s.interval = 0, min(2 * s.interval, self.max_probe_every)
        return min(self.probe_k, self.k_max)

    def update(self, drafted, accepted, draft_ms, verify_ms, *, source="model", ms_per_token=None,
               width=None, expected=None) -> None:
        width = drafted + 1 if width is None else width
        if width <= self.free_width and verify_ms is not None:  # the same forward as a plain step
            self._plain.append(verify_ms)
            self._since_plain = 0
        else:
            self._since_plain += 1
        unit = statistics.median(self._plain) if self._plain else None  # costs are kept in plain steps
        # a verify with a tail mixes two families' costs: neither table takes it
        if 1 < width == drafted + 1 and unit is not None and verify_ms is not None:
            widths = self._wide.setdefault(family(source), {})
            widths.setdefault(width, deque(maxlen=self.window)).append(verify_ms / unit)
        if drafted == 0:
            return
        self.learn(source, drafted, accepted, expected)
        if unit is not None and ms_per_token is not None:
            self._stats(source).cost.append(ms_per_token / unit)

    def learn(self, source: str, drafted: int, accepted: int, expected: float | None = None) -> None:
        s = self._stats(source)
        s.hits, s.trials = decayed_counts(s.hits, s.trials, drafted, accepted, self.accept_decay, expected)

    def _stats(self, source: str) -> _SourceStats:
        if source not in self._sources:
            self._sources[source] = _SourceStats(0.0, 0.0, deque(maxlen=self.window), interval=self.probe_every)
        return self._sources[source]


def _median(samples: deque, digits: int) -> float | None:
    return round(statistics.median(samples), digits) if samples else None


# ---------------------------------------------------------------- registry


# Adaptive policies range up to twice the configured draft length k.
def _heuristic(k: int) -> HeuristicK:
    return HeuristicK(k, k_min=min(1, k), k_max=2 * k)


def _confidence(k: int) -> FixedK:
    return FixedK(2 * k, min_joint=DEFAULT_MIN_JOINT)


def _cost(k: int) -> CostAwareK:
    # no confidence stop: with the default int8 self-draft the draft's own top probability
    # underestimates acceptance badly, and the stop cut drafts that would have been accepted
    return CostAwareK(k_max=2 * k)


# name (the --draft-policy value) -> factory taking the configured draft length k
POLICIES: dict[str, Callable[[int], DraftPolicy]] = {
    "fixed": FixedK,
    "heuristic": _heuristic,
    "confidence": _confidence,
    "cost": _cost,
}


def make_policy(name: str, k: int, *, free_width: int = 1) -> DraftPolicy:
    """Build the policy registered as `name` for draft length `k` (adaptive ones go up to 2k), on a
    target whose verifies up to `free_width` wide cost one plain step (its free_batch_tokens)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown draft policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    integer(k, "draft length k", least=0)
    policy = factory(k)
    if free_width != 1 and any(f.name == "free_width" for f in dataclasses.fields(policy)):
        policy = dataclasses.replace(policy, free_width=free_width)
    return policy
