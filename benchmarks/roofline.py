"""Where a forward's time goes on onnxruntime, per operator type, against the memory's bound.

    python benchmarks/roofline.py [BUNDLE] [--contexts 64,512] [--widths 1,4,8] [--threads 2]
                                  [--out benchmarks/results/roofline]

For the bundle's ONNX target (default: the embedded default bundle), one onnxruntime session
with its profiler on runs forwards of each width after a past of each context length (the KV
rows are zeros: the kernels' cost does not depend on their values), and the profiler's kernel
times are summed per operator type; MatMulNBits is split into the head's product and the body's.
For each: nodes per forward, milliseconds per forward, the weight bytes its nodes read, the
bandwidth that implies, and its share of the read bandwidth measured here (bench/roofline.py).
The profiler adds a few microseconds to every node, so the per-type times are scaled to the
forward's time measured without it (the scale is printed). Writes `roofline.json` and
`roofline.md` (with the CPU named) into --out.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgespec.bench.machine import cpu_model, isa_features
from edgespec.bench.roofline import bandwidths
from edgespec.runtimes.onnxruntime.graphs import fused_model

REPS = 20


def _session(path: Path, threads: int, profile: bool):
    """A session of the graph the runtime runs (its head's product written straight into the
    logits: runtimes/onnxruntime/graphs.fused_model), its weights read from the bundle's folder."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.enable_cpu_mem_arena = False
    if profile:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(os.environ.get("TMPDIR", "/tmp")) / "edgespec-roofline")
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return ort.InferenceSession(fused_model(path).to_bytes(), opts, providers=["CPUExecutionProvider"])


def _feeds(sess, past: int, width: int) -> dict:
    feeds = {"input_ids": np.full((1, width), 100, np.int64), "n_logits": np.array([width], np.int64)}
    for i in sess.get_inputs():
        if i.name.startswith("past_"):
            feeds[i.name] = np.zeros((1, past, *i.shape[2:]), np.float32)
    return feeds


def _timed(sess, feeds: dict) -> float:
    for _ in range(3):
        sess.run(None, feeds)
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _product_bytes(path: Path, vocab: int) -> dict[str, int]:
    """Weight bytes of the graph's MatMulNBits per forward: the head's (codes with a row per
    vocabulary id) and the body's."""
    model = fused_model(path)
    sizes = {t.name: (t.numel * t.itemsize, t.dims) for t in model.initializers}
    out = {"MatMulNBits (head)": 0, "MatMulNBits (body)": 0}
    for n in model.nodes:
        if n.op_type == "MatMulNBits":
            head = sizes.get(n.inputs[1], (0, (0,)))[1][0] == vocab
            kind = "MatMulNBits (head)" if head else "MatMulNBits (body)"
            out[kind] += sum(sizes.get(i, (0,))[0] for i in n.inputs[1:])
    return out


def _profile(path: Path, threads: int, past: int, width: int, vocab: int) -> dict:
    """Per operator type: nodes, profiled ms per forward, weight bytes per forward. MatMulNBits
    is the head's where its codes have a row per vocabulary id, else the body's."""
    sess = _session(path, threads, profile=True)
    feeds = _feeds(sess, past, width)
    for _ in range(3 + REPS):
        sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    runs = max(1, sum(1 for e in events if e.get("cat") == "Session" and e["name"] == "model_run"))
    out: dict[str, dict] = collections.defaultdict(lambda: {"nodes": set(), "us": 0.0})
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        kind, shapes = e["args"]["op_name"], e["args"].get("input_type_shape", [])
        if kind == "MatMulNBits":
            codes = next(iter(shapes[1].values())) if len(shapes) > 1 else [0]
            kind += " (head)" if vocab in codes or len(shapes) == 3 and _rows(shapes) == vocab else " (body)"
        out[kind]["nodes"].add(e["name"])
        out[kind]["us"] += e["dur"]
    weights = _product_bytes(path, vocab)
    return {k: {"nodes": len(v["nodes"]), "ms": v["us"] / runs / 1e3, "bytes": weights.get(k, 0)}
            for k, v in out.items()}


