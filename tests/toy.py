"""A deterministic numpy "language model" with a real, truncatable cache, for decoding tests.

Logits after a position depend on the last two tokens, the position and a running hash of the
whole cache, so a cache holding the wrong tokens (even far back) gives different logits.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgespec.runtimes.base import Capabilities, Runtime

_N_HASH = 17
_N_POS = 7


class ToyRuntime(Runtime):
    """Seeded table lookup: W[prev2, prev1] + P[pos % 7] + H[hash(cache)].

    noise mixes in a second table (a "disagreeing" draft); keep trims the output head to those
    target ids (a trimmed draft whose output id j is target id keep[j]; like edgespec's trimmed
    drafts it keeps the full input vocabulary and is fed target ids). fail_at makes the n-th forward
    call raise after appending its tokens, like a backend dying mid-step.
    """

    def __init__(
        self,
        vocab: int = 50,
        seed: int = 0,
        *,
        noise: float = 0.0,
        noise_seed: int = 1,
        scale: float = 1.5,
        keep: Sequence[int] | None = None,
        max_batch_tokens: int | None = None,
        fail_at: int | None = None,
    ) -> None:
        self.w, self.pos, self.hash = _tables(vocab, seed, scale)
        if noise:
            w2, pos2, hash2 = _tables(vocab, noise_seed, scale)
            self.w, self.pos, self.hash = self.w + noise * w2, self.pos + noise * pos2, self.hash + noise * hash2
        self.keep = None if keep is None else np.asarray(keep, dtype=np.int64)
        self.input_vocab = vocab
        self.vocab_size = vocab if keep is None else len(self.keep)
        self.capabilities = Capabilities(backend="toy", max_batch_tokens=max_batch_tokens)
        self.fail_at = fail_at
        self.cache: list[int] = []  # in the full (target) vocabulary
        self._hashes: list[int] = []
        self.calls = 0
        self.fed_positions: list[int] = []  # cache position of every token ever fed

    @property
    def n_past(self) -> int:
        return len(self.cache)

    def forward(self, token_ids: Sequence[int], n_logits: int = 1) -> np.ndarray:
        ids = [int(t) for t in token_ids]
        if not 1 <= n_logits <= len(ids):
            raise ValueError(f"n_logits={n_logits} with {len(ids)} tokens")
        limit = self.capabilities.max_batch_tokens
        if limit is not None and len(ids) > limit:
            raise ValueError(f"{len(ids)} tokens exceed max_batch_tokens={limit}")
        if any(not 0 <= t < self.input_vocab for t in ids):
            raise ValueError(f"token outside vocab {self.input_vocab}: {ids}")
        self.calls += 1
        rows = []
        for t in ids:
            full = t
            prev = self._hashes[-1] if self._hashes else 0
            self.fed_positions.append(len(self.cache))
            self.cache.append(full)
            self._hashes.append((prev * 31 + full + 1) % _N_HASH)
            rows.append(self._logits())
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError("toy backend failed")
        out = np.stack(rows[-n_logits:]).astype(np.float32)
        return out if self.keep is None else out[:, self.keep]

    def _logits(self) -> np.ndarray:
        a = self.cache[-2] if len(self.cache) >= 2 else 0
        b = self.cache[-1]
        return self.w[a, b] + self.pos[len(self.cache) % _N_POS] + self.hash[self._hashes[-1]]

    def trim(self, n_past: int) -> None:
        if not 0 <= n_past <= len(self.cache):
            raise ValueError(f"cannot trim {len(self.cache)} positions to {n_past}")
        del self.cache[n_past:]
        del self._hashes[n_past:]

    def memory_bytes(self) -> dict[str, int]:
        return {"weights": self.w.nbytes + self.pos.nbytes + self.hash.nbytes, "kv": 8 * len(self.cache)}


def _tables(vocab: int, seed: int, scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        scale * rng.standard_normal((vocab, vocab, vocab)),
        0.5 * rng.standard_normal((_N_POS, vocab)),
        0.5 * rng.standard_normal((_N_HASH, vocab)),
    )


def naive_greedy(model: ToyRuntime, prompt: Sequence[int], n: int, stop_ids=()) -> list[int]:
    """Reference decoder: re-feed the whole sequence from an empty cache for every token."""
    seq = list(prompt)
    for _ in range(n):
        model.reset()
        seq.append(int(np.argmax(model.forward(seq, n_logits=1)[-1])))
        if seq[-1] in stop_ids:
            break
    model.reset()
    return seq[len(prompt):]


class TreeToyRuntime(ToyRuntime):
    """A ToyRuntime that verifies draft trees (Capabilities.trees): forward_tree gives each row the
    logits of its own path fed as a chain, and keep_rows keeps one path, checking it is one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.capabilities = Capabilities(backend="toy", max_batch_tokens=self.capabilities.max_batch_tokens,
                                         trees=True)
        self.trees = 0  # tree forwards run
        self._tree: tuple[int, list[int], list[int]] | None = None  # (start, tokens, parents)

    def forward_tree(self, token_ids: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        ids, parents = [int(t) for t in token_ids], [int(p) for p in parents]
        start, rows = len(self.cache), []
        for i in range(len(ids)):
            path, node = [], i
            while node >= 0:
                path.append(ids[node])
                node = parents[node]
            rows.append(self.forward(path[::-1], n_logits=1)[0])
            self.trim(start)
        self.calls -= len(ids) - 1  # one forward, as a backend runs it
        for t in ids:  # the rows sit in the cache in input order until keep_rows
            self.cache.append(t)
            self._hashes.append(-1)
        self.trees += 1
        self._tree = (start, ids, parents)
        return np.stack(rows)

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        first, ids, parents = self._tree
        assert start == first and rows[0] == 0, (start, first, rows)
        assert all(parents[b] == a for a, b in zip(rows, rows[1:])), f"rows {rows} are not a path"
        self.trim(start)
        self.forward([ids[r] for r in rows])
        self.calls -= 1
        self._tree = None
