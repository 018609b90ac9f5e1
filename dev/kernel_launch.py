"""What does one onnxruntime kernel cost by itself? (issue 22, item 3: where a step goes)

    python dev/kernel_launch.py [--out dev/results/kernel_launch.json]

The default target's one-token forward runs ~787 kernels, 714 of them outside the MatMulNBits,
and onnxruntime's profiler puts ~10 ms there. That profiler inflates small kernels. This times a
chain of N trivial kernels (Add of a constant to a 640-wide row: Gemma 3 270M's hidden size) with
graph optimizations off, at N = 100 and 800 and 1-2 intra-op threads (spinning, as the engine's
shared pool spins): median ms per run over N, the cost a kernel adds to a forward before it does
any work.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def chain(n: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    nodes, x = [], "x"
    for i in range(n):
        nodes.append(helper.make_node("Add", [x, "c"], [f"y{i}"]))
        x = f"y{i}"
    row = [1, 1, 640]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, row)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, row)],
                              [numpy_helper.from_array(np.ones(row, np.float32), "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def main() -> None:
    import onnxruntime as ort

    from edgespec.bench.machine import library_versions, machine_info

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kernel_launch.json")
    args = ap.parse_args()
    x = np.zeros((1, 1, 640), np.float32)
    us = {}
    for threads in (1, 2):
        for n in (100, 800):
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every kernel
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1")
            sess = ort.InferenceSession(chain(n), opts, providers=["CPUExecutionProvider"])
            for _ in range(20):
                sess.run(None, {"x": x})
            ts = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                sess.run(None, {"x": x})
                ts.append(time.perf_counter() - t0)
            us[f"{threads} threads, {n} kernels"] = round(float(np.median(ts)) * 1e6 / n, 3)
    out = {"bench": "kernel_launch", "machine": machine_info(), "libraries": library_versions(),
           "us_per_kernel": us}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(us, indent=1))


if __name__ == "__main__":
    main()
