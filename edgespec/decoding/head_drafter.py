"""The `head` drafter: a bundle's trained draft head (training/draft_head.py) on the target's
hidden rows, so a drafted token costs the head and the VocabTrim head, never a body forward.

Each step reads the target's final hidden row of the position before the last committed token
(the verify that committed it computed that row: free), feeds it with the last token to the
head, which predicts the next position's feature; the draft's VocabTrim head turns the feature
into logits over its K tokens, the drafted token (argmax, or sampled) and that feature feed the
head again. Drafts are mapped to target ids with the id map; a sampling draft's distributions
are placed in target ids through the same map (`draft_distribution`: K wide, never scattered to
the target vocabulary), so verification is the decoder's usual one (greedy match, or rejection
sampling: exact).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from edgespec.decoding.acceptance import map_draft_ids
from edgespec.decoding.draft import Draft, Drafter
from edgespec.decoding.grammar import Constraint
from edgespec.decoding.sampling import SamplingParams, distribution, top_probability
from edgespec.decoding.token_dist import DenseDist, TokenDist
from edgespec.errors import ConfigError
from edgespec.runtimes.base import Runtime

__all__ = ["HeadDrafter", "draft_distribution", "draft_index"]


def draft_index(id_map: np.ndarray | None, target_vocab: int) -> np.ndarray:
    """(target_vocab,) target id -> draft index; K (the head's zero row) outside the draft vocabulary."""
    if id_map is None:
        return np.arange(target_vocab, dtype=np.int64)
    index = np.full(target_vocab, len(id_map), dtype=np.int64)
    index[id_map] = np.arange(len(id_map))
    return index


def draft_distribution(logits: np.ndarray, params: SamplingParams, id_map: np.ndarray | None,
                       index: Callable[[], np.ndarray]) -> TokenDist:
    """A draft row's sampling distribution in target ids: its candidates mapped through the id
    map, or a dense row kept K wide with the map and its inverse (`index()`, asked only then)."""
    dist = distribution(logits, params)
    if id_map is None:
        return dist
    if isinstance(dist, DenseDist):
        return dist.mapped(id_map, index())
    return dist.mapped(id_map)


class HeadDrafter(Drafter):
    """Drafts with the trained head the draft runtime holds (a draft on the target's body opened
    with the bundle's head: runtimes/onnxruntime/split.py, openvino/split.py)."""

    source = "head"
    constrained = True

    def __init__(self, draft: Runtime, target_vocab: int, id_map: np.ndarray | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.features = getattr(draft, "feature_head", None)
        if not hasattr(draft, "hidden_rows"):  # llama.cpp, or a draft with a body of its own
            backend = draft.capabilities.backend
            raise ConfigError(f"the trained draft head runs on the target's body, which the {backend} draft is not "
                              "(llama.cpp has no such head); open the bundle on onnxruntime or openvino with the "
                              "draft on the target's body, or use drafter 'model'")
        if self.features is None:
            raise ConfigError("drafter 'head' needs the bundle's trained draft head; add one with "
                              "`edgespec distill BUNDLE`, or use drafter 'model'")
        id_map = None if id_map is None else np.asarray(id_map, dtype=np.int64)
        if id_map is None and draft.vocab_size > target_vocab:
            raise ConfigError(f"draft vocab ({draft.vocab_size}) is larger than target vocab ({target_vocab})")
        self.draft, self.target_vocab, self.id_map, self.clock = draft, target_vocab, id_map, clock
        self.runtimes = (draft,)
        self._index = draft_index(id_map, target_vocab)

    def propose(self, tokens, limit, policy, params, rng, constraint: Constraint | None = None) -> Draft:
        k = min(policy.next_k(self.source), limit)
        if k <= 0 or len(tokens) < 2:
            return Draft([])
        # (1, H): the row of the position before the last token, which the last verify computed
        hidden = self.draft.hidden_rows(tokens[:-1], 1)
        t0 = self.clock()
        token = tokens[-1]
        drafts: list[int] = []
        dists: list[TokenDist] = []
        confidences: list[float] = []
        for _ in range(k):
            hidden = self.features(hidden, self._index[[token]])  # (1, H): the next position's feature
            logits = self.draft.head(hidden)[-1]
            if constraint is not None:  # a grammar: draw only what it allows (the draft ends where nothing is)
                logits = constraint.masked(logits, drafts, self.id_map)
                if logits is None:
                    break
            if params.greedy:
                token = map_draft_ids([int(np.argmax(logits))], self.id_map)[0]
            else:
                dists.append(draft_distribution(logits, params, self.id_map, lambda: self._index))
                token = dists[-1].sample(rng.at(len(tokens) + len(drafts)))  # a target id
            drafts.append(token)
            if policy.uses_confidence:
                confidences.append(top_probability(logits))
                if not policy.keep_drafting(confidences):
                    break
        if not drafts:
            return Draft([])
        return Draft(drafts, dists or None, self.source, 1e3 * (self.clock() - t0) / len(drafts))
