"""Plain vs adaptive speculative decoding per prompt class, interleaved in one process.

    python dev/bench_policies.py [BUNDLE] --max-tokens 128 --repeat 3 [--json out.json]

Prompt classes: chat (Gemma turn format), code (completion), input-grounded (summarise /
rewrite / extract from a given paragraph, turn format). Every configuration (drafter × policy)
shares the engine's target runtime (and its draft runtime), runs in a rotating order after the
others on the same prompt, and is timed end to end (prefill included, so a draft model's own
prefill counts against it). Each configuration keeps one policy object for the whole run, as a
long-lived engine does. Greedy outputs must equal plain decoding's. Reports, per class, the
tok/s of plain and of each configuration (sum of tokens over the sum of per-prompt median
times), the ratio, acceptance, mean draft length and the share of steps drafted by lookup.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from contextlib import ExitStack

import edgespec
from edgespec.decoding import DRAFTERS, SamplingParams, SpeculativeDecoder, make_policy
from edgespec.runtimes import open_runtime

PARAGRAPH = (
    "The printing press was invented by Johannes Gutenberg in Mainz around 1440. His machine used "
    "movable metal type, oil-based ink and a wooden screw press adapted from wine making. By 1500, "
    "printing shops in more than two hundred European cities had produced about twenty million books. "
    "Cheaper books spread literacy, helped the Protestant Reformation and made the scientific "
    "revolution possible."
)
MEETING = (
    "Minutes of the meeting on 3 March: Alice Moreau (chair) opened the meeting at 10:00. Bob Lindqvist "
    "reported that the new warehouse in Rotterdam will open on 15 April, two weeks late because of a "
    "permit delay. Chen Wei presented the budget: spending is 4 percent under plan. The team agreed to "
    "hire two drivers before May. Alice closed the meeting at 11:15; the next meeting is on 7 April."
)
# class -> list of (kind, text); kind "chat" is rendered with the chat template, "raw" is plain text
PROMPTS: dict[str, list[tuple[str, str]]] = {
    "chat": [
        ("chat", "What are three good habits for staying healthy?"),
        ("chat", "Explain why the sky is blue."),
        ("chat", "Write a short story about a robot who learns to paint."),
    ],
    "code": [
        ("raw", "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"),
        ("raw", "class Stack:\n    \"\"\"A LIFO stack.\"\"\"\n\n    def __init__(self):\n        self.items = []\n\n"
                "    def push(self, item):\n        self.items.append(item)\n\n"),
        ("raw", "// Debounce a function in JavaScript.\nfunction debounce(fn, wait) {\n"),
    ],
    "grounded": [
        ("chat", PARAGRAPH + "\n\nSummarise the text above in two sentences."),
        ("chat", "Rewrite the following text in simple words:\n\n" + PARAGRAPH),
        ("chat", MEETING + "\n\nExtract every person, place and date mentioned in the minutes above."),
    ],
}
# name -> (drafter or None for plain decoding, policy)
CONFIGS: dict[str, tuple[str | None, str | None]] = {
    "plain": (None, None),
    "model/fixed": ("model", "fixed"),
    "model/heuristic": ("model", "heuristic"),
    "model/confidence": ("model", "confidence"),
    "model/cost": ("model", "cost"),
    "ngram/fixed": ("ngram", "fixed"),
    "ngram/cost": ("ngram", "cost"),
    "both/cost": ("both", "cost"),
}
# --slow-draft: a second copy of the target as the draft, as dear as the target and always
# accepted, the case where speculation cannot pay: fixed drafting loses, the cost policy must not
SLOW_CONFIGS = {"slow-draft/fixed": ("model", "fixed"), "slow-draft/cost": ("model", "cost")}


def encode(engine, kind: str, text: str) -> list[int]:
    if kind == "chat":
        return engine.tokenizer.encode_chat([{"role": "user", "content": text}])
    return engine.tokenizer.encode(text)


def run_once(engine, ids: list[int], drafter: str | None, policy, max_tokens: int, draft=None) -> dict:
    """One generation from empty caches, timed from prefill to the last token."""
    uses_model = drafter is not None and DRAFTERS[drafter].needs_model
    draft = (draft or engine.draft) if uses_model else None
    for rt in filter(None, (engine.target, draft)):
        rt.reset()
    id_map = engine.bundle.id_map() if draft is engine.draft else None
    dec = SpeculativeDecoder(engine.target, draft, id_map=id_map if uses_model else None, drafter=drafter,
                             policy=policy)
    tokens = list(ids)
    steps = []
    t0 = time.perf_counter()
    for step in dec.stream(tokens, SamplingParams(), max_tokens, stop_ids=engine.tokenizer.stop_ids):
        steps.append(step)
    total = time.perf_counter() - t0
    return {"tokens": tokens[len(ids):], "total_s": total, "steps": len(steps),
            "drafted": sum(s.drafted for s in steps), "accepted": sum(s.accepted for s in steps),
            "ks": [s.drafted for s in steps], "lookup_steps": sum(s.source.startswith("ngram") for s in steps)}


def summarise(runs: dict, classes: list[str], configs: list[str]) -> list[dict]:
    """Per class and configuration: tok/s from per-prompt median times, ratio to plain, acceptance."""
    rows = []
    for cls in classes:
        base = None
        for name in configs:
            per_prompt = [runs[(name, cls, i)] for i in range(len(PROMPTS[cls]))]
            n_tok = sum(len(rs[0]["tokens"]) for rs in per_prompt)
            secs = sum(statistics.median(r["total_s"] for r in rs) for rs in per_prompt)
            flat = [r for rs in per_prompt for r in rs]
            drafted, accepted = sum(r["drafted"] for r in flat), sum(r["accepted"] for r in flat)
            steps = sum(r["steps"] for r in flat)
            rate = n_tok / secs
            base = rate if name == "plain" else base
            same = all(r["tokens"] == runs[("plain", cls, i)][0]["tokens"]
                       for i, rs in enumerate(per_prompt) for r in rs)
            rows.append({"class": cls, "config": name, "tokens": n_tok, "tok_s": rate,
                         "ratio": rate / base if base else float("nan"),
                         "acceptance": accepted / drafted if drafted else 0.0,
                         "mean_k": drafted / steps, "lookup_share": sum(r["lookup_steps"] for r in flat) / steps,
                         "tokens_per_step": sum(len(r["tokens"]) for r in flat) / steps, "identical": same})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-k", type=int, default=4, help="draft length (adaptive policies range up to 2k)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--classes", default=",".join(PROMPTS))
    ap.add_argument("--slow-draft", action="store_true", help="also run with a copy of the target as the draft")
    ap.add_argument("--json", default=None, help="also write every run here")
    args = ap.parse_args()
    configs = ["plain"] + [c for c in args.configs.split(",") if c != "plain"]
    if args.slow_draft:
        CONFIGS.update(SLOW_CONFIGS)
        configs += list(SLOW_CONFIGS)
    classes = args.classes.split(",")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; python {platform.python_version()}")
    with edgespec.load(args.bundle, drafter="model", threads=args.threads) as engine, ExitStack() as stack:
        target_file = engine.bundle.file(engine.bundle.manifest.target.formats["onnx"].file)
        slow = stack.enter_context(open_runtime("onnxruntime", target_file, threads=args.threads)) \
            if args.slow_draft else None
        drafts = {name: slow if name in SLOW_CONFIGS else None for name in CONFIGS}
        policies = {name: make_policy(pol, args.k) if drafter else None for name, (drafter, pol) in CONFIGS.items()}
        prompts = {cls: [encode(engine, kind, text) for kind, text in PROMPTS[cls]] for cls in classes}
        for name in configs:  # warm-up: onnxruntime's first runs, and the cost policies' first measurements
            run_once(engine, prompts[classes[0]][0], CONFIGS[name][0], policies[name], 24, drafts[name])
        runs: dict = {}
        t_start = time.perf_counter()
        for rep in range(args.repeat):
            for cls in classes:
                for i, ids in enumerate(prompts[cls]):
                    shift = rep + i  # rotate the order so no configuration always runs first
                    for name in configs[shift % len(configs):] + configs[: shift % len(configs)]:
                        r = run_once(engine, ids, CONFIGS[name][0], policies[name], args.max_tokens, drafts[name])
                        runs.setdefault((name, cls, i), []).append(r)
            print(f"repeat {rep + 1}/{args.repeat} done after {time.perf_counter() - t_start:.0f} s", flush=True)
    rows = summarise(runs, classes, configs)
    for name in configs:  # what the adaptive policies learned about this machine
        if hasattr(policies[name], "snapshot"):
            print(f"{name}: {policies[name].snapshot()}")
    print(f"load at the end {os.getloadavg()[0]:.1f}; max {args.max_tokens} new tokens, k = {args.k}, "
          f"median of {args.repeat} interleaved repeats")
    print(f"{'class':<9} {'config':<17} {'tokens':>6} {'tok/s':>6} {'ratio':>6} {'accept':>6} {'mean k':>6} "
          f"{'tok/step':>8} {'lookup':>6} identical")
    for r in rows:
        print(f"{r['class']:<9} {r['config']:<17} {r['tokens']:>6} {r['tok_s']:>6.1f} {r['ratio']:>6.2f} "
              f"{r['acceptance']:>6.0%} {r['mean_k']:>6.2f} {r['tokens_per_step']:>8.2f} {r['lookup_share']:>6.0%} "
              f"{r['identical']}")
    if not all(r["identical"] for r in rows):
        print("ERROR: a configuration's greedy output differs from plain decoding")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "runs": {"|".join(map(str, k)): v for k, v in runs.items()}}, f)


if __name__ == "__main__":
    main()
