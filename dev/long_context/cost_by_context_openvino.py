"""How does an OpenVINO forward's cost grow with the context, with and without window-only
attention on the sliding layers? (issue 38, item 1 on OpenVINO)

    nice -n 10 python dev/long_context/cost_by_context_openvino.py [MODEL.xml] [--contexts 1024,4096,8192]
        [--width 5] [--reps 9] [--threads 2] [--out dev/results/long_context_openvino.json]

The IR (default: the default bundle's OpenVINO target, built on first use) is opened twice with the
dynamic buffer, as the engine opens a target (wide: verifies on a second compiled copy): "window"
as it loads (sliding layers bound from the aligned start, runtimes/openvino/kv.window_of) and
"whole" with the window record ignored (every layer attends over the whole buffer, the behaviour
before). Each context is stood in by filling the KV buffers and setting the holder's length (timing,
not values; OpenVinoRuntime has no probe_scratch), then a one-token decode and a `--width`-row verify
are timed. The two runtimes are timed interleaved, rep by rep, so they share the machine's noise.
Median ms per forward.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cost_by_context import time_by_context  # noqa: E402


def _open(path: str, threads: int, capacity: int, windowed: bool):
    import edgespec.runtimes.openvino.runtime as ov_runtime

    read = ov_runtime.window_of
    if not windowed:
        ov_runtime.window_of = lambda model: None
    try:
        rt = ov_runtime.OpenVinoRuntime(path, threads=threads, kv_capacity=capacity, wide=True)
    finally:
        ov_runtime.window_of = read
    rt.kv.reserve(capacity)
    for buf in rt.kv._buf:  # committed, non-zero rows: the forward reads real memory
        buf[...] = 0.01
    return rt


def _time(rt, n_new: int, n_ctx: int) -> float:
    rt.kv._n = n_ctx  # a cache standing in for n_ctx positions
    t0 = time.perf_counter()
    rt.forward([7] * n_new, n_logits=n_new)
    ms = (time.perf_counter() - t0) * 1e3
    rt.trim(n_ctx)
    return ms


def main() -> None:
    from edgespec.bench.machine import library_versions, machine_info
    from edgespec.models.catalog import default_bundle_path

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--width", type=int, default=5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.model:
        path = a.model
    else:
        from edgespec.engine.engine import default_bundle

        default_bundle("openvino")
        path = str(default_bundle_path(fmt="openvino") / "target" / "openvino" / "model.xml")
    contexts = [int(c) for c in a.contexts.split(",")]
    capacity = max(contexts) + a.width + 2
    rts = {name: _open(path, a.threads, capacity, name == "window") for name in ("whole", "window")}
    window = rts["window"].kv.plan.window
    if window is None:
        raise SystemExit(f"{path} records no sliding window: export it again with this edgespec")
    rows = time_by_context(rts, contexts, a.width, a.reps, _time, "attention")
    # the file's last folders only: a result names no machine's paths
    result = {"machine": machine_info(), "versions": library_versions(), "threads": a.threads,
              "model": "/".join(Path(path).parts[-3:]),
              "window": {"size": window.size, "align": window.align, "layers": sorted(window.layers)},
              "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
