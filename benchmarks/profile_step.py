"""How much of a speculative step is Python? (issue 22, item 3: goal <= 5% on every backend)

    python benchmarks/profile_step.py [--bundle BUNDLE] [--backend onnxruntime openvino llamacpp]
                                      [--max-tokens 64] [--out benchmarks/results/profile_step.json]

Per backend, one process loads the bundle (default: the embedded default, exported on first use),
warms up on the prompts, then generates greedily from each prompt under cProfile. "Native" is the
time inside the inference engine's own call: onnxruntime's `run`/`run_with_iobinding`, OpenVINO's
`infer`, and for llama.cpp the ctypes `llama_decode` (cProfile does not see ctypes calls as
functions: they are counted in `LlamaCppRuntime._decode`'s own time, which holds little else).
Everything else (drafting, the cost policy, acceptance, KV bookkeeping, binding, the tokenizer's
streaming detokenizer) is orchestration. cProfile's own overhead inflates the Python side, so the
share is an upper bound.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
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


def profile(bundle: str | None, backend: str, max_tokens: int) -> dict:
    import edgespec

    engine = edgespec.load(bundle, backend=backend) if bundle else edgespec.load(backend=backend)
    run = lambda: sum(len(engine.generate(p, max_tokens=max_tokens)) for p in PROMPTS)  # noqa: E731
    run()  # warm-up: the exactness probe, compile caches and the cost policy's first measurements
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
                                                                                        "infer>"))][:8]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle")
    ap.add_argument("--backend", nargs="+", default=["onnxruntime", "openvino", "llamacpp"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "profile_step.json"))
    args = ap.parse_args()
    rows = [profile(args.bundle, b, args.max_tokens) for b in args.backend]
    for r in rows:
        print(f"{r['backend']:12s} wall {r['wall_s']:6.2f} s  native {r['native_s']:6.2f} s  "
              f"python {r['python_share']:.1%}")
    from edgespec.bench.machine import cpu_model, isa_features

    out = {"machine": {"cpu": cpu_model(), "isa": isa_features(), "cpus": os.cpu_count(),
                       "load_average": round(os.getloadavg()[0], 2)},
           "bundle": Path(args.bundle).name if args.bundle else "default", "max_tokens": args.max_tokens,
           "prompts": len(PROMPTS), "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
