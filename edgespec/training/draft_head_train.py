"""Train a draft head (draft_head.py) with torch on the CPU, under a time budget.

Samples come from the target's own rows (draft_head_data.py). Each sample is a chain of two
drafts, as the drafter runs the head: (h_i, x_{i+1}) -> f_1, scored against the target's greedy
token after x_{i+1} (cross-entropy over the K kept tokens, through the frozen VocabTrim head) and
against the target's feature h_{i+1} (EAGLE's feature regression); then (f_1, x_{i+2}) -> f_2,
scored the same way, so the head learns to read its own features too. Every few seconds the
held-out sequences' top-1 agreement is measured and the best weights so far are kept: on a
few thousand positions more training soon overfits. Agreement is scored where the drafter
drafts: on positions whose next token the target generated (inside a prompt, the text is
given and much easier to guess: on Gemma 3 270M 0.57 there against 0.2 on the reply).
"""
from __future__ import annotations

import logging
import math
import resource
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..progress import reporting, task
from .draft_head import EPS, HeadWeights
from .draft_head_data import HeadData, pair_indices

__all__ = ["TrainResult", "train_head", "split_held_out"]

logger = logging.getLogger(__name__)

IGNORE = -100
EVAL_SECONDS = 30.0  # how often the held-out agreement is measured while training...
EVAL_SAMPLES = 1024  # ...on this many held-out samples (K = 16k: ~2 s on 2 cores); the end on all of them
FEATURE_WEIGHT = 1.0  # feature regression against cross-entropy (relative MSE, ~1 at the start)
SECOND_WEIGHT = 0.5  # the chained second draft's losses


@dataclass(frozen=True)
class TrainResult:
    weights: HeadWeights
    agreement: float  # held-out top-1 agreement with the target's greedy token, first draft
    agreement_chained: float  # the same for the second draft, fed the head's own feature
    first_loss: float  # held-out cross-entropy before training
    loss: float  # held-out cross-entropy of the kept weights
    samples: int  # training samples (positions)
    held_out: int  # held-out samples
    steps: int
    seconds: float
    peak_rss_mb: float  # the process's peak resident memory so far (data collection included)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


