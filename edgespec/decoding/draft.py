"""What every drafter is: a `Draft` (one step's proposal) and the `Drafter` interface.

Apart from drafters.py so that each drafter module (drafters.py, recycling.py) builds on the
interface without importing the others, and the registry in drafters.py imports them all.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from edgespec.decoding.draws import Draws
from edgespec.decoding.policy import DraftPolicy
from edgespec.decoding.sampling import SamplingParams
from edgespec.decoding.token_dist import TokenDist
from edgespec.decoding.tree import DraftTree
from edgespec.runtimes.base import Runtime

__all__ = ["Draft", "Drafter"]


@dataclass
class Draft:
    """One step's proposal."""

    tokens: list[int]  # target ids
    # per token, the distribution it was drawn from, over target ids (token_dist.py: a trimmed
    # head's stays K wide); None when every token is a deterministic proposal (point masses)
    dists: list[TokenDist] | None = None
    source: str = ""  # the policy's key for the drafter that proposed them
    ms_per_token: float | None = None  # marginal drafting cost, catch-up excluded (None: not measured)
    tail: int = 0  # the last `tail` tokens were appended by another, free drafter (prompt lookup)...
    tail_source: str = ""  # ...keyed so in the policy ("ngram:2")
    # a draft tree (tree.py) verified in one forward: `tokens` are then its nodes in verify order
    tree: DraftTree | None = None

    def truncated(self, n: int) -> Draft:
        """The chain's first `n` tokens, with their distributions and what is left of its tail."""
        head = len(self.tokens) - self.tail
        tail = max(0, n - head)
        return Draft(self.tokens[:n], None if self.dists is None else self.dists[:n], self.source,
                     self.ms_per_token, tail, self.tail_source if tail else "")


class Drafter(abc.ABC):
    """Proposes up to `limit` target ids continuing `tokens`, asking `policy` how many."""

    runtimes: tuple[Runtime, ...] = ()  # runtimes whose caches this drafter owns
    trees: bool = False  # it may propose draft trees (the target must verify them: Capabilities.trees)
    # its propose() takes `constraint=` (grammar.Constraint) and draws only tokens the grammar
    # allows; the decoder cuts other drafters' chains at the first token the grammar refuses
    constrained: bool = False

    @abc.abstractmethod
    def propose(self, tokens: list[int], limit: int, policy: DraftPolicy, params: SamplingParams,
                rng: Draws) -> Draft:
        """Phase 1 of a step. Must not change `tokens`. A sampling drafter draws the token at
        sequence position t against `rng.at(t)`, the noise the target's own draw there races too.
        A `constrained` drafter also takes `constraint=` (a grammar.Constraint at the end of
        `tokens`, or None)."""

    def sync(self, tokens: list[int]) -> None:  # noqa: B027 - stateless drafters need nothing
        """Drop cached state that is no longer a prefix of `tokens` (after a commit, or a stop)."""

    def forget(self) -> None:  # noqa: B027 - drafters that learn nothing across streams need nothing
        """Drop what was learned from earlier streams (a recycled successor table), so the next
        stream starts as a fresh engine's would: a benchmark repeating a prompt must not replay
        the last repeat's continuations. Caches are `sync`'s business, not this."""

    def observe(self, tokens: list[int], logits: np.ndarray) -> list[tuple[str, int, int]]:
        """The target's logits a verify (or plain step) computed anyway: row i follows `tokens[i]`,
        the last committed token then each draft, accepted or not. (len(tokens), V) float, valid
        only during the call. A drafter that learns from the target (recycling.py) reads them here.

        Returns free trials for the policy: (source, drafted, accepted) of drafts this drafter
        would have proposed in a step it did not draft, scored against these rows (greedy)."""
        return []
