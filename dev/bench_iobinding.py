"""onnxruntime: IOBinding (KV stays in OrtValues) vs plain `run` with numpy feeds, per decode step.

    python dev/bench_iobinding.py [BUNDLE] --steps 64 --repeat 3

Both paths run the same session on the same tokens, alternately; medians of ms per step."""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import edgespec


def decode_run(sess, n_layers: int, kv_shape, prompt: list[int], steps: int) -> float:
    """Plain `run`: feeds and fetches numpy arrays, so the cache crosses into numpy each step."""
    past = {f"past_{kind}_{j}": np.zeros(kv_shape, np.float32) for j in range(n_layers) for kind in ("key", "value")}
    outputs = ["logits"] + [f"present_{kind}_{j}" for j in range(n_layers) for kind in ("key", "value")]
    ids, times = prompt, []
    for _ in range(steps):
        t0 = time.perf_counter()
        feeds = {"input_ids": np.asarray([ids], np.int64), "n_logits": np.asarray([1], np.int64), **past}
        out = sess.run(outputs, feeds)
        past = {name.replace("present", "past"): arr for name, arr in zip(outputs[1:], out[1:])}
        ids = [int(out[0][0, -1].argmax())]
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def decode_binding(rt, prompt: list[int], steps: int) -> float:
    rt.reset()
    ids, times = prompt, []
    for _ in range(steps):
        t0 = time.perf_counter()
        ids = [int(rt.forward(ids)[-1].argmax())]
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with edgespec.load(args.bundle, use_draft=False) as engine:
        rt = engine.target
        prompt = engine.tokenizer.encode("The history of the printing press begins")
        kv_shape = (1, rt._kv_heads, 0, rt._head_dim)
        rows = {"run (numpy feeds)": [], "IOBinding": []}
        for _ in range(args.repeat):
            rows["run (numpy feeds)"].append(decode_run(rt._sess, rt._n_layers, kv_shape, prompt, args.steps))
            rows["IOBinding"].append(decode_binding(rt, prompt, args.steps))
        for name, ms in rows.items():
            print(f"{name:<18} {statistics.median(ms):7.1f} ms/step  (runs: {', '.join(f'{m:.1f}' for m in ms)})")


if __name__ == "__main__":
    main()
