"""The trained draft head (`edgespec distill`, drafter `head`) against the default drafting, interleaved.

    python dev/bench_draft_head.py BUNDLE [--prompts chat,code] [--max-tokens 128] [--repeat 2]
        [--threads 2] [--backend onnxruntime] [--policy cost --k 4] [--json dev/results/draft_head.json]

BUNDLE holds a trained head (its manifest's `draft_head`). One target body with the draft's
VocabTrim head and the trained head (runtimes/onnxruntime/split.py or openvino_split.py, as the
engine opens a draft on the target's body). Configurations, each a decoder on those runtimes
built once and kept for the whole run (policies stay warm, as in a long-lived engine):
  plain    no drafting
  both     the default drafting: prompt lookup, else the self-draft's VocabTrim head on the body
  model    the self-draft alone (a body forward per drafted token)
  head     the trained head alone (the head and the VocabTrim head per drafted token)
every drafting one with the cost policy (the engine's default; `--policy fixed --k 1` measures a
drafter's acceptance where the cost policy would stop drafting it). For each prompt and repeat the
configurations run in a rotating order from empty caches, timed end to end (prefill included);
greedy outputs must equal plain decoding's. Reports per configuration: tok/s (tokens over the
sum of per-prompt median times), the median per-prompt ratio to `both`, acceptance per drafted
token, and the drafter's measured ms per drafted token against a plain step's ms.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import edgespec
from edgespec.bench.machine import library_versions, machine_info
from edgespec.bench.suites import encode_prompt, load_prompts
from edgespec.bundle import load_bundle
from edgespec.decoding import DEFAULT_K, DEFAULT_POLICY, SamplingParams, make_policy
from edgespec.decoding.speculative import SpeculativeDecoder
from edgespec.tokenizer import Tokenizer

CONFIGS = ("plain", "both", "model", "head")


def open_pair(bundle, backend: str, threads: int, pad_rows: bool):
    m = bundle.manifest
    fmt = "onnx" if backend == "onnxruntime" else "openvino"
    head = bundle.file(m.draft_head.file)
    target, draft = bundle.file(m.target.formats[fmt].file), bundle.file(m.draft.formats[fmt].file)
    if backend == "onnxruntime":
        from edgespec.runtimes.onnxruntime.split import open_shared_pair
    else:
        from edgespec.runtimes.openvino.split import open_shared_pair
    return open_shared_pair(target, draft, threads=threads, draft_head=head, pad_rows=pad_rows)


def decoder(name: str, target, draft, id_map, free_width: int, policy: str = DEFAULT_POLICY,
            k: int = DEFAULT_K) -> SpeculativeDecoder:
    if name == "plain":
        return SpeculativeDecoder(target)
    return SpeculativeDecoder(target, draft, id_map=id_map, drafter=name,
                              policy=make_policy(policy, k, free_width=free_width))


def run_once(target, dec, ids: list[int], max_tokens: int, stop_ids) -> dict:
    target.reset()
    tokens = list(ids)
    steps = []
    t0 = time.perf_counter()
    for step in dec.stream(tokens, SamplingParams(), max_tokens, stop_ids=stop_ids):
        steps.append(step)
    total = time.perf_counter() - t0
    plain_ms = [s.verify_ms for s in steps if not s.drafted]
    return {"tokens": tokens[len(ids):], "total_s": total, "steps": len(steps),
            "drafted": sum(s.drafted for s in steps), "accepted": sum(s.accepted for s in steps),
            "draft_ms": sum(s.draft_ms for s in steps), "plain_step_ms": plain_ms,
            "sources": sorted({s.source.split(":")[0] for s in steps if s.source})}


def summarize(runs: dict, prompts) -> dict:
    out = {}
    for name in runs:
        per_prompt = [statistics.median(r["total_s"] for r in runs[name][p.id]) for p in prompts]
        tokens = sum(len(runs[name][p.id][0]["tokens"]) for p in prompts)
        flat = [r for p in prompts for r in runs[name][p.id]]
        drafted = sum(r["drafted"] for r in flat)
        ratios = [statistics.median(r["total_s"] for r in runs["both"][p.id]) /
                  statistics.median(r["total_s"] for r in runs[name][p.id]) for p in prompts]
        plain_ms = [ms for r in flat for ms in r["plain_step_ms"]]
        out[name] = {
            "tok_s": round(tokens / sum(per_prompt), 2),
            "speedup_vs_both_median": round(statistics.median(ratios), 3),
            "acceptance": round(sum(r["accepted"] for r in flat) / drafted, 3) if drafted else None,
            "draft_ms_per_token": round(sum(r["draft_ms"] for r in flat) / drafted, 2) if drafted else None,
            "plain_step_ms_median": round(statistics.median(plain_ms), 2) if plain_ms else None,
            "drafted_per_step": round(drafted / sum(r["steps"] for r in flat), 2),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--prompts", default="chat,code")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", choices=("onnxruntime", "openvino"), default="onnxruntime")
    p.add_argument("--configs", default=",".join(CONFIGS), help="a subset of: " + ", ".join(CONFIGS))
    p.add_argument("--pad-rows", action="store_true",
                   help="the exact mode (no one-row matmuls) the engine settles on where a verify rounds apart")
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"draft policy (default {DEFAULT_POLICY})")
    p.add_argument("--k", type=int, default=DEFAULT_K, help=f"draft length k (default {DEFAULT_K})")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    configs = tuple(c for c in CONFIGS if c in args.configs.split(","))
    if not {"plain", "both"} <= set(configs):
        raise SystemExit("--configs needs plain and both (the references)")
    bundle = load_bundle(args.bundle)
    m = bundle.manifest
    if m.draft_head is None:
        raise SystemExit(f"{args.bundle} has no trained draft head: run `edgespec distill {args.bundle}` first")
    tok = Tokenizer(bundle.file(m.tokenizer.file), m.tokenizer)
    prompts = load_prompts(args.prompts)
    load0 = os.getloadavg()
    target, draft = open_pair(bundle, args.backend, args.threads, args.pad_rows)
    free = max(1, target.capabilities.free_batch_tokens)
    decoders = {name: decoder(name, target, draft, bundle.id_map(), free, args.policy, args.k) for name in configs}
    runs = {name: {pr.id: [] for pr in prompts} for name in configs}
    mismatches = []
    with target, draft:
        for i, pr in enumerate(prompts):
            ids = encode_prompt(tok, pr)
            for rep in range(args.repeat):
                turn = (i + rep) % len(configs)
                order = configs[turn:] + configs[:turn]
                for name in order:
                    runs[name][pr.id].append(run_once(target, decoders[name], ids, args.max_tokens, tok.stop_ids))
            for name in configs:
                if runs[name][pr.id][0]["tokens"] != runs["plain"][pr.id][0]["tokens"]:
                    mismatches.append((name, pr.id))
            print(pr.id, {n: round(statistics.median(r["total_s"] for r in runs[n][pr.id]), 2) for n in configs},
                  flush=True)
    by_suite = {}
    for suite in dict.fromkeys(pr.cls for pr in prompts):
        by_suite[suite] = summarize(runs, [pr for pr in prompts if pr.cls == suite])
    report = {
        "bench": "draft_head", "edgespec": edgespec.__version__, "machine": machine_info(),
        "libraries": library_versions(), "bundle_draft_head": dataclasses.asdict(m.draft_head),
        "backend": args.backend, "threads": args.threads, "max_tokens": args.max_tokens,
        "configs": configs, "pad_rows": args.pad_rows, "policy": args.policy, "k": args.k,
        "repeat": args.repeat, "load_average_before": [round(x, 2) for x in load0],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "identical_to_plain": not mismatches,
        "mismatches": mismatches, "all": summarize(runs, prompts), "by_suite": by_suite,
    }
    print(json.dumps({k: report[k] for k in ("all", "by_suite", "identical_to_plain", "load_average_before",
                                              "load_average_after")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
