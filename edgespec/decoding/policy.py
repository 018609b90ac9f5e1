"""Draft-length policies: how many tokens to draft next, learning from each step's outcome.

A policy is a small object with `next_k()` and `update(...)`; add one by subclassing
`DraftPolicy` and registering a factory `k -> policy` in `POLICIES`.
"""
from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Callable

from edgespec.errors import ConfigError

__all__ = ["DraftPolicy", "FixedK", "POLICIES", "make_policy"]

logger = logging.getLogger(__name__)


class DraftPolicy(abc.ABC):
    """Chooses the draft length for each speculative step."""

    @abc.abstractmethod
    def next_k(self) -> int:
        """Number of tokens to draft in the next step (0 means plain decoding)."""

    def update(self, drafted: int, accepted: int, draft_ms: float, verify_ms: float) -> None:  # noqa: B027
        """Learn from one finished step; stateless policies ignore it."""


@dataclass
class FixedK(DraftPolicy):
    """Always draft `k` tokens."""

    k: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ConfigError(f"draft length k must be an integer >= 0, got {self.k}")

    def next_k(self) -> int:
        return self.k


# name (the --policy flag value) -> factory taking the configured draft length
POLICIES: dict[str, Callable[[int], DraftPolicy]] = {
    "fixed": FixedK,
}


def make_policy(name: str, k: int) -> DraftPolicy:
    """Build the policy registered as `name` with draft length (or maximum) `k`."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown draft policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}") from None
    return factory(k)
