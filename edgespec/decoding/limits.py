"""What a decoder is bounded by, as one frozen value validated once, when it is built.

    limits = DecoderLimits(context_limit=4096, verify_width=9)
    SpeculativeDecoder(target, draft, drafter="both", limits=limits)

The engine derives one from its memory plan, the exactness probe's verdict and the tuner's width
(engine/assembly.py `decoder_limits`); every decoder variant on its runtimes is built with it.
Nothing downstream checks these values again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from edgespec.checks import integer
from edgespec.errors import ConfigError

__all__ = ["DecoderLimits", "UNLIMITED"]


@dataclass(frozen=True)
class DecoderLimits:
    """context_limit: most positions a sequence may reach; max_draft: most drafts per step (both
    set by a memory plan, edgespec.memory). verify_width: the widest verify forward, drafts
    included (the widths the exactness probe found bit-identical to one-token forwards,
    runtimes/exactness.py); draft_width: the widest forward a model drafter may run, its
    lookahead guesses included (the same bound when the draft runs on the target's body, whose
    rows the verify reuses). exact_reach: the most keys a verify may attend to (the probe checked
    verifies up to there; past it the decoder decodes plainly). max_batch: most tokens per forward
    of either model, below what the runtimes accept (a memory plan's prefill chunk). trees: a
    recycling drafter may draft trees where the target verifies them (the engine clears it where
    the probe found tree rows off). None: no limit."""

    context_limit: int | None = None
    max_draft: int | None = None
    verify_width: int | None = None
    draft_width: int | None = None
    max_batch: int | None = None
    trees: bool = True
    exact_reach: int | None = None

    def __post_init__(self) -> None:
        for name, least in (("context_limit", 2), ("max_draft", 0), ("verify_width", 1), ("draft_width", 1),
                            ("max_batch", 2), ("exact_reach", 2)):
            if getattr(self, name) is not None:  # None: no limit
                integer(getattr(self, name), name, least=least)
        if not isinstance(self.trees, bool):
            raise ConfigError(f"trees must be True or False, got {self.trees!r}")

    def replace(self, **changes: Any) -> DecoderLimits:
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


UNLIMITED = DecoderLimits()
