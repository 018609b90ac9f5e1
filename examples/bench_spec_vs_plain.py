"""Plain vs speculative greedy decoding on one bundle, interleaved in one process.

    python examples/bench_spec_vs_plain.py [BUNDLE] --max-tokens 128 --repeat 3 -k 4

Both configurations share the same target runtime (the draft is simply not used for plain),
run alternately, and report medians, so a busy neighbour slows both alike. Peak RSS is sampled
with psutil. (`edgespec bench` will supersede this script.)
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import psutil

import edgespec
from edgespec.decoding import FixedK, SamplingParams, SpeculativeDecoder

PROMPTS = {
    "prose": "The history of the printing press begins",
    "facts": "The capital of France is",
    "code": "def quicksort(items):\n    ",
    "list": "Ten tips for a healthy life:\n1.",
}


class PeakRSS(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def stop(self) -> int:
        self._stop.set()
        self.join()
        return self.peak


def run_once(engine, ids: list[int], draft, k: int, max_tokens: int) -> dict:
    engine.target.reset()
    if engine.draft is not None:
        engine.draft.reset()
    dec = SpeculativeDecoder(engine.target, draft, policy=FixedK(k) if draft is not None else None)
    tokens, steps, drafted, accepted = list(ids), 0, 0, 0
    t0 = time.perf_counter()
    first = None
    for step in dec.stream(tokens, SamplingParams(), max_tokens, stop_ids=()):
        first = first or time.perf_counter() - t0
        steps, drafted, accepted = steps + 1, drafted + step.drafted, accepted + step.accepted
    total = time.perf_counter() - t0
    n = len(tokens) - len(ids)
    return {"tok_s": (n - 1) / (total - first), "tokens": tokens[len(ids):], "steps": steps,
            "acceptance": accepted / drafted if drafted else 0.0, "mean_len": n / steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    rss = PeakRSS()
    rss.start()
    base = psutil.Process().memory_info().rss
    with edgespec.load(args.bundle, k=args.k, threads=args.threads) as engine:
        loaded = psutil.Process().memory_info().rss
        print(f"loaded: {(loaded - base) / 2**20:.0f} MiB (target + draft)")
        rows = []
        for name, prompt in PROMPTS.items():
            ids = engine.tokenizer.encode(prompt)
            runs = {"plain": [], "spec": []}
            run_once(engine, ids, engine.draft, args.k, 8)  # warm-up
            for _ in range(args.repeat):
                runs["plain"].append(run_once(engine, ids, None, 0, args.max_tokens))
                runs["spec"].append(run_once(engine, ids, engine.draft, args.k, args.max_tokens))
            plain = statistics.median(r["tok_s"] for r in runs["plain"])
            spec = statistics.median(r["tok_s"] for r in runs["spec"])
            same = all(r["tokens"] == runs["plain"][0]["tokens"] for r in runs["plain"] + runs["spec"])
            last = runs["spec"][-1]
            rows.append((name, plain, spec, spec / plain, last["acceptance"], last["mean_len"], same))
    peak = rss.stop()
    print(f"{'prompt':<8} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'accept':>7} {'len/step':>8} identical")
    for name, plain, spec, ratio, acc, mlen, same in rows:
        print(f"{name:<8} {plain:>11.1f} {spec:>10.1f} {ratio:>6.2f} {acc:>7.0%} {mlen:>8.2f} {same}")
    print(f"median ratio {statistics.median(r[3] for r in rows):.2f}; peak RSS {peak / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
