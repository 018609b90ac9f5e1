"""How much of a speculative step is Python? (issue 22, item 3: goal <= 5% on every backend)

    python dev/profile_step.py [--bundle BUNDLE] [--backend onnxruntime openvino llamacpp]
                                      [--max-tokens 64] [--rounds 5] [--out dev/results/profile_step.json]

Per backend, one process loads the bundle (default: the embedded default, exported on first use),
warms up on the prompts, then generates greedily from each prompt under cProfile. "Native" is the
time inside the inference engine's own call: onnxruntime's `run`/`run_with_iobinding`, OpenVINO's
`infer`, and for llama.cpp the ctypes `llama_decode` (cProfile does not see ctypes calls as
functions: they are counted in `LlamaCppRuntime._decode`'s own time, which holds little else).
Everything else (drafting, the cost policy, acceptance, KV bookkeeping, binding, the tokenizer's
streaming detokenizer) is orchestration. cProfile's own overhead inflates the Python side, so the
share is an upper bound.

Then, without cProfile, the same generations again (`--rounds` times, streamed): each step's wall
time between two Responses, and the time inside the native calls measured around them with
`time.perf_counter_ns` (the engines' C methods wrapped at class level for the run: one Python
frame per call, counted on the Python side). "steps" reports medians per speculative step (a
generation's first Response, which holds the prefill, is left out) and the Python share of their
sum; `python_cpu_*` counts the main thread's CPU time instead of wall time outside the native calls,
which other processes on a loaded machine do not inflate. The load average is recorded at the
start and the end.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Summarise: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. "
           "It is named after the engineer Gustave Eiffel, whose company designed and built it. Summary:"]


def native(stats: pstats.Stats) -> tuple[float, int]:
    """Seconds and calls inside the engines' native inference calls."""
    seconds, calls = 0.0, 0
    for (path, _, name), (_, ncalls, tottime, _, _) in stats.stats.items():
        ort = name.startswith("<built-in method onnxruntime") and name.endswith((".run>", ".run_with_iobinding>"))
        ov = name.startswith("<built-in method openvino") and name.endswith(".infer>")
        llama = path.endswith("llamacpp.py") and name == "_decode"
        if ort or ov or llama:
            seconds, calls = seconds + tottime, calls + ncalls
    return seconds, calls


def _native_methods() -> list[tuple[type, str]]:
    """(class, method) of the native inference calls of the installed engines."""
    found = []
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

        found += [(ort_c.InferenceSession, "run_with_iobinding"), (ort_c.InferenceSession, "run")]
    except ImportError:
        pass
    try:
        from openvino._pyopenvino import InferRequest

        found += [(InferRequest, "infer"), (InferRequest, "start_async"), (InferRequest, "wait")]
    except ImportError:
        pass
    try:
        from edgespec.runtimes.llamacpp.runtime import LlamaCppRuntime

        found.append((LlamaCppRuntime, "_decode"))
    except ImportError:
        pass
    return found


@contextmanager
def native_clock():
    """[wall ns, this thread's CPU ns] spent inside native inference calls while open."""
    spent = [0, 0]
    patched = []

    def timed(fn):
        def call(*args, **kwargs):
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter_ns() - t0
                spent[1] += time.thread_time_ns() - c0
        return call

    try:
        for cls, name in _native_methods():
            fn = cls.__dict__[name]
            setattr(cls, name, timed(fn))
            patched.append((cls, name, fn))
        yield spent
    finally:
        for cls, name, fn in patched:
            setattr(cls, name, fn)


def step_times(engine, max_tokens: int, rounds: int) -> dict:
    """Medians per speculative step over `rounds` x PROMPTS streamed generations, no profiler.

    python_ms: wall time outside the native calls; python_cpu_ms: the main thread's CPU time
    outside them, which a loaded machine's preemption does not inflate (the engines' worker
    threads do not count; the calling thread's share of a native call is left out with it)."""
    walls, natives, cpus = [], [], []
    with native_clock() as spent:
        for _ in range(rounds):
            for prompt in PROMPTS:
                mark = (time.perf_counter_ns(), time.thread_time_ns(), *spent)
                for i, _r in enumerate(engine.stream(prompt, max_tokens=max_tokens)):
                    now = (time.perf_counter_ns(), time.thread_time_ns(), *spent)
                    if i:  # the first Response holds the prefill
                        walls.append(now[0] - mark[0])
                        natives.append(now[2] - mark[2])
                        cpus.append((now[1] - mark[1]) - (now[3] - mark[3]))
                    mark = (time.perf_counter_ns(), time.thread_time_ns(), *spent)
    python = [w - n for w, n in zip(walls, natives)]
    ms = lambda v: round(statistics.median(v) / 1e6, 3)  # noqa: E731
    return {"steps": len(walls), "wall_ms": ms(walls), "native_ms": ms(natives), "python_ms": ms(python),
            "python_cpu_ms": ms(cpus), "python_share": round(sum(python) / sum(walls), 4),
            "python_cpu_share": round(sum(cpus) / sum(walls), 4)}


def profile(bundle: str | None, backend: str, max_tokens: int, rounds: int) -> dict:
    import edgespec

    engine = edgespec.load(bundle, backend=backend) if bundle else edgespec.load(backend=backend)
    run = lambda: sum(len(engine.generate(p, max_tokens=max_tokens)) for p in PROMPTS)  # noqa: E731
    run()  # warm-up: the exactness probe, compile caches and the cost policy's first measurements
    steps = step_times(engine, max_tokens, rounds)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    wall = time.perf_counter() - start
    seconds, calls = native(pstats.Stats(prof))
    top = sorted(((v[2], f"{Path(k[0]).name}:{k[2]}") for k, v in pstats.Stats(prof).stats.items()), reverse=True)
    return {"backend": backend, "wall_s": round(wall, 3), "native_s": round(seconds, 3), "native_calls": calls,
            "python_share": round(1 - seconds / wall, 4),
            "top_python": [[name, round(t, 4)] for t, name in top if not name.endswith(("run_with_iobinding>",
                                                                                        "infer>"))][:8],
            "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle")
    ap.add_argument("--backend", nargs="+", default=["onnxruntime", "openvino", "llamacpp"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds over the prompts, without the profiler")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "profile_step.json"))
    args = ap.parse_args()
    load = round(os.getloadavg()[0], 2)
    rows = [profile(args.bundle, b, args.max_tokens, args.rounds) for b in args.backend]
    for r in rows:
        st = r["steps"]
        print(f"{r['backend']:12s} cProfile: wall {r['wall_s']:6.2f} s  native {r['native_s']:6.2f} s  "
              f"python {r['python_share']:.1%} | {st['steps']} steps, median {st['wall_ms']:.2f} ms "
              f"(python {st['python_ms']:.3f} ms, its CPU {st['python_cpu_ms']:.3f}), python {st['python_share']:.1%}")
    from edgespec.bench.machine import cpu_model, isa_features

    out = {"machine": {"cpu": cpu_model(), "isa": isa_features(), "cpus": os.cpu_count(),
                       "load_average": [load, round(os.getloadavg()[0], 2)]},  # at start, at end
           "bundle": Path(args.bundle).name if args.bundle else "default", "max_tokens": args.max_tokens,
           "prompts": len(PROMPTS), "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
