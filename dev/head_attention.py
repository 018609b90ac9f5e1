"""Would attention help the trained draft head? (issue 23: measured, not adopted)

    python dev/head_attention.py BUNDLE [--calibration benchmarks/data/draft_head_prompts.jsonl]
        [--gen-tokens 448] [--seconds 900] [--window 32] [--data FILE.npz]
        [--out dev/results/head_attention.json]

The shipped head (training/draft_head.py) reads one row: the target's feature h_t and the next
token x_{t+1}, fused, then a gated MLP. EAGLE's draft is a decoder layer: the same fuse, then
causal self-attention over the earlier positions' fused inputs, then the MLP. This trains both on
the same data (`edgespec distill`'s own collection, saved to --data and reused) under the same
wall-clock budget, one torch thread each, in two processes side by side (2 cores), and scores
both on the same held-out sequences where the drafter drafts (positions whose next token the
target generated): the first draft, and the second fed the head's own feature. Train-set
agreement is reported too: the gap between the two is overfitting.

The attention variant: 5 heads of 128, RoPE on in-window positions, keys within the last
`--window` positions (the shared body keeps 64 rows, so a drafter could read them for free),
trained on 96-position chunks; its chained draft attends to the true keys and its own.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

HEADS, HEAD_DIM, CHUNK = 5, 128, 96


def collect_data(bundle_path: Path, calibration: Path | None, gen_tokens: int, out: Path) -> None:
    """distill's data collection (onnxruntime, the target itself), saved as .npz."""
    from edgespec.bundle import load_bundle
    from edgespec.runtimes.onnxruntime.split import open_shared_pair
    from edgespec.tokenizer import Tokenizer
    from edgespec.training.distill import DistillConfig, _files, _prompts
    from edgespec.training.draft_head import draft_index
    from edgespec.training.draft_head_data import collect, head_matrix, prompt_ids

    bundle = load_bundle(bundle_path)
    m = bundle.manifest
    target_path, draft_path = _files(bundle)
    prompts, _ = _prompts(DistillConfig(bundle.path, calibration=calibration))
    sequences = prompt_ids(Tokenizer(bundle.file(m.tokenizer.file), m.tokenizer), prompts)
    target, draft = open_shared_pair(target_path, draft_path, threads=2)
    with target, draft:
        data = collect(target, sequences, gen_tokens=gen_tokens, stop_ids=m.tokenizer.stop_token_ids, draft=draft,
                       id_map=bundle.id_map())
        out_w = head_matrix(draft.head, draft.head.hidden_size)
    np.savez(out, hidden=data.hidden, tokens=data.tokens, greedy=data.greedy, segment=data.segment,
             decode=data.decode, out_w=out_w, index=draft_index(bundle.id_map(), m.target.vocab_size),
             seconds=data.seconds)


def _load(path: Path):
    from edgespec.training.draft_head_data import HeadData

    d = np.load(path)
    return HeadData(d["hidden"], d["tokens"], d["greedy"], d["segment"], d["decode"]), d["out_w"], d["index"]


