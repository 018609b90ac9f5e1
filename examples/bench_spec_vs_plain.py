"""Plain vs speculative greedy decoding on one bundle, interleaved in one process.

    python examples/bench_spec_vs_plain.py [BUNDLE] --max-tokens 128 --repeat 3 -k 4

Both configurations share the same target runtime (the draft is simply not used for plain),
run alternately, and report medians, so a busy neighbour slows both alike. Peak RSS is sampled
with psutil. (`edgespec bench` will supersede this script.)
"""
from __future__ import annotations

import argparse
import platform
import statistics

import psutil

import edgespec
from edgespec.bench import PeakRSS, timed_decode

PROMPTS = {
    "prose": "The history of the printing press begins",
    "facts": "The capital of France is",
    "code": "def quicksort(items):\n    ",
    "list": "Ten tips for a healthy life:\n1.",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB")
    rss = PeakRSS()
    rss.start()
    base = psutil.Process().memory_info().rss
    with edgespec.load(args.bundle, k=args.k, threads=args.threads) as engine:
        print(f"loaded: {(psutil.Process().memory_info().rss - base) / 2**20:.0f} MiB (target + draft)")
        id_map = engine.bundle.id_map()
        rows = []
        for name, prompt in PROMPTS.items():
            ids = engine.tokenizer.encode(prompt)
            timed_decode(engine.target, engine.draft, ids, 8, k=args.k, id_map=id_map)  # warm-up
            plain, spec = [], []
            for _ in range(args.repeat):
                plain.append(timed_decode(engine.target, None, ids, args.max_tokens))
                spec.append(timed_decode(engine.target, engine.draft, ids, args.max_tokens, k=args.k, id_map=id_map))
            p = statistics.median(r.tok_s for r in plain)
            s = statistics.median(r.tok_s for r in spec)
            same = all(r.tokens == plain[0].tokens for r in plain + spec)
            rows.append((name, p, s, s / p, spec[-1].acceptance, spec[-1].mean_accepted_length, same))
    peak = rss.stop()
    print(f"{'prompt':<8} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'accept':>7} {'len/step':>8} identical")
    for name, p, s, ratio, acc, mlen, same in rows:
        print(f"{name:<8} {p:>11.1f} {s:>10.1f} {ratio:>6.2f} {acc:>7.0%} {mlen:>8.2f} {same}")
    print(f"median ratio {statistics.median(r[3] for r in rows):.2f}; peak RSS {peak / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
