"""How often a sampled draft is kept: rejection sampling against coupled sampling (draws.py).

Rejection sampling keeps a draft drawn from q with probability sum(min(p, q)); coupled sampling
(the draft and the target race the same keyed noise; a draft is kept when it is the target's own
draw) keeps it with the probability that both races have one winner, at least (1 - d) / (1 + d)
for d = TV(p, q), equal to rejection sampling's where q is p on a subset (a VocabTrim head on the
target's body). This measures both on an engine's own rows: along a greedy continuation of each
prompt, the target's row p and the draft's row q at the same position, under a sampler.

    python dev/coupled_acceptance.py [BUNDLE] [--backend B] [--draft-body shared|own] [--prompts N]

Prints, per sampler, the mean of sum(min(p, q)) and the coupled estimate (SEEDS races per row)."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import edgespec
from edgespec.bench.suites import load_prompts
from edgespec.decoding import Draws, SamplingParams
from edgespec.decoding.head_drafter import draft_distribution, draft_index

SAMPLERS = {"temperature 1": SamplingParams(temperature=1.0),
            "chat (0.7, top-p 0.95, top-k 40)": SamplingParams(temperature=0.7, top_p=0.95, top_k=40),
            "temperature 0.8": SamplingParams(temperature=0.8)}
SEEDS = 200
POSITIONS = 12  # rows per prompt, along its greedy continuation


def rows(engine, ids: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(target rows, draft rows) of the n positions after `ids` and its greedy continuation."""
    tokens = list(ids)
    for _ in engine.decoder.stream(tokens, SamplingParams(), n):
        pass
    seq = tokens[:len(ids) + n - 1]
    out = []
    for rt in (engine.target, engine.draft):
        rt.reset()
        out.append(np.array(rt.forward(seq, n_logits=n), dtype=np.float32))
        rt.reset()
    return out[0], out[1]


def rates(p_dist, q_dist, vocab: int, position_seed: int) -> tuple[float, float]:
    """(sum(min(p, q)), the share of SEEDS noises on which both races have one winner)."""
    ids = np.union1d(np.flatnonzero(p_dist.dense(vocab)), np.flatnonzero(q_dist.dense(vocab)))
    overlap = float(np.minimum(p_dist.probs_at(ids), q_dist.probs_at(ids)).sum())
    same = sum(p_dist.sample(n) == q_dist.sample(n) for n in (Draws(position_seed + s).at(0) for s in range(SEEDS)))
    return overlap, same / SEEDS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--backend")
    ap.add_argument("--draft-body", default="auto")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    prompts = [p for suite in ("chat", "code", "grounded") for p in load_prompts(suite)][::3][:a.prompts]
    t0 = time.perf_counter()
    with edgespec.load(a.bundle, backend=a.backend, draft_body=a.draft_body, drafter="model") as engine:
        assert engine.draft is not None, "the engine opened no draft model"
        id_map = engine.bundle.id_map()
        vocab = engine.target.vocab_size
        index = draft_index(id_map, vocab) if id_map is not None else None
        found = {name: ([], []) for name in SAMPLERS}
        chat = engine.chat().format
        for i, prompt in enumerate(prompts):
            messages = [{"role": role, "content": content} for role, content in prompt.messages]
            ids = chat.encode(engine.tokenizer, messages) if prompt.is_chat else engine.tokenizer.encode(prompt.text)
            p_rows, q_rows = rows(engine, ids, POSITIONS)
            for name, params in SAMPLERS.items():
                for j, (p_row, q_row) in enumerate(zip(p_rows, q_rows)):
                    p = edgespec.decoding.distribution(p_row, params)
                    q = draft_distribution(q_row, params, id_map, lambda: index)
                    overlap, same = rates(p, q, vocab, 1000 * i + 100 * j)
                    found[name][0].append(overlap)
                    found[name][1].append(same)
        report = {"bundle": engine.bundle.path.name, "backend": engine.backend, "draft_body": engine.plan.draft_body,
                  "rows": len(prompts) * POSITIONS, "seeds_per_row": SEEDS,
                  "samplers": {name: {"rejection": float(np.mean(o)), "coupled": float(np.mean(c))}
                               for name, (o, c) in found.items()},
                  "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(report, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
