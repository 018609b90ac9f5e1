"""Compare drafting variants on an OpenVINO bundle without timing noise: a virtual clock.

Each variant decodes the same prompts greedily with real forwards (so the tokens, drafts and
acceptances are real), but the clock that the decoder and the cost policy read advances only by
a cost model of those forwards: a body forward of r tokens costs a + b*r ms, a head call on r rows
c + d*r. The model is measured on this machine first (medians of interleaved timings), then every
variant runs against the same clock, so a 3% difference between variants is the drafting's, not a
busy neighbour's. Wall-clock speed stays `dev/bench_openvino.py`'s job.

`--noise SEED` puts a modelled busy neighbour back, reproducibly: every forward is slowed by a
bursty factor (a slowly wandering one, up to ~1.5x for seconds at a time, and 3% of forwards
1.5-3x), so the policy learns from noisy timings as it does on a shared CPU.

    python dev/replay_drafting.py BUNDLE [--prompts chat,code] [--tokens 48] [--reps 2] [--noise SEED]
        [--costs EARLIER_REPORT.json]

Needs a bundle whose draft runs on the target's body (int8/int4 self-draft, the default there).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

# variant name -> what it turns off (None: today's default drafting)
VARIANTS = {
    "default": (),
    "no lookahead": ("lookahead",),
    "no tails": ("tails",),
    "no rate choice": ("prefers",),
    "none of the three": ("lookahead", "tails", "prefers"),
    "no held catch-ups": ("held",),  # round 9's measurement fix undone
}


class Clock:
    """Virtual milliseconds, advanced by the cost model (and by modelled noise, given a seed)."""

    def __init__(self, seed: int | None = None) -> None:
        self.ms = 0.0
        self._rng = None if seed is None else np.random.default_rng(seed)
        self._drift = 0.0

    def spend(self, ms: float) -> None:
        if self._rng is not None:
            # a neighbour's load wanders (AR(1), ~50 forwards to decorrelate) and only ever slows
            self._drift = 0.98 * self._drift + 0.03 * self._rng.standard_normal()
            ms *= np.exp(abs(self._drift))
            if self._rng.random() < 0.03:
                ms *= self._rng.uniform(1.5, 3.0)
        self.ms += ms

    def perf_counter(self) -> float:
        return self.ms / 1e3


def fit(widths: list[int], ms: list[float]) -> tuple[float, float]:
    """Least-squares a + b*w."""
    b, a = np.polyfit(widths, ms, 1)
    return float(a), float(b)


def measure_costs(engine, reps: int = 8) -> dict[str, tuple[float, float]]:
    """(a, b) of the body and both heads on this machine, at ~200 cached positions."""
    tgt, draft = engine.decoder.target, engine.decoder.draft
    body = tgt.shared.body
    body.forward(list(range(100, 300)))
    widths = [1, 2, 4, 8, 16]
    t = {k: {w: [] for w in widths} for k in ("body", "target head", "draft head")}
    for _ in range(reps):
        for w in widths:
            t0 = time.perf_counter()
            hidden = np.array(body.forward(list(range(7, 7 + w)), n_logits=w))
            t1 = time.perf_counter()
            tgt.head(hidden)
            t2 = time.perf_counter()
            draft.head(hidden)
            t3 = time.perf_counter()
            body.trim(200)
            for k, dt in (("body", t1 - t0), ("target head", t2 - t1), ("draft head", t3 - t2)):
                t[k][w].append(1e3 * dt)
    body.reset()
    return {k: fit(widths, [float(np.median(v[w])) for w in widths]) for k, v in t.items()}


def instrument(engine, clock: Clock, costs: dict[str, tuple[float, float]]) -> None:
    """Make the engine's body and heads advance `clock` by their modelled cost."""
    tgt, draft = engine.decoder.target, engine.decoder.draft
    body = tgt.shared.body
    forward = body.forward

    def timed_forward(ids, n_logits=1):
        a, b = costs["body"]
        clock.spend(a + b * len(ids))
        return forward(ids, n_logits)

    body.forward = timed_forward
    for rt, name in ((tgt, "target head"), (draft, "draft head")):
        rt.head = TimedHead(rt.head, clock, costs[name])


