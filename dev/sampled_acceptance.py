"""How often a sampled draft is accepted, position by position, on the default bundle: the exact
acceptance probability sum_x min(p(x), q(x)) of the target's and the draft's distributions at the
same sampling settings, and the greedy agreement, over the target's own continuations of the
held-out prompts. A lab script (docs/LOG.md), not a maintained benchmark.

    python dev/sampled_acceptance.py [--tokens 64] [--prompts 12]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import edgespec
from edgespec.decoding import SamplingParams, distribution
from edgespec.decoding.head_drafter import draft_distribution

ROOT = Path(__file__).resolve().parents[1]


def overlap(p, q, vocab: int) -> float:
    return float(np.minimum(p.dense(vocab), q.dense(vocab)).sum())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=12)
    args = ap.parse_args()
    settings = {"chat": SamplingParams(temperature=0.7, top_p=0.95, top_k=40),
                "t1": SamplingParams(temperature=1.0)}
    lines = [json.loads(x) for x in (ROOT / "benchmarks/data/heldout.jsonl").read_text().splitlines()][:args.prompts]
    acc = {k: [] for k in settings}
    agree, subset_diff = [], 0.0
    with edgespec.load(drafter="none") as plain, edgespec.load() as spec:
        id_map = spec.decoder.id_map
        vocab = spec.target.vocab_size
        inverse = np.full(vocab, len(id_map), dtype=np.int64)
        inverse[id_map] = np.arange(len(id_map))
        for obj in lines:
            text = obj.get("text") or obj["messages"][0]["content"]
            ids = plain.tokenizer.encode(text)
            out = [t for r in plain.stream(ids, max_tokens=args.tokens, temperature=0.7, top_p=0.95, top_k=40,
                                           seed=1) for t in r.token_ids]
            seq = ids + out
            spec.target.reset()
            spec.draft.reset()
            full = spec.target.forward(seq, n_logits=len(out))  # rows predicting out[0..]
            spec.draft.reset()
            spec.target.reset()
            draft = spec.draft.forward(seq, n_logits=len(out))
            subset_diff = max(subset_diff, float(np.abs(full[:, id_map] - draft).max()))
            agree += list(np.argmax(full, -1) == id_map[np.argmax(draft, -1)])
            for name, params in settings.items():
                for i in range(len(out)):
                    p = distribution(full[i], params)
                    q = draft_distribution(draft[i], params, id_map, lambda: inverse)
                    acc[name].append(overlap(p, q, vocab))
    print(f"greedy agreement {np.mean(agree):.3f}; max |full[:, id_map] - draft| {subset_diff:.3g}")
    for name, a in acc.items():
        print(f"{name}: mean acceptance probability {np.mean(a):.3f} (median {np.median(a):.3f}, "
              f"10th percentile {np.percentile(a, 10):.3f}) over {len(a)} positions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
