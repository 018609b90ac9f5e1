"""A draft that runs on the target's own body: only the heads differ.

A self-draft without a layer cut (`edgespec export --draft self`) is the target's body, quantized,
with a VocabTrim head. Run as a separate model, its body repeats work the target does anyway:
each drafted token goes through the same layers twice, once to draft and once to verify, and
after a prompt-lookup step the draft first catches up on the tokens the lookup committed. Here
one body serves both: it computes the final hidden state of each position once, keyed by the
token ids it was computed for, and two runtimes read those rows through their own heads, the
target's full head (its verify) and the draft's trimmed one (its proposal).

So a verify after k model drafts runs the body on the one position the draft has not computed
(the last draft) and the full head on its k+1 rows in one batch, a catch-up costs nothing, and
the draft's own body (its weights and KV cache) is never loaded.

Exactness is unchanged: a row's hidden state depends only on the tokens up to it (the body's
forwards are row-exact: runtimes/openvino/runtime.py), and the head's rows do not depend on how many
rows share its call, so target logits are the same bits however the rows were batched.

Each runtime keeps its own prefix (`n_past`), as the decoder expects; the body holds one
sequence, and a forward recomputes from the first position where that sequence and the
caller's differ (the decoder keeps both a prefix of one sequence, so that is only where a
rejected draft was).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from ..errors import BackendError
from .base import Runtime, Streamed, common_prefix

__all__ = ["FeatureHead", "Head", "SharedBody", "SharedBodyRuntime", "check_feature_head", "check_heads",
           "shared_pair"]

logger = logging.getLogger(__name__)

# hidden rows kept behind the newest position: a verify reads back at most its own width
# (k+1 <= 17 here); an older row is recomputed (correct, only slower)
WINDOW = 64


class Head(Protocol):
    """Final hidden rows (R, H) -> logits (R, vocab_size); may return a view valid until the next call."""

    vocab_size: int
    hidden_size: int
    weight_bytes: int

    def __call__(self, hidden: np.ndarray) -> np.ndarray: ...

    def streamed(self) -> Streamed | None: ...

    def close(self) -> None: ...


class FeatureHead(Protocol):
    """A trained draft head (training/draft_head.py): (hidden rows (R, H), their next tokens as
    draft-vocabulary indices (R,)) -> the next positions' features (R, H), which the draft's own
    (VocabTrim) head turns into logits and which feed the head again to draft further."""

    hidden_size: int
    weight_bytes: int

    def __call__(self, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray: ...

    def close(self) -> None: ...


class SharedBody:
    """A body runtime (its forward returns final hidden rows) and the ids of the sequence its KV
    cache holds, with the hidden rows of the newest WINDOW positions."""

    def __init__(self, body: Runtime) -> None:
        self.body = body
        self.ids: list[int] = []
        self._rows = np.zeros((0, 0), dtype=np.float32)  # hidden rows of positions [_start, len(ids))
        self._start = 0
        self.forwards = 0  # body forwards run (tests and reports: how much work was shared)
        self.fed = 0  # positions the last `hidden` call ran through the body

    def hidden(self, seq: Sequence[int], n_rows: int) -> np.ndarray:
        """Hidden rows of the last `n_rows` positions of `seq`, running the body only from the
        first position it does not hold for `seq` (or whose row has left the window)."""
        lo = len(seq) - n_rows
        held = common_prefix(self.ids, seq)
        self.fed = 0
        if held < len(seq) or lo < self._start:
            self._run(seq, held if lo >= self._start else min(held, lo), lo)
        return self._rows[lo - self._start:len(seq) - self._start]

    def _run(self, seq: Sequence[int], start: int, lo: int) -> None:
        """Roll the body back to `start` positions and feed the rest of `seq`, keeping the rows
        from `lo` on (and the newest WINDOW)."""
        self.body.trim(start)
        start = min(start, self.body.n_past)  # a window-sized cache trimmed past what it holds keeps none
        del self.ids[start:]
        fed = len(seq) - start
        keep = max(WINDOW, len(seq) - lo)
        try:  # (n, H), a view valid until the body's next forward; a long prefill returns only the tail
            new = self.body.forward(list(seq[start:]), n_logits=min(fed, keep))
        except Exception:
            if self.body.n_past != len(self.ids):  # a failed forward: trust only what is known
                self.reset()
            raise
        self.forwards += 1
        self.fed = fed
        if len(new) == fed and start > self._start:  # continues the rows held for [_start, start)
            rows = np.concatenate([self._rows[:start - self._start], new])
        else:
            rows = np.array(new, dtype=np.float32)
        self._rows = rows[-keep:]
        self._start = len(seq) - len(self._rows)
        self.ids.extend(seq[start:])

    def reset(self) -> None:
        self.body.reset()
        self.ids.clear()
        self._rows, self._start = self._rows[:0], 0


class SharedBodyRuntime(Runtime):
    """A Runtime over a SharedBody and one head: the decoder's target or its draft.

    The owner (the target) reports the body's weights and KV cache and closes the body; the
    other (the draft) reports only its head, and its trained feature head when it has one
    (`feature_head`, read by decoding/head_drafter.py with `hidden_rows`). A draft may also hold
    `vocab_rows(ids)`: the target head's weight rows (M, H) of any target ids, with which
    decoding/context_vocab.py scores tokens its trimmed head lacks (None: it has none), against
    `last_hidden`, the hidden rows under the last forward's logits."""

    def __init__(self, shared: SharedBody, head: Head, *, owner: bool, role: str,
                 feature_head: FeatureHead | None = None,
                 vocab_rows: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.shared, self.head, self.owner, self.feature_head = shared, head, owner, feature_head
        self.vocab_rows = vocab_rows
        self.last_hidden = np.zeros((0, 0), dtype=np.float32)
        body = shared.body
        self.vocab_size = head.vocab_size
        self._ids: list[int] = []
        caps = body.capabilities
        self.capabilities = replace(caps, extra={**caps.extra, "shared_body": role})
        self.kv_capacity = body.kv_capacity
        self.kv_bytes_per_token = body.kv_bytes_per_token if owner else 0
        self.kv_sliding = getattr(body, "kv_sliding", (0.0, 0)) if owner else (0.0, 0)
        self.kv_dtypes = body.kv_dtypes

    @property
    def n_past(self) -> int:
        return len(self._ids)

    def forward(self, token_ids: Sequence[int], n_logits: int = 1) -> np.ndarray:
        if not token_ids:
            raise ValueError("forward needs at least one token")
        seq = self._ids + list(token_ids)
        rows = self.shared.hidden(seq, min(max(n_logits, 1), len(token_ids)))
        self.reused_rows = max(len(token_ids) - self.shared.fed, 0)
        self.last_hidden = rows  # the rows under the logits returned: a view valid until the body's next forward
        logits = self.head(rows)
        self._ids = seq
        return logits

    def trim(self, n_past: int) -> None:
        del self._ids[max(0, n_past):]  # the body keeps its rows: the next forward checks the ids

    def hidden_rows(self, seq: Sequence[int], n_rows: int = 1) -> np.ndarray:
        """A copy of the final hidden rows (n_rows, H) of the last `n_rows` positions of `seq`: free
        when the body's last forwards computed them (a verify did), else the body runs from the
        first position it lacks. This runtime's own prefix is unchanged."""
        return np.array(self.shared.hidden(list(seq), n_rows), dtype=np.float32)

    def reset(self) -> None:
        """Forget the sequence; the target (the body's owner) empties the body too, so the next
        forward computes every row again (the exactness probe relies on that)."""
        self._ids.clear()
        if self.owner:
            self.shared.reset()

    def model_sizes(self) -> dict[str, int]:
        return self.shared.body.model_sizes() if self.owner else {}

    def probe_scratch(self, n_new: int, n_ctx: int) -> bool:
        """The body's scratch probe (the owner's; a draft runs no forward of its own). The body
        and every runtime's prefix are empty afterwards."""
        if not self.owner:
            return False
        self.reset()
        try:
            return self.shared.body.probe_scratch(n_new, n_ctx)
        finally:
            self.reset()

    def streamed(self) -> Streamed | None:
        """A forward runs the body and this runtime's head (a drafted token: the draft's head)."""
        body, head = self.shared.body.streamed(), self.head.streamed()
        return None if body is None or head is None else body + head

    def mapped_weight_bytes(self) -> int:
        """Weight file bytes that may become resident after load (memory/loading.py): the body's."""
        if not self.owner:
            return 0
        tell = getattr(self.shared.body, "mapped_weight_bytes", None)
        return int(tell()) if callable(tell) else int(self.shared.body.memory_bytes().get("weights", 0))

    def memory_bytes(self) -> dict[str, int]:
        if not self.owner:
            extra = self.feature_head.weight_bytes if self.feature_head is not None else 0
            return {"weights": self.head.weight_bytes + extra, "kv": 0}
        mem = dict(self.shared.body.memory_bytes())
        mem["weights"] = mem.get("weights", 0) + self.head.weight_bytes
        return mem

    def close(self) -> None:
        self.head.close()
        if self.feature_head is not None:
            self.feature_head.close()
        if self.owner:
            self.shared.body.close()


def check_heads(target_head: Head, draft_head: Head) -> None:
    """The draft's head must read the hidden rows the target's body makes (a draft of this body)."""
    if draft_head.hidden_size != target_head.hidden_size:
        raise BackendError(f"the draft's head reads hidden states of size {draft_head.hidden_size}, the target's "
                           f"body makes {target_head.hidden_size}: not a draft of this target's body")


def check_feature_head(draft_head: Head, feature_head: FeatureHead) -> None:
    """A trained head must read and write the hidden rows the body makes and the draft's head reads."""
    if feature_head.hidden_size != draft_head.hidden_size:
        raise BackendError(f"the trained draft head works on hidden states of size {feature_head.hidden_size}, the "
                           f"target's body makes {draft_head.hidden_size}: distill it again for this target")


def shared_pair(body: Runtime, target_head: Head, draft_head: Head, feature_head: FeatureHead | None = None,
                vocab_rows: Callable[[np.ndarray], np.ndarray] | None = None,
                ) -> tuple[SharedBodyRuntime, SharedBodyRuntime]:
    """(target, draft) runtimes sharing `body`; the target owns it; the draft holds the trained
    feature head, if given, and the target head's weight rows (`vocab_rows`), if given."""
    shared = SharedBody(body)
    return (SharedBodyRuntime(shared, target_head, owner=True, role="target"),
            SharedBodyRuntime(shared, draft_head, owner=False, role="draft", feature_head=feature_head,
                              vocab_rows=vocab_rows))

