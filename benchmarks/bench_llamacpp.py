"""llama.cpp backend: llama-cpp-python's own decode vs edgespec plain vs edgespec speculative,
and the verify-width cost curve, in one process, interleaved, medians.

    python benchmarks/bench_llamacpp.py BUNDLE [--full-draft BUNDLE2] [--tokens 64] [--rounds 5] [--plot out.png]

BUNDLE: a bundle with GGUF artifacts (`edgespec export --format gguf -o BUNDLE`: the default
Q4_K_M target copied as is plus a VocabTrim Q8_0 draft). --full-draft: a bundle whose draft keeps
the full head (`--draft-vocab full`), to price VocabTrim on this backend.

Timings on shared cores are fragile: every configuration runs once per round, in a shuffled
order, and the medians over rounds are reported with the min-max spread.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import numpy as np

import edgespec
from edgespec.bundle import load_bundle
from edgespec.decoding import SamplingParams
from edgespec.runtimes.llamacpp.runtime import LlamaCppRuntime, use_extra_buffer_types

PROMPTS = [
    "The history of the printing press begins",
    "def quicksort(xs):\n    ",
    "Photosynthesis is the process by which",
    "Once upon a time, in a village by the sea,",
]
WIDTHS = (1, 2, 4, 5, 8)


def llama_cpp_high_level(gguf: str, threads: int):
    """llama-cpp-python's Llama, with the extra-buffer-type setting edgespec applies (AMX crash, #20824)."""
    import llama_cpp
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = use_extra_buffer_types()
        return p

    low.llama_model_default_params = params
    try:
        # llama-cpp-python's defaults otherwise, as its users run it
        return llama_cpp.Llama(gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    finally:
        low.llama_model_default_params = default


def run_high_level(llm, ids: list[int], n: int) -> float:
    """Decode tok/s of Llama.generate (greedy), prompt excluded."""
    llm.reset()
    t_first, count = None, 0
    for _tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        count += 1
        if count == 1:
            t_first = time.perf_counter()
        if count >= n:
            break
    return (count - 1) / (time.perf_counter() - t_first)


OUTPUTS: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> the first engine's greedy tokens
MISMATCHES: list[str] = []


def run_engine(engine, ids: list[int], n: int) -> tuple[float, float]:
    """Decode tok/s and tokens per target step of one greedy generation (no stop ids); checks
    that every engine produced the same tokens for the same prompt (lossless greedy)."""
    tokens = list(ids)
    steps, t_first, n_first = 0, None, 0
    for step in engine.decoder.stream(tokens, SamplingParams(), n):
        steps += 1
        if t_first is None:  # the first step includes the prompt: time the rest
            t_first, n_first = time.perf_counter(), len(step.tokens)
    new = len(tokens) - len(ids)
    first = OUTPUTS.setdefault(tuple(ids), tokens[len(ids):])
    got = tokens[len(ids):]
    if first != got:  # llama.cpp's quantized kernels are not batch-invariant: near-ties can flip
        at = next(i for i, (x, y) in enumerate(zip(first + [-1], got + [-2])) if x != y)
        MISMATCHES.append(f"prompt {len(ids)} ids: outputs diverge at token {at}")
    return (new - n_first) / (time.perf_counter() - t_first), new / steps


def verify_curve(rt: LlamaCppRuntime, prompt: list[int], reps: int) -> dict[int, float]:
    """ms of one forward over B tokens with logits at every position, after `prompt`."""
    rt.reset()
    rt.forward(prompt)
    base = rt.n_past
    times: dict[int, list[float]] = {b: [] for b in WIDTHS}
    rng = np.random.default_rng(0)
    for _ in range(reps):
        for b in random.sample(WIDTHS, len(WIDTHS)):
            ids = [int(x) for x in rng.integers(1000, 20000, size=b)]
            t0 = time.perf_counter()
            rt.forward(ids, n_logits=b)
            times[b].append(time.perf_counter() - t0)
            rt.trim(base)
    return {b: statistics.median(v) * 1e3 for b, v in times.items()}


def draft_ms(rt: LlamaCppRuntime, prompt: list[int], steps: int) -> float:
    rt.reset()
    logits = rt.forward(prompt)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = rt.forward([int(np.argmax(logits[-1]))])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.1f}  [{min(xs):.1f}-{max(xs):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--full-draft", default=None, help="bundle with a full-head GGUF draft")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--plot", default=None, help="write the verify-width curve as a PNG")
    args = ap.parse_args()
    b = load_bundle(args.bundle)
    gguf = str(b.file(b.manifest.target.formats["gguf"].file))
    target_q, draft_q = b.manifest.target.formats["gguf"].quantization, b.manifest.draft.formats["gguf"].quantization
    print(f"target {target_q}  draft {draft_q}  extra buffer types: {use_extra_buffer_types()}")
    llm = llama_cpp_high_level(gguf, args.threads)
    kw = dict(backend="llamacpp", threads=args.threads)
    plain = edgespec.load(args.bundle, use_draft=False, **kw)
    spec = edgespec.load(args.bundle, **kw)  # default drafter (model + prompt lookup) and policy
    model_only = edgespec.load(args.bundle, drafter="model", **kw)
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS[: args.prompts]]
    configs = {
        "llama-cpp-python Llama.generate": lambda ids: (run_high_level(llm, ids, args.tokens), 1.0),
        "edgespec plain": lambda ids: run_engine(plain, ids, args.tokens),
        "edgespec speculative (default)": lambda ids: run_engine(spec, ids, args.tokens),
        "edgespec speculative (draft model only)": lambda ids: run_engine(model_only, ids, args.tokens),
    }
    speed = {name: [] for name in configs}
    per_step = {name: [] for name in configs}
    for r in range(args.rounds):
        for name in random.sample(list(configs), len(configs)):
            rates, lens = zip(*(configs[name](ids) for ids in prompts))
            speed[name].append(statistics.median(rates))
            per_step[name].append(statistics.median(lens))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n.split()[-1]} {speed[n][-1]:.1f}" for n in configs),
              flush=True)
    ref = statistics.median(speed["llama-cpp-python Llama.generate"])
    print(f"\ndecode tok/s, median over {args.rounds} rounds of {len(prompts)} prompts x {args.tokens} tokens "
          f"[min-max], threads={args.threads}")
    for name in configs:
        print(f"  {name:<42} {summary(speed[name])}  x{statistics.median(speed[name]) / ref:.2f}"
              f"  tokens/step {statistics.median(per_step[name]):.2f}")

    print(f"greedy outputs identical across edgespec engines: {not MISMATCHES} {sorted(set(MISMATCHES))}")
    curve = verify_curve(plain.target, prompts[0], reps=max(10, 4 * args.rounds))
    print("\nverify forward, logits at every position (ms; ratio to B=1):")
    for w, ms in curve.items():
        print(f"  B={w}: {ms:6.1f} ms  x{ms / curve[1]:.2f}")
    draft = spec.draft
    rows = {"target (one token)": draft_ms(plain.target, prompts[0], 32),
            f"draft, trimmed head K={draft.vocab_size}": draft_ms(draft, prompts[0], 32)}
    if args.full_draft and Path(args.full_draft, "edgespec.json").is_file():
        fb = load_bundle(args.full_draft)
        with LlamaCppRuntime(fb.file(fb.manifest.draft.formats["gguf"].file), threads=args.threads) as full:
            rows[f"draft, full head V={full.vocab_size}"] = draft_ms(full, prompts[0], 32)
    print("\nper-token forward (ms, median of 32):")
    for name, ms in rows.items():
        print(f"  {name:<34} {ms:6.2f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ax[0].plot(list(curve), [curve[w] / curve[1] for w in curve], marker="o")
        ax[0].set(xlabel="verify width B (tokens)", ylabel="cost / one-token decode", title="llama.cpp verify cost")
        names = list(configs)
        ax[1].barh(names, [statistics.median(speed[n]) for n in names])
        ax[1].set(xlabel="decode tok/s (median)", title="decode speed")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    for e in (plain, spec, model_only):
        e.close()


if __name__ == "__main__":
    main()
