"""What a generation streams: one `Response` per decoding step, its metrics with it.

Its own module because the engine (engine.py) yields it and a chat (session.py) passes it on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..decoding import GenerationStats

__all__ = ["Response"]


@dataclass
class Response:
    """One streamed piece of a generation; metrics travel with it."""

    text: str  # new text since the previous Response
    token_ids: list[int]
    from_draft: int  # how many of token_ids were accepted drafts
    tokens_per_s: float  # running decode speed of this generation
    finish_reason: str | None = None  # "stop", "length", "cancelled" or None while running
    stats: GenerationStats | None = None
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # bytes per model: weights, kv

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the models (weights, KV caches, buffers) after this step; `kv_used`, the
        filled part of a preallocated cache, is already inside `kv`."""
        return sum(v for parts in self.memory.values() for k, v in parts.items() if k != "kv_used")
