"""Token Recycling against plain decoding, prompt lookup and the default drafting, interleaved.

Configurations: plain; recycle (Token Recycling alone); ngram (prompt lookup alone);
lookup-recycle (lookup, else recycling); both (lookup, else the draft model: the default);
both-recycle (lookup, else recycling, else the draft model). Every one but plain uses the cost
policy, as the engine does by default.

    python dev/bench_recycling.py BUNDLE [--prompts chat] [--max-tokens 128] [--repeat 2]
        [--threads 2] [--json dev/results/recycling.json]

One engine (onnxruntime by default); each configuration is a decoder variant on its runtimes
(Engine.variant), built once and kept for the whole run, as a long-lived engine keeps its decoder:
the recycling table and every policy start empty at the first prompt and stay warm after it.
For each prompt and repeat the configurations run in a rotating order, each from empty caches,
timed end to end (prefill included). Greedy outputs must equal plain decoding's. Reports per
configuration: tok/s (tokens over the sum of per-prompt median times), the median of the
per-prompt paired ratios to plain, acceptance per drafted token, mean draft length per step, the
share of steps that drafted; and what a top-k of the target's logits costs (the table update).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

import edgespec
from edgespec.bench.machine import library_versions, machine_info
from edgespec.bench.suites import encode_prompt, load_prompts
from edgespec.decoding import SamplingParams
from edgespec.decoding.recycling import SUCCESSORS, top_successors

CONFIGS = {"plain": None, "recycle": "recycle", "ngram": "ngram", "lookup-recycle": "lookup-recycle", "both": "both",
           "both-recycle": "both-recycle"}


def run_once(engine, decoder, ids: list[int], max_tokens: int) -> dict:
    """One generation from empty caches, timed from prefill to the last token."""
    for rt in filter(None, (engine.target, engine.draft)):
        rt.reset()
    tokens = list(ids)
    steps = []
    t0 = time.perf_counter()
    for step in decoder.stream(tokens, SamplingParams(), max_tokens, stop_ids=engine.tokenizer.stop_ids):
        steps.append(step)
    return {"tokens": tokens[len(ids):], "total_s": time.perf_counter() - t0, "steps": len(steps),
            "drafted": sum(s.drafted for s in steps), "accepted": sum(s.accepted for s in steps),
            "drafting_steps": sum(s.drafted > 0 for s in steps),
            "sources": sorted({s.source.split(":")[0] for s in steps if s.source})}


def topk_cost(engine, ids: list[int], rows: int = 5, repeat: int = 50) -> dict:
    """ms per logits row of the table's top-k (top_successors) against np.argpartition, on real logits."""
    engine.target.reset()
    logits = np.array(engine.target.forward(ids[:64], n_logits=rows))
    engine.target.reset()

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(1e3 * statistics.median(times) / rows, 4)

    k = SUCCESSORS
    return {"rows": rows, "vocab": logits.shape[1], "k": k,
            "top_successors_ms_per_row": median_ms(lambda: top_successors(logits, k)),
            "argpartition_ms_per_row": median_ms(lambda: np.argpartition(logits, -k, axis=1)[:, -k:])}


def summarise(runs: dict, prompts: list, configs: list[str]) -> list[dict]:
    rows = []
    for name in configs:
        per_prompt = [runs[(name, p.id)] for p in prompts]
        flat = [r for rs in per_prompt for r in rs]
        n_tok = sum(len(rs[0]["tokens"]) for rs in per_prompt)
        secs = sum(statistics.median(r["total_s"] for r in rs) for rs in per_prompt)
        paired = [statistics.median(r["total_s"] for r in runs[("plain", p.id)]) / statistics.median(
            r["total_s"] for r in runs[(name, p.id)]) for p in prompts]
        drafted, accepted, steps = (sum(r[key] for r in flat) for key in ("drafted", "accepted", "steps"))
        rows.append({"config": name, "tokens": n_tok, "tok_s": round(n_tok / secs, 2),
                     "paired_ratio_median": round(statistics.median(paired), 3),
                     "paired_ratios": [round(x, 3) for x in paired],
                     "acceptance": round(accepted / drafted, 3) if drafted else None,
                     "mean_draft_per_step": round(drafted / steps, 2),
                     "drafting_share": round(sum(r["drafting_steps"] for r in flat) / steps, 3),
                     "tokens_per_step": round(sum(len(r["tokens"]) for r in flat) / steps, 2),
                     "identical_to_plain": all(r["tokens"] == runs[("plain", p.id)][0]["tokens"]
                                               for p in prompts for r in runs[(name, p.id)])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--prompts", default="chat", help="suite names or a .jsonl file (edgespec bench --prompts)")
    ap.add_argument("--backend", default="onnxruntime")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    configs = ["plain"] + [c for c in args.configs.split(",") if c != "plain"]
    prompts = load_prompts(args.prompts)
    load_before = os.getloadavg()
    with edgespec.load(args.bundle, backend=args.backend, threads=args.threads) as engine:
        decoders = {name: engine.variant(plain=CONFIGS[name] is None, drafter=CONFIGS[name]) for name in configs}
        runs: dict = {}
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(engine.tokenizer, prompt)
            for rep in range(args.repeat):
                shift = (i * args.repeat + rep) % len(configs)
                for name in configs[shift:] + configs[:shift]:
                    r = run_once(engine, decoders[name], ids, args.max_tokens)
                    runs.setdefault((name, prompt.id), []).append(r)
                    print(f"{prompt.id} #{rep} {name}: {len(r['tokens']) / r['total_s']:.1f} tok/s, "
                          f"{r['accepted']}/{r['drafted']} accepted over {r['steps']} steps", flush=True)
        cost = topk_cost(engine, encode_prompt(engine.tokenizer, prompts[0]))
        table = decoders["recycle"].drafter.table if "recycle" in decoders else None
        rows = summarise(runs, prompts, configs)
        report = {
            "machine": {**machine_info(), "loadavg_before": [round(x, 2) for x in load_before],
                        "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
            "versions": library_versions(),
            "engine": {k: v for k, v in engine.describe().items() if k in ("bundle", "target", "draft", "draft_body",
                                                                           "drafter", "policy", "k")},
            "threads": args.threads, "prompts": args.prompts, "n_prompts": len(prompts),
            "max_tokens": args.max_tokens, "repeat": args.repeat, "topk_cost": cost,
            "recycle_table_rows_filled": None if table is None else int((table.rows[:, 0] >= 0).sum()),
            "results": rows,
            "policies": {name: d.policy.snapshot() for name, d in decoders.items()
                         if hasattr(d.policy, "snapshot") and name != "plain"},
        }
    for row in rows:
        print(f"{row['config']:>8}: {row['tok_s']:6.2f} tok/s, paired x{row['paired_ratio_median']:.2f}, "
              f"acc {row['acceptance']}, draft/step {row['mean_draft_per_step']}, "
              f"identical {row['identical_to_plain']}")
    print(f"top-k per logits row: {cost}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
