"""Overlapped drafting (PEARL post-verify, decoding/overlap.py) vs the sequential loop, interleaved.

    nice -n 10 python dev/overlap/bench_overlap.py [BUNDLE] --max-tokens 48 --repeat 2 [--threads 1] [--json out.json]

The default bundle with the draft on its own body (`draft_body="own"`): draft and target are two
onnxruntime sessions with their own caches, so the verify can run in a worker thread while the
draft model drafts. Every configuration shares the engine's runtimes, starts from empty caches,
is timed end to end (prefill included) and runs in a rotating order on each prompt; each keeps
one decoder (and its policy) for the whole run, as a long-lived engine does. Greedy outputs must
equal plain decoding's. Reports tok/s (tokens over the sum of per-prompt median times), the
ratio to plain, acceptance, and for the overlapped runs the share of steps whose draft was made
during the previous verify.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time

import edgespec
from edgespec.decoding import SamplingParams, SpeculativeDecoder, make_policy
from edgespec.decoding.overlap import OverlappedDecoder

PROMPTS = [
    ("chat", "Explain why the sky is blue."),
    ("chat", "What are three good habits for staying healthy?"),
    ("raw", "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"),
]
# name -> (decoder class or None for plain decoding, policy)
CONFIGS = {
    "plain": (None, None),
    "sequential/fixed": (SpeculativeDecoder, "fixed"),
    "overlap/fixed": (OverlappedDecoder, "fixed"),
    "sequential/cost": (SpeculativeDecoder, "cost"),
    "overlap/cost": (OverlappedDecoder, "cost"),
}


def encode(engine, kind: str, text: str) -> list[int]:
    if kind == "chat":
        return engine.tokenizer.encode_chat([{"role": "user", "content": text}])
    return engine.tokenizer.encode(text)


def build(engine, cls, policy: str | None, k: int):
    if cls is None:
        return SpeculativeDecoder(engine.target, limits=engine.opened.limits)
    return cls(engine.target, engine.draft, id_map=engine.bundle.id_map(), drafter="model",
               policy=make_policy(policy, k), limits=engine.opened.limits)


def run_once(engine, dec, ids: list[int], max_tokens: int) -> dict:
    """One generation from empty caches, timed from prefill to the last token."""
    for rt in (engine.target, engine.draft):
        rt.reset()
    before = getattr(dec, "overlap", None)
    ahead0 = before.steps_ahead if before is not None else 0
    tokens, steps = list(ids), []
    t0 = time.perf_counter()
    for step in dec.stream(tokens, SamplingParams(), max_tokens, stop_ids=engine.tokenizer.stop_ids):
        steps.append(step)
    total = time.perf_counter() - t0
    return {"tokens": tokens[len(ids):], "total_s": total, "steps": len(steps),
            "drafted": sum(s.drafted for s in steps), "accepted": sum(s.accepted for s in steps),
            "steps_ahead": (dec.overlap.steps_ahead - ahead0) if before is not None else 0}


def phase_costs(engine, ids: list[int], k: int, n: int = 15) -> dict[str, float]:
    """Median ms of a (k+1)-wide target verify alone, of k+1 one-token draft forwards alone, and of
    both at once (the verify in a thread, the drafts on the caller's), after the prompt's prefill:
    whether the two models really compute in parallel here."""
    for rt in (engine.target, engine.draft):
        rt.reset()
        rt.forward(ids, n_logits=1)
    base_t, base_d = engine.target.n_past, engine.draft.n_past
    extra = ids[-(k + 1):]

    def verify() -> None:
        engine.target.forward(extra, n_logits=k + 1)
        engine.target.trim(base_t)

    def drafts() -> None:
        for t in extra:
            engine.draft.forward([t], n_logits=1)
        engine.draft.trim(base_d)

    def both() -> None:
        worker = threading.Thread(target=verify)
        worker.start()
        drafts()
        worker.join()

    out = {}
    for name, fn in (("verify", verify), ("drafts", drafts), ("both", both)):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; python {platform.python_version()}; "
          f"threads {args.threads or 'default'}")
    with edgespec.load(args.bundle, drafter="model", draft_body="own", threads=args.threads, tune=False) as engine:
        assert engine.draft is not None and not engine.shared_body, "needs the draft on its own body"
        decoders = {name: build(engine, cls, pol, args.k) for name, (cls, pol) in CONFIGS.items()}
        prompts = [encode(engine, kind, text) for kind, text in PROMPTS]
        runs: dict[str, list[list[dict]]] = {name: [[] for _ in prompts] for name in CONFIGS}
        names = list(CONFIGS)
        for rep in range(args.repeat):
            for i, ids in enumerate(prompts):
                shift = (rep * len(prompts) + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    runs[name][i].append(run_once(engine, decoders[name], ids, args.max_tokens))
        report = summarise(runs)
        phases = phase_costs(engine, prompts[0], args.k)
    print(f"load at the end {os.getloadavg()[0]:.1f}; max {args.max_tokens} new tokens, k = {args.k}, "
          f"verify width limit {engine.opened.limits.verify_width}")
    print(f"{'config':<18}{'tok/s':>8}{'x plain':>9}{'accept':>8}{'ahead':>7}")
    for name, r in report.items():
        print(f"{name:<18}{r['tok_s']:>8.1f}{r['ratio']:>9.2f}{r['acceptance']:>8.2f}{r['ahead_share']:>7.2f}")
    print(f"phases (median ms): verify of {args.k + 1} rows {phases['verify']:.1f}, {args.k + 1} draft forwards "
          f"{phases['drafts']:.1f}, both at once {phases['both']:.1f} (sequential sum "
          f"{phases['verify'] + phases['drafts']:.1f}, ideal overlap {max(phases['verify'], phases['drafts']):.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "max_tokens": args.max_tokens, "k": args.k, "report": report,
                       "phases_ms": phases}, f, indent=1)


def summarise(runs: dict[str, list[list[dict]]]) -> dict[str, dict]:
    plain = runs["plain"]
    out = {}
    for name, per_prompt in runs.items():
        for i, rs in enumerate(per_prompt):
            assert all(r["tokens"] == plain[i][0]["tokens"] for r in rs), f"{name}: greedy output differs from plain"
        n_tok = sum(len(rs[0]["tokens"]) for rs in per_prompt)
        secs = sum(statistics.median(r["total_s"] for r in rs) for rs in per_prompt)
        drafted = sum(r["drafted"] for rs in per_prompt for r in rs)
        steps = sum(r["steps"] for rs in per_prompt for r in rs)
        out[name] = {"tok_s": n_tok / secs, "acceptance": sum(r["accepted"] for rs in per_prompt for r in rs)
                     / max(drafted, 1), "ahead_share": sum(r["steps_ahead"] for rs in per_prompt for r in rs)
                     / max(steps, 1)}
    base = out["plain"]["tok_s"]
    for r in out.values():
        r["ratio"] = r["tok_s"] / base
    return out


if __name__ == "__main__":
    main()
