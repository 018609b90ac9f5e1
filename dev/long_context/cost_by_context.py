"""How does a forward's cost grow with the context? (issue 38, step 0: how much of the long-context
slowdown is attention)

    nice -n 10 python dev/long_context/cost_by_context.py [MODEL.onnx ...] [--contexts 128,1024,2048,4096,8192]
        [--width 5] [--reps 15] [--threads 2] [--out dev/results/long_context.json]

Each model (default: the default bundle's target) is opened with onnxruntime at `--threads`, its KV
capacity raised to the largest context, and timed at each context: a one-token decode and a verify of
`--width` rows (k + 1), through Runtime.probe_scratch (the cached prefix is the buffer's contents:
timing, not values). Several models are timed interleaved, context by context and rep by rep, so a
before/after pair shares the machine's noise. Median ms per forward.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _time(rt, n_new: int, n_ctx: int) -> float:
    t0 = time.perf_counter()
    if not rt.probe_scratch(n_new, n_ctx):
        raise SystemExit(f"the runtime cannot stand in a context of {n_ctx}")
    return (time.perf_counter() - t0) * 1e3


def time_by_context(rts: dict, contexts: list[int], width: int, reps: int, time_one, key: str) -> list[dict]:
    """Median and least ms of a one-token decode and a `width`-row verify of each runtime at each
    context, the runtimes interleaved rep by rep; `time_one(rt, rows, context)` times one forward."""
    rows = []
    for ctx in contexts:
        times: dict[tuple[str, int], list[float]] = {(m, w): [] for m in rts for w in (1, width)}
        for rt in rts.values():  # warm-up: the first run at a new shape plans its buffers
            for w in (1, width):
                time_one(rt, w, ctx)
        for _ in range(reps):
            for m, rt in rts.items():
                for w in (1, width):
                    times[(m, w)].append(time_one(rt, w, ctx))
        for (m, w), ts in times.items():
            row = {key: m, "context": ctx, "rows": w, "ms_median": round(statistics.median(ts), 3),
                   "ms_min": round(min(ts), 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    from edgespec.bench.machine import library_versions, machine_info
    from edgespec.models.catalog import default_bundle_path
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--contexts", default="128,1024,2048,4096,8192")
    ap.add_argument("--width", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    models = a.models or [str(default_bundle_path() / "target" / "model.onnx")]
    contexts = [int(c) for c in a.contexts.split(",")]
    rts = {m: OnnxRuntime(m, threads=a.threads, kv_capacity=max(contexts) + a.width + 1) for m in models}
    rows = time_by_context(rts, contexts, a.width, a.reps, _time, "model")
    result = {"machine": machine_info(), "versions": library_versions(), "threads": a.threads, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