def _rows(shapes: list[dict]) -> int:
    """The output rows of a MatMulNBits whose codes were prepacked away: its scales hold
    rows x blocks values and the activations K / 32 blocks a row."""
    k = next(iter(shapes[0].values()))[-1]
    scales = int(np.prod(next(iter(shapes[1].values()))))
    return scales // max(k // 32, 1)


def measure(path: Path, threads: int, past: int, width: int, bandwidth: float, vocab: int) -> dict:
    sess = _session(path, threads, profile=False)
    plain = _timed(sess, _feeds(sess, past, width))
    kinds = _profile(path, threads, past, width, vocab)
    scale = plain / sum(k["ms"] for k in kinds.values())
    rows = []
    for name, k in sorted(kinds.items(), key=lambda kv: -kv[1]["ms"]):
        ms = k["ms"] * scale
        gb_s = k["bytes"] / (ms * 1e6) if k["bytes"] and ms else None
        rows.append({"op": name, "nodes": k["nodes"], "ms": round(ms, 3), "share": round(ms / plain, 3),
                     "weights_bytes": k["bytes"], "gb_s": None if gb_s is None else round(gb_s, 1),
                     "of_bandwidth": None if gb_s is None else round(gb_s / bandwidth, 3)})
    return {"past": past, "width": width, "forward_ms": round(plain, 3), "profile_scale": round(scale, 3),
            "rows": rows}


def markdown(doc: dict) -> str:
    lines = [f"# onnxruntime's forward per operator type, {doc['cpu']}", "",
             f"Bundle `{doc['bundle']}`, {doc['threads']} threads, onnxruntime {doc['onnxruntime']}; memory read "
             f"bandwidth measured here: " + ", ".join(f"{t} thread(s) {v} GB/s" for t, v in doc["bandwidth"].items())
             + ". Command: `python benchmarks/roofline.py`.", ""]
    for m in doc["measurements"]:
        lines += [f"## {m['width']} row(s) after {m['past']} positions: {m['forward_ms']:.2f} ms "
                  f"(profiled kernel times scaled by {m['profile_scale']:.2f})", "",
                  "| operator | nodes | ms | share | weights read (MB) | GB/s | share of bandwidth |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in m["rows"]:
            mb = f"{r['weights_bytes'] / 1e6:.1f}" if r["weights_bytes"] else "–"
            gb = f"{r['gb_s']:.1f}" if r["gb_s"] is not None else "–"
            of = f"{100 * r['of_bandwidth']:.0f}%" if r["of_bandwidth"] is not None else "–"
            lines.append(f"| {r['op']} | {r['nodes']} | {r['ms']:.3f} | {100 * r['share']:.0f}% | {mb} | {gb} | {of} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--contexts", default="64,512")
    ap.add_argument("--widths", default="1,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/roofline")
    args = ap.parse_args()
    from edgespec.bundle import load_bundle
    from edgespec.engine.engine import default_bundle

    bundle = load_bundle(args.bundle or default_bundle())
    path = bundle.file(bundle.manifest.target.formats["onnx"].file)
    bw = {k: round(v, 1) for k, v in bandwidths(args.threads).items()}
    best = max(bw.values())
    vocab = bundle.manifest.target.vocab_size
    ms = [measure(path, args.threads, int(p), int(w), best, vocab)
          for p in args.contexts.split(",") for w in args.widths.split(",")]
    doc = {"cpu": cpu_model(), "isa": isa_features(), "bundle": bundle.path.name, "threads": args.threads,
           "onnxruntime": ort.__version__, "bandwidth": bw, "measurements": ms}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "roofline.json").write_text(json.dumps(doc, indent=1))
    (out / "roofline.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
