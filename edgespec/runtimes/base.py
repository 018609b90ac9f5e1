"""The one small interface every backend implements.

A runtime owns one model and its KV cache. The cache always holds a prefix of the
sequence the caller is building; `forward` appends to it, `trim` rolls it back.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = ["Capabilities", "Runtime"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, checked when a pipeline is built."""

    backend: str
    can_trim: bool = True
    static_shapes: bool = False
    max_batch_tokens: int | None = None
    devices: tuple[str, ...] = ("CPU",)
    extra: dict = field(default_factory=dict)


class Runtime(abc.ABC):
    """forward a few tokens → logits; trim the KV cache; report memory."""

    capabilities: Capabilities
    vocab_size: int

    @property
    @abc.abstractmethod
    def n_past(self) -> int:
        """Number of positions currently held in the KV cache."""

    @abc.abstractmethod
    def forward(self, token_ids: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append `token_ids` to the cache; return float32 logits `(n_logits, vocab)`
        for the last `n_logits` new positions (n_logits <= len(token_ids))."""

    @abc.abstractmethod
    def trim(self, n_past: int) -> None:
        """Roll the cache back so that it holds only the first `n_past` positions."""

    def reset(self) -> None:
        self.trim(0)

    @abc.abstractmethod
    def memory_bytes(self) -> dict[str, int]:
        """Bytes held now: at least `weights` and `kv`."""

    def close(self) -> None:  # noqa: B027 - optional for backends with nothing to free
        """Free native resources."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