class TimedHead:
    def __init__(self, head, clock: Clock, cost: tuple[float, float]) -> None:
        self.head, self.clock, self.cost = head, clock, cost
        self.vocab_size, self.weight_bytes = head.vocab_size, head.weight_bytes

    def __call__(self, hidden):
        self.clock.spend(self.cost[0] + self.cost[1] * len(hidden))
        return self.head(hidden)

    def close(self) -> None:
        self.head.close()


class Unheld:
    """A draft runtime that never reports rows it already held: catch-ups look like prefill."""

    def __init__(self, runtime) -> None:
        self._runtime = runtime

    def __getattr__(self, name):
        return 0 if name == "reused_rows" else getattr(self._runtime, name)


def switch_off(engine, parts: tuple[str, ...]) -> None:
    """Turn parts of the default drafting off on this engine only."""
    drafter, policy = engine.decoder.drafter, engine.decoder.policy
    if "held" in parts:
        drafter.model.runtime = Unheld(drafter.model.runtime)
    if "lookahead" in parts:
        drafter.model.guess = None
    if "tails" in parts:
        policy.next_tail = lambda *a: 0
    if "prefers" in parts:
        policy.prefers = lambda *a: True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--prompts", default="chat,code")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--costs", type=Path, default=None, metavar="REPORT",
                   help="reuse the cost model of an earlier run's --out report instead of measuring")
    p.add_argument("--noise", type=int, default=None, metavar="SEED",
                   help="slow forwards by modelled, reproducible neighbour noise")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from edgespec.bench.suites import encode_prompt, load_prompts
    from edgespec.bundle import load_bundle
    from edgespec.decoding import SamplingParams
    from edgespec.engine.engine import Engine

    bundle = load_bundle(args.bundle)
    clock = Clock(args.noise)
    # the decoder, its drafters and the cost policy read the virtual clock
    engines = {name: Engine(bundle, backend="openvino", threads=args.threads, clock=clock.perf_counter)
               for name in VARIANTS}
    if not all(e.shared_body for e in engines.values()):
        raise SystemExit("the replay models a draft on the target's body; this bundle's draft has its own")
    costs = (json.loads(args.costs.read_text())["cost_model_ms"] if args.costs
             else measure_costs(next(iter(engines.values()))))
    print("cost model (ms): " + ", ".join(f"{k} {a:.2f} + {b:.3f}/token" for k, (a, b) in costs.items()))
    for name, e in engines.items():
        instrument(e, clock, costs)
        switch_off(e, VARIANTS[name])
    prompts = [encode_prompt(next(iter(engines.values())).tokenizer, q) for q in load_prompts(args.prompts)]
    done = {name: [0.0, 0] for name in engines}  # virtual ms, tokens after each first step
    outputs = {name: [] for name in engines}
    for _ in range(args.reps):
        for ids in prompts:
            for name, e in engines.items():  # interleaved, as the wall-clock bench does
                tokens, start = list(ids), None
                for _step in e.decoder.stream(tokens, SamplingParams(), args.tokens):
                    if start is None:  # the first step includes the prompt
                        start, n0 = clock.ms, len(tokens)
                done[name][0] += clock.ms - start
                done[name][1] += len(tokens) - n0
                outputs[name].append(tokens)
                for rt in filter(None, (e.decoder.target, e.decoder.draft)):
                    rt.reset()
    plain_ms = costs["body"][0] + costs["body"][1] + costs["target head"][0] + costs["target head"][1]
    report = {"cost_model_ms": costs, "noise_seed": args.noise, "plain_tok_s": 1e3 / plain_ms, "variants": {}}
    # ratios are to the noise-free plain decode: compare variants within one run
    print(f"plain decode (modelled, noise-free): {1e3 / plain_ms:.1f} tok/s")
    for name, (ms, n) in done.items():
        rate = 1e3 * n / ms
        same = outputs[name] == outputs["default"]
        report["variants"][name] = {"tok_s": rate, "x_plain": rate * plain_ms / 1e3, "same_tokens": same}
        print(f"  {name:20s} {rate:6.1f} tok/s  x{rate * plain_ms / 1e3:.2f} plain   same tokens: {same}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