def _agreement(logits_fn, hidden, tokens, labels, rows) -> float:
    """Top-1 agreement of the first draft over `rows` (i: (h_i, x_{i+1}) -> greedy_{i+1})."""
    hits = [int(np.sum(np.argmax(logits_fn(hidden[i], tokens[i + 1]), -1) == labels[i + 1]))
            for i in np.array_split(rows, max(1, len(rows) // 2048))]
    return sum(hits) / max(len(rows), 1)


def run_current(data_path: Path, seconds: float) -> dict:
    """The shipped head, trained by the shipped trainer."""
    import torch

    from edgespec.training.draft_head import reference
    from edgespec.training.draft_head_data import pair_indices
    from edgespec.training.draft_head_train import split_held_out, train_head

    torch.set_num_threads(1)
    data, out_w, index = _load(data_path)
    r = train_head(data, out_w, index, seconds=seconds, progress=False)
    k = out_w.shape[0]
    labels = np.where(index[data.greedy] >= k, -1, index[data.greedy])
    rows = pair_indices(data.segment)
    train = rows[~split_held_out(data.segment)[rows]]
    train = train[data.decode[train + 1]]
    train = train[np.linspace(0, len(train) - 1, min(8192, len(train))).astype(np.int64)]
    fn = lambda h, t: reference(r.weights, h, index[t]) @ out_w.T  # noqa: E731
    return {"variant": "current", "held_out_agreement": r.agreement, "held_out_agreement_chained": r.agreement_chained,
            "train_agreement": _agreement(fn, data.hidden, data.tokens, labels, train), "steps": r.steps,
            "train_positions": r.samples, "held_out_positions": r.held_out, "seconds": r.seconds}


def run_attention(data_path: Path, seconds: float, window: int, seed: int = 0) -> dict:
    """The same fuse and MLP with a causal self-attention layer between them, trained here."""
    import torch
    from torch import nn

    from edgespec.training.draft_head_train import IGNORE, _rms, split_held_out

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    data, out_w, index = _load(data_path)
    k, h = out_w.shape

    class AttentionHead(nn.Module):
        def __init__(self, table: np.ndarray, g_out: np.ndarray) -> None:
            super().__init__()
            self.register_buffer("table", torch.from_numpy(table))
            self.g_h, self.g_e, self.g_att, self.g_mlp = (nn.Parameter(torch.ones(h)) for _ in range(4))
            self.fuse = nn.Linear(2 * h, h)
            self.q, self.k, self.v = (nn.Linear(h, HEADS * HEAD_DIM, bias=False) for _ in range(3))
            self.o = nn.Linear(HEADS * HEAD_DIM, h, bias=False)
            self.gate, self.up = nn.Linear(h, 2 * h, bias=False), nn.Linear(h, 2 * h, bias=False)
            self.down = nn.Linear(2 * h, h, bias=False)
            for layer in (self.o, self.down):  # each block starts as the identity, as the shipped head's MLP
                nn.init.zeros_(layer.weight)
            self.g_out = nn.Parameter(torch.from_numpy(g_out.astype(np.float32)))
            self.register_buffer("inv", 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))

        def fused(self, hidden, token):
            return self.fuse(torch.cat([_rms(hidden) * self.g_h, _rms(self.table[token]) * self.g_e], -1))

        def _split(self, x, pos, rope: bool):
            b, t, _ = x.shape
            x = x.view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
            if not rope:
                return x
            ang = pos[:, None].float() * self.inv[None]
            x1, x2 = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
            return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)

        def keys(self, z, pos):
            n = _rms(z) * self.g_att
            return self._split(self.k(n), pos, True), self._split(self.v(n), pos, False)

        def feature(self, z, pos, keys, values, mask):
            n = _rms(z) * self.g_att
            q = self._split(self.q(n), pos, True)
            att = (q @ keys.transpose(-1, -2) / math.sqrt(HEAD_DIM)).masked_fill(~mask, float("-inf")).softmax(-1)
            z = z + self.o((att @ values).transpose(1, 2).reshape(z.shape[0], z.shape[1], HEADS * HEAD_DIM))
            n = _rms(z) * self.g_mlp
            return _rms(z + self.down(nn.functional.silu(self.gate(n)) * self.up(n))) * self.g_out

    table = np.concatenate([out_w, np.zeros((1, h), np.float32)]).astype(np.float16).astype(np.float32)
    head = AttentionHead(table, np.sqrt(np.mean(data.hidden.astype(np.float64) ** 2, axis=0)))
    w = torch.from_numpy(np.ascontiguousarray(out_w, dtype=np.float32))
    scale = float(np.mean(data.hidden.astype(np.float64) ** 2))
    hid, tok = torch.from_numpy(data.hidden), torch.from_numpy(index[data.tokens])
    lab = torch.from_numpy(np.where(index[data.greedy] >= k, IGNORE, index[data.greedy]))
    dec, seg = torch.from_numpy(data.decode), data.segment
    held_seq = split_held_out(seg)
    pos = torch.arange(CHUNK)
    band = (pos[None] <= pos[:, None]) & (pos[:, None] - pos[None] < window)
    band2 = torch.cat([band, torch.eye(CHUNK, dtype=torch.bool)], 1)  # chained: true keys and its own

    def chunks(held: bool) -> np.ndarray:
        starts = []
        for s in np.unique(seg):
            idx = np.flatnonzero(seg == s)
            if bool(held_seq[idx[0]]) == held and len(idx) >= 8:
                last = max(idx[0], idx[-1] - CHUNK - 1)
                starts += [*range(idx[0], last + 1, CHUNK if held else CHUNK // 2), last]
        return np.array(sorted(set(starts)))

    def forward(starts: np.ndarray, scored: bool):
        ii = torch.from_numpy(np.minimum(starts[:, None] + np.arange(CHUNK + 2)[None], len(seg) - 1))
        same = torch.from_numpy(seg)[ii] == torch.from_numpy(seg)[ii[:, :1]]
        z = head.fused(hid[ii[:, :CHUNK]], tok[ii[:, 1:CHUNK + 1]])
        keys, values = head.keys(z, pos)
        f1 = head.feature(z, pos, keys, values, band)
        z2 = head.fused(f1, tok[ii[:, 2:]])
        k2, v2 = head.keys(z2, pos + 1)
        f2 = head.feature(z2, pos + 1, torch.cat([keys, k2], 2), torch.cat([values, v2], 2), band2)
        out = []
        for f, sl in ((f1, slice(1, CHUNK + 1)), (f2, slice(2, CHUNK + 2))):
            keep = same[:, sl] & (dec[ii[:, sl]] if scored else True)
            out.append((f, lab[ii[:, sl]].masked_fill(~keep, IGNORE), hid[ii[:, sl]]))
        return out

    def agreement(starts: np.ndarray) -> list[float]:
        hits, total = [0, 0], [0, 0]
        with torch.no_grad():
            for i in range(0, len(starts), 16):
                for j, (f, y, _) in enumerate(forward(starts[i:i + 16], True)):
                    ok = y != IGNORE
                    hits[j] += int((((f @ w.T).argmax(-1) == y) & ok).sum())
                    total[j] += int(ok.sum())
        return [a / max(b, 1) for a, b in zip(hits, total)]

    train, held = chunks(False), chunks(True)
    opt = torch.optim.AdamW(head.parameters(), lr=2e-3, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    best, best_state, steps = -1.0, None, 0
    t0 = last = time.perf_counter()
    while (now := time.perf_counter()) - t0 < seconds:
        for group in opt.param_groups:  # the shipped trainer's cosine schedule
            group["lr"] = 2e-3 * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min((now - t0) / seconds, 1.0))))
        loss = 0.0
        for weight, (f, y, target) in zip((1.0, 0.5), forward(train[rng.integers(0, len(train), 8)], False)):
            ok = y != IGNORE
            ce = nn.functional.cross_entropy((f @ w.T).reshape(-1, k), y.reshape(-1), ignore_index=IGNORE)
            regress = ((f - target).pow(2).mean(-1) * ok).sum() / ok.sum().clamp(min=1) / scale
            loss = loss + weight * (ce + regress)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if time.perf_counter() - last > 60:  # keep the best held-out weights, as the shipped trainer does
            last = time.perf_counter()
            score = agreement(held)[0]
            if score > best:
                best, best_state = score, {n: t.clone() for n, t in head.state_dict().items()}
    if best_state is not None and agreement(held)[0] < best:
        head.load_state_dict(best_state)
    first, chained = agreement(held)
    return {"variant": f"attention, window {window}", "held_out_agreement": first,
            "held_out_agreement_chained": chained, "train_agreement": agreement(train[::4])[0], "steps": steps,
            "train_chunks": len(train), "held_out_chunks": len(held), "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--calibration", type=Path,
                    default=Path(__file__).parents[1] / "benchmarks" / "data" / "draft_head_prompts.jsonl")
    ap.add_argument("--gen-tokens", type=int, default=448)
    ap.add_argument("--seconds", type=float, default=900.0)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--data", type=Path, default=None,
                    help="the collected data (.npz): read if it exists, else made and kept there")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:  # without --data, the data (~180 MB) lives only for the run
        data = a.data or Path(tmp) / "head_data.npz"
        if not data.exists():
            collect_data(a.bundle, a.calibration, a.gen_tokens, data)
        positions = int(len(np.load(data)["tokens"]))
        with ProcessPoolExecutor(2) as pool:  # side by side: the same machine load for both
            jobs = [pool.submit(run_current, data, a.seconds), pool.submit(run_attention, data, a.seconds, a.window)]
            results = [j.result() for j in jobs]
    from edgespec.bench.machine import machine_info

    report = {"machine": machine_info(), "seconds": a.seconds, "threads_each": 1, "gen_tokens": a.gen_tokens,
              "positions": positions, "results": results}
    for r in results:
        print(f"{r['variant']:>22}: held-out {r['held_out_agreement']:.3f} (chained "
              f"{r['held_out_agreement_chained']:.3f}), train {r['train_agreement']:.3f}, {r['steps']} steps")
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
