"""Drafter sources: who proposed a draft, as a small typed value and its string key.

A source keys a draft-length policy's estimates and the statistics: "model", "recycle", or a
prompt-lookup match of n tokens, "ngram:3" (matches of each length earn their own acceptance).
The string form travels in StepResult, the policies' tables and the bench JSON; this module is
the one place that writes or reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

from edgespec.checks import integer
from edgespec.errors import ConfigError

__all__ = ["Source", "family", "lookup_source"]


@dataclass(frozen=True)
class Source:
    """kind: the drafter family ("model", "ngram", "recycle", ...); n: a lookup's match length
    (None for a source without one)."""

    kind: str
    n: int | None = None

    def __post_init__(self) -> None:
        if not self.kind or ":" in self.kind:
            raise ConfigError(f"a source kind is a name without ':', got {self.kind!r}")
        if self.n is not None:
            integer(self.n, "a source's match length", least=0)

    @property
    def key(self) -> str:
        """The string form: "model", "ngram:3"."""
        return self.kind if self.n is None else f"{self.kind}:{self.n}"

    @classmethod
    def parse(cls, key: str) -> Source:
        """The Source of a key written by `key` ("ngram:3" -> Source("ngram", 3)); a key with a
        qualifier that is no length ("recycle:tree") keeps it in the kind's family only."""
        kind, _, rest = key.partition(":")
        return cls(kind, int(rest)) if rest.isdigit() else cls(kind)


def lookup_source(n: int) -> str:
    """The policy key of a lookup match of n tokens: matches of each length earn their own alpha."""
    return Source("ngram", n).key


def family(source: str) -> str:
    """The drafter family of a policy key: "ngram:3" -> "ngram"."""
    return Source.parse(source).kind