class TorchHead(nn.Module):
    """draft_head.reference in torch, trainable."""

    def __init__(self, table: np.ndarray, inner: int, g_out: np.ndarray, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        h = table.shape[1]
        self.register_buffer("table", torch.from_numpy(table.astype(np.float16).astype(np.float32)))
        self.g_h, self.g_e, self.g_mlp = (nn.Parameter(torch.ones(h)) for _ in range(3))
        self.fuse = nn.Linear(2 * h, h)
        self.gate, self.up = nn.Linear(h, inner, bias=False), nn.Linear(h, inner, bias=False)
        self.down = nn.Linear(inner, h, bias=False)
        nn.init.zeros_(self.down.weight)  # the block starts as the identity: the fuse alone
        self.g_out = nn.Parameter(torch.from_numpy(g_out.astype(np.float32)))

    def forward(self, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        z = self.fuse(torch.cat([_rms(hidden) * self.g_h, _rms(self.table[token]) * self.g_e], -1))
        n = _rms(z) * self.g_mlp
        z = z + self.down(nn.functional.silu(self.gate(n)) * self.up(n))
        return _rms(z) * self.g_out

    def weights(self) -> HeadWeights:
        def a(t: torch.Tensor) -> np.ndarray:
            return t.detach().numpy().astype(np.float32).copy()
        return HeadWeights(a(self.table), a(self.g_h), a(self.g_e), a(self.fuse.weight.T), a(self.fuse.bias),
                           a(self.g_mlp), a(self.gate.weight.T), a(self.up.weight.T), a(self.down.weight.T),
                           a(self.g_out))


def split_held_out(segment: np.ndarray) -> np.ndarray:
    """(N,) bool: rows of held-out sequences, every fifth (the last one when there are fewer)."""
    n = int(segment.max()) + 1 if len(segment) else 0
    held = segment % 5 == 4 if n >= 5 else segment == n - 1
    return held if n > 1 else np.zeros(len(segment), dtype=bool)


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB on Linux


class _Samples:
    """Chained two-draft samples as tensors: rows i with i+1 and i+2 in the same sequence."""

    def __init__(self, data: HeadData, rows: np.ndarray, index: np.ndarray, k: int) -> None:
        self.hidden = torch.from_numpy(data.hidden)
        self.tok = torch.from_numpy(index[data.tokens])
        lab = index[data.greedy]
        self.lab = torch.from_numpy(np.where(lab >= k, IGNORE, lab))
        self.rows = torch.from_numpy(rows)

    def batch(self, sel: torch.Tensor):
        i = self.rows[sel]
        return (self.hidden[i], self.tok[i + 1], self.lab[i + 1], self.hidden[i + 1],
                self.tok[i + 2], self.lab[i + 2], self.hidden[i + 2])


def _losses(head: TorchHead, out_w: torch.Tensor, scale: float, b) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss of a batch, and per draft its (logits, labels)."""
    h0, t1, y1, h1, t2, y2, h2 = b
    f1 = head(h0, t1)
    f2 = head(f1, t2)
    total, scored = 0.0, []
    for weight, f, y, target in ((1.0, f1, y1, h1), (SECOND_WEIGHT, f2, y2, h2)):
        logits = f @ out_w.T
        ce = nn.functional.cross_entropy(logits, y, ignore_index=IGNORE)
        total = total + weight * (ce + FEATURE_WEIGHT * (f - target).pow(2).mean() / scale)
        scored.append((logits, y))
    return total, scored


def _evaluate(head: TorchHead, out_w: torch.Tensor, scale: float, samples: _Samples) -> tuple[float, float, float]:
    """(cross-entropy of the first draft, agreement of the first and the second draft)."""
    with torch.no_grad():
        _, scored = _losses(head, out_w, scale, samples.batch(torch.arange(len(samples.rows))))
    out = []
    for logits, y in scored:
        ok = y != IGNORE
        out.append(float((logits.argmax(-1)[ok] == y[ok]).float().mean()) if ok.any() else 0.0)
    logits, y = scored[0]
    ce = float(nn.functional.cross_entropy(logits, y, ignore_index=IGNORE)) if (y != IGNORE).any() else 0.0
    return ce, out[0], out[1]


def train_head(data: HeadData, out_w: np.ndarray, index: np.ndarray, *, seconds: float, inner: int | None = None,
               batch: int = 256, lr: float = 2e-3, seed: int = 0, progress: bool | None = None,
               threads: int | None = None, clock: Callable[[], float] = time.perf_counter) -> TrainResult:
    """Train for `seconds` (wall clock, checked every step). out_w: (K, H) the draft's VocabTrim
    head rows (frozen, also the token table); index: target id -> draft index (K: outside).
    threads: torch's intra-op threads while training (None: torch's default)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with reporting(None) if progress is False else nullcontext():  # False: silent, None: as the reporter shows
            return _train(data, out_w, index, seconds, inner, batch, lr, seed, clock)
    finally:
        torch.set_num_threads(before)


def _train(data: HeadData, out_w: np.ndarray, index: np.ndarray, seconds: float, inner: int | None, batch: int,
           lr: float, seed: int, clock: Callable[[], float]) -> TrainResult:
    k, h = out_w.shape
    rows = pair_indices(data.segment, steps=2)
    held = split_held_out(data.segment)[rows]
    train_rows, held_rows = rows[~held], rows[held] if held.any() else rows
    if data.decode[held_rows + 1].any():  # scored where the drafter drafts: after a generated token
        held_rows = held_rows[data.decode[held_rows + 1]]
    if not len(train_rows):
        raise ValueError("too few positions to train a draft head on")
    table = np.concatenate([out_w, np.zeros((1, h), dtype=np.float32)])
    g_out = np.sqrt(np.mean(data.hidden.astype(np.float64) ** 2, axis=0))  # the final norm's scale per dim
    head = TorchHead(table, inner or 2 * h, g_out, seed)
    w = torch.from_numpy(np.ascontiguousarray(out_w, dtype=np.float32))
    scale = float(np.mean(data.hidden.astype(np.float64) ** 2))
    train, held_out = _Samples(data, train_rows, index, k), _Samples(data, held_rows, index, k)
    some = held_rows[np.linspace(0, len(held_rows) - 1, min(EVAL_SAMPLES, len(held_rows))).astype(np.int64)]
    probe = _Samples(data, some, index, k)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    first, best_agree, _ = _evaluate(head, w, scale, held_out)
    best = (first, best_agree, 0.0, head.weights())
    best_probe = -1.0
    t0 = last_eval = clock()
    steps = 0
    with task("training the draft head", total=round(seconds), unit="second") as bar:
        while (now := clock()) - t0 < seconds:
            for group in opt.param_groups:  # cosine decay over the time budget
                group["lr"] = lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min((now - t0) / seconds, 1.0))))
            sel = torch.randint(len(train_rows), (min(batch, len(train_rows)),), generator=gen)
            loss, _ = _losses(head, w, scale, train.batch(sel))
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if clock() - last_eval >= min(EVAL_SECONDS, seconds / 4):
                last_eval = clock()
                ce, agree, agree2 = _evaluate(head, w, scale, probe)
                if agree >= best_probe:  # the best so far on the probe: scored on every held-out sample at the end
                    best_probe, best_state = agree, {n: t.clone() for n, t in head.state_dict().items()}
                bar.set_postfix_str(f"loss {loss.item():.3f}, held-out agreement {agree:.3f}")
            bar.update(min(round(clock() - t0), round(seconds)) - bar.n)
    last = {n: t.clone() for n, t in head.state_dict().items()}
    for state in ([best_state] if best_probe >= 0 else []) + [last]:
        head.load_state_dict(state)
        ce, agree, agree2 = _evaluate(head, w, scale, held_out)
        if agree >= best[1]:
            best = (ce, agree, agree2, head.weights())
    logger.info("draft head: %d steps in %.0f s, held-out agreement %.3f (chained %.3f)", steps, clock() - t0,
                best[1], best[2])
    return TrainResult(best[3], best[1], best[2], first, best[0], len(train_rows), len(held_rows), steps,
                       clock() - t0, _peak_rss_mb())
