"""The one small interface every backend implements.

A runtime owns one model and its KV cache. The cache always holds a prefix of the
sequence the caller is building; `forward` appends to it, `trim` rolls it back.

Constructor contract shared by every backend (memory planning relies on it):
    Runtime(model_path, *, threads=None, device=None, kv_capacity=None)
kv_capacity is the most positions the cache may hold (None: the backend's default); a
backend with fixed buffers allocates them once for that many positions, and a forward
past it raises ContextFullError.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import BackendError

__all__ = ["Capabilities", "Runtime", "Streamed", "common_prefix"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences (what a cache holding `a` can
    keep of `b`)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, checked when a pipeline is built."""

    backend: str
    can_trim: bool = True
    static_shapes: bool = False
    max_batch_tokens: int | None = None
    # a forward of up to this many tokens costs what a one-token forward costs (the backend pads
    # every forward to it), so a draft that fits is free on the target side
    free_batch_tokens: int = 1
    devices: tuple[str, ...] = ("CPU",)
    fixed_kv: bool = False  # KV lives in buffers preallocated for kv_capacity positions (no growth)
    # why a k-token forward may round differently from k one-token forwards (None: it does not);
    # then speculative greedy output can differ from plain greedy on near-ties
    batch_variance: str | None = None
    trees: bool = False  # forward_tree and keep_rows work (one forward verifies a draft tree)
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Streamed:
    """What one forward reads and runs, for a roofline: `weights`, the bytes of every weight a
    product reads whole (a gathered table, read a row per token, is not counted; a tied head's
    product of the same table is), and `ops`, the operators its graph runs (None: not known)."""

    weights: int
    ops: int | None = None

    def __add__(self, other: Streamed) -> Streamed:
        ops = None if self.ops is None or other.ops is None else self.ops + other.ops
        return Streamed(self.weights + other.weights, ops)


class Runtime(abc.ABC):
    """forward a few tokens → logits; trim the KV cache; report memory.

    Every runtime sets `capabilities` (a Capabilities) when it is built, so callers read
    `rt.capabilities.x` directly; one that does not fails on the first read, naming itself."""

    vocab_size: int
    # KV dtypes the backend can be asked for (constructor kwarg kv_dtype); the first is the default
    kv_dtypes: tuple[str, ...] = ("float32",)
    kv_capacity: int | None = None  # most positions the cache holds; None: grows until memory runs out
    kv_bytes_per_token: int = 0  # bytes one cached position takes, all layers, K and V
    # positions of the last forward whose work was done before (a shared body's lookahead rows):
    # that forward's time then understates what its width costs
    reused_rows: int = 0

    @property
    def capabilities(self) -> Capabilities:
        """What this runtime can do; set once by its constructor."""
        try:
            return self._capabilities
        except AttributeError:
            raise BackendError(f"{type(self).__name__} sets no capabilities; a runtime's constructor must") from None

    @capabilities.setter
    def capabilities(self, value: Capabilities) -> None:
        if not isinstance(value, Capabilities):
            raise BackendError(f"capabilities must be a Capabilities, got {type(value).__name__}")
        self._capabilities = value

    def model_sizes(self) -> dict[str, int]:
        """hidden, n_heads, intermediate, n_layers, n_kv_heads, head_dim, vocab where the backend
        knows them (memory planning estimates scratch memory from them); {} if unknown."""
        return {}

    def probe_scratch(self, n_new: int, n_ctx: int) -> bool:
        """Run one throwaway forward of `n_new` tokens over `n_ctx` positions (as if the cache held
        n_ctx - n_new), so the allocator reaches the scratch size of the largest forward now and a
        planner can measure it; the cache is empty afterwards. False if the backend cannot."""
        return False

    def kernel_options(self) -> dict:
        """What decides which kernels this runtime runs (its capabilities and build), as JSON-able
        data: the exactness probe's verdict is cached under it."""
        caps = self.capabilities
        return {"backend": caps.backend, "static": caps.static_shapes, "devices": list(caps.devices),
                "extra": {k: v for k, v in sorted(caps.extra.items()) if isinstance(v, (str, int, float, bool))}}

    def streamed(self) -> Streamed | None:
        """The weight bytes and operators of one forward (a roofline's numerator); None where the
        backend cannot tell."""
        return None

    def fixed_bytes(self) -> int:
        """Bytes held whatever the context length: the weights as the backend holds them plus
        buffers sized at load (not the KV cache). Planners measure the process as a whole; this
        is the backend's own account, for reports."""
        return int(self.memory_bytes().get("weights", 0))

    @property
    @abc.abstractmethod
    def n_past(self) -> int:
        """Number of positions currently held in the KV cache."""

    @abc.abstractmethod
    def forward(self, token_ids: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append `token_ids` to the cache; return float32 logits `(n_logits, vocab)`
        for the last `n_logits` new positions (n_logits <= len(token_ids)).

        The result may be a view of a buffer the runtime reuses: valid until the next
        forward (copy it to keep it). Past kv_capacity: ContextFullError, cache unchanged."""

    @abc.abstractmethod
    def trim(self, n_past: int) -> None:
        """Roll the cache back so that it holds only the first `n_past` positions."""

    def forward_tree(self, token_ids: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Append a draft tree in one forward: row i's token follows the path to row parents[i]
        (-1 for row 0, where every path starts); logits `(len(token_ids), vocab)`, each row what
        the same path fed as a chain gives, bit for bit. Then keep_rows keeps one path.
        Where capabilities.trees is False: BackendError."""
        raise BackendError(f"{self.capabilities.backend} verifies chains only here")

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        """After forward_tree at position `start`: hold the positions before it, then its rows `rows`
        (increasing, one root-to-node path) at start, start+1, ..."""
        raise BackendError(f"{self.capabilities.backend} verifies chains only here")

    def reset(self) -> None:
        self.trim(0)

    @abc.abstractmethod
    def memory_bytes(self) -> dict[str, int]:
        """Bytes held now: at least `weights` and `kv` (for fixed buffers: their full size)."""

    def close(self) -> None:  # noqa: B027 - optional for backends with nothing to free
        """Free native resources."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
