"""Training data for a trained draft head (draft_head.py), made by the exported target itself.

The target (its ONNX graph split at the final hidden state, runtimes/onnxruntime/split.py) reads
each calibration prompt (teacher-forced prefill) and then continues it greedily for a few dozen
tokens. At every position it records the final hidden row (post-norm: what a head reads) and
the target's greedy next token. No torch here: a device that only has the bundle and
onnxruntime can make the data.

A head learns from these rows to predict, from (h_t, x_{t+1}), the token the target would pick
after x_{t+1}, and the feature h_{t+1} it would compute there (EAGLE's feature-level drafting).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

__all__ = ["HeadData", "collect", "head_matrix", "prompt_ids", "pair_indices"]

logger = logging.getLogger(__name__)

# prompt tokens prefilled per forward: few enough that the (rows, full vocabulary) logits stay small
CHUNK = 64


@dataclass(frozen=True)
class HeadData:
    """Rows of every position of every calibration sequence, in order."""

    hidden: np.ndarray  # (N, H) float32: the target's final hidden row after feeding tokens[i]
    tokens: np.ndarray  # (N,) int64: the target id fed at each position
    greedy: np.ndarray  # (N,) int64: the target's greedy choice after tokens[i]
    segment: np.ndarray  # (N,) int32: which sequence each row belongs to
    decode: np.ndarray  # (N,) bool: greedy[i] is a token the target generated (not the prompt's next)
    seconds: float = 0.0  # how long collecting took

    def __len__(self) -> int:
        return len(self.tokens)


def pair_indices(segment: np.ndarray, steps: int = 1) -> np.ndarray:
    """Positions i whose next `steps` positions are in the same sequence: the training samples
    (h_i, x_{i+1}) -> greedy_{i+1}, chained `steps` deep."""
    n = len(segment)
    if n <= steps:
        return np.zeros(0, dtype=np.int64)
    ok = segment[:n - steps] == segment[steps:]
    return np.flatnonzero(ok).astype(np.int64)


def prompt_ids(tokenizer, prompts: list[dict]) -> list[list[int]]:
    """Token ids of calibration prompts (vocabtrim.read_prompt_file / builtin_prompts): chat
    prompts through the chat template when the bundle has one, text as it is."""
    out = []
    for p in prompts:
        if p["kind"] != "text" and tokenizer.has_chat_template:
            messages = p.get("messages") or [{"role": "user", "content": p["text"]}]
            out.append(tokenizer.encode_chat(messages))
        else:
            out.append(tokenizer.encode(p.get("text", "")))
    return [ids for ids in out if len(ids) >= 2]


def head_matrix(head, hidden_size: int) -> np.ndarray:
    """(K, H): the rows of a linear head (the draft's VocabTrim head), read by running it on the
    identity; a head that is not linear (a logit softcap) cannot be the trained head's output."""
    eye = np.eye(hidden_size, dtype=np.float32)
    w = np.array(head(eye), dtype=np.float32).T  # (K, H)
    probe = np.random.default_rng(0).standard_normal((2, hidden_size)).astype(np.float32)
    want = probe @ w.T
    # a quantized head (int8 activations) reads a one-hot row exactly and a random one nearly
    if np.abs(np.array(head(probe)) - want).max() > 0.05 * (np.abs(want).max() or 1.0):
        raise ConfigError("the draft's head is not a plain matrix (a logit softcap?); a trained head needs one")
    return w


def _greedy(target, new: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Feed `new` to the target (a SharedBodyRuntime); (hidden rows, greedy next ids) of each."""
    logits = target.forward(new, n_logits=len(new))
    greedy = np.argmax(logits, axis=-1).astype(np.int64)
    rows = target.hidden_rows(target.shared.ids, len(new))  # computed by that forward: no work
    return rows, greedy


def _continuation(decoder, ids: list[int], gen_tokens: int, stop_ids: set[int]) -> list[int]:
    """The target's greedy continuation of `ids`, generated with speculative decoding."""
    from ..decoding import SamplingParams

    decoder.target.reset()
    tokens = list(ids)
    for _ in decoder.stream(tokens, SamplingParams(), gen_tokens, stop_ids=stop_ids):
        pass
    cont = tokens[len(ids):]
    return cont[:-1] if cont and cont[-1] in stop_ids else cont


def _sequence(target, ids: list[int], gen_tokens: int, stop_ids: set[int], limit: int | None, decoder=None):
    """Rows of one prompt's prefill and its greedy continuation: generated one token at a time,
    or by `decoder` (speculative) and then read back in one teacher-forced pass."""
    if limit is not None:
        ids = ids[:max(limit - gen_tokens - 1, 2)]
    seq = ids + (_continuation(decoder, ids, gen_tokens, stop_ids) if decoder is not None and gen_tokens else [])
    target.reset()
    fed = [seq[start:start + CHUNK] for start in range(0, len(seq), CHUNK)]
    out = [_greedy(target, chunk) for chunk in fed]
    nxt = int(out[-1][1][-1])
    for _ in range(gen_tokens if decoder is None else 0):
        if nxt in stop_ids:
            break
        fed.append([nxt])
        out.append(_greedy(target, [nxt]))
        nxt = int(out[-1][1][-1])
    decode = np.arange(sum(map(len, fed))) >= len(ids) - 1  # greedy[j] is a generated token
    return (np.concatenate([r for r, _ in out]), np.concatenate([np.asarray(f, dtype=np.int64) for f in fed]),
            np.concatenate([g for _, g in out]), decode)


def collect(target, sequences: list[list[int]], *, gen_tokens: int = 64, stop_ids=(), draft=None,
            id_map: np.ndarray | None = None, progress: Callable[[int], None] | None = None,
            clock: Callable[[], float] = time.perf_counter) -> HeadData:
    """Run `target` (the target SharedBodyRuntime of a split pair) over `sequences`: prefill each,
    continue it greedily up to `gen_tokens` tokens (until a stop id). With `draft` (the pair's
    draft, and its `id_map`), the continuations are generated with speculative decoding (prompt
    lookup, else the draft), about twice as fast on Gemma 3 270M, and read back in one pass."""
    if not sequences:
        raise ConfigError("no calibration prompts to make training data from")
    t0 = clock()
    stops = {int(s) for s in stop_ids}
    decoder = None
    if draft is not None:
        from ..decoding import DEFAULT_K, DEFAULT_POLICY, SpeculativeDecoder, make_policy

        decoder = SpeculativeDecoder(target, draft, id_map=id_map, drafter="both",
                                     policy=make_policy(DEFAULT_POLICY, DEFAULT_K))
    parts = []
    for ids in sequences:
        parts.append(_sequence(target, ids, gen_tokens, stops, target.kv_capacity, decoder))
        if progress:
            progress(1)
    target.reset()
    hidden = np.concatenate([p[0] for p in parts])
    segment = np.concatenate([np.full(len(p[1]), i, dtype=np.int32) for i, p in enumerate(parts)])
    data = HeadData(hidden, np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]), segment,
                    np.concatenate([p[3] for p in parts]), clock() - t0)
    logger.info("draft-head data: %d positions of %d sequences in %.1f s", len(data), len(parts), data.seconds)
    return data
