"""Kernels per forward and what a forward costs, old bundle against new, in one process.

    python dev/bench_kernels.py --bundle OLD --bundle NEW [--repeats 7] [--out FILE.json]
                                       [--agreement GGUF]

For each bundle's ONNX target on onnxruntime (2 threads, the padded-rows mode the lean default
runs): kernels per one-token forward and their time per op type (onnxruntime's profiler), then
ms per one-token forward, per B-row verify (c(B) = its cost over a one-token forward, B = 2, 4, 8)
and of the body alone (the graph cut before its head), median of `--repeats` rounds with the
bundles interleaved inside each round. Then the physical picture: weight bytes a token reads,
MACs per row, the machine's copy bandwidth (numpy) and fp32 GEMM rate, and the fractions a
one-token forward achieves of them.

--agreement GGUF (the GGUF the bundles came from): teacher-forced top-1 agreement of each bundle's
target with llama.cpp's own logits of that GGUF and with an fp32 reference (the plain graph of the
GGUF's dequantized weights, MatMulNBits-free, built once into --ref-dir), on the first --per-class
prompts of each suite continued by 32 tokens of llama.cpp's greedy decode.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPT = list(range(1000, 1064))  # a 64-token context
WIDTHS = (1, 2, 4, 8)


def target_file(bundle: Path) -> Path:
    manifest = json.loads((bundle / "edgespec.json").read_text())
    return bundle / manifest["target"]["formats"]["onnx"]["file"]


def open_runtime(path: Path, output: str = "logits", profile: str | None = None):
    from edgespec.runtimes.onnxruntime import graphs as onnx_graphs
    from edgespec.runtimes.onnxruntime import runtime as ortrt

    if profile is None:
        return ortrt.OnnxRuntime(path, threads=2, pad_rows=True, output=output)
    plain = onnx_graphs.session_options

    def profiled(*a, **k):  # the runtime's own options, with the profiler on
        opts = plain(*a, **k)
        opts.enable_profiling, opts.profile_file_prefix = True, profile
        return opts
    ortrt.session_options = profiled
    try:
        return ortrt.OnnxRuntime(path, threads=2, pad_rows=True, output=output)
    finally:
        ortrt.session_options = plain


def kernel_profile(path: Path, n: int = 20) -> dict:
    """Kernels per one-token forward, by op type (count and ms)."""
    with tempfile.TemporaryDirectory() as tmp:
        rt = open_runtime(path, profile=str(Path(tmp) / "p"))
        rt.forward(PROMPT)
        for i in range(n):
            rt.forward([2000 + i])
        events = json.loads(Path(rt._sess.end_profiling()).read_text())
        rt.close()
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    last = runs[-n:]
    start = last[0]["ts"]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start]
    count, dur = collections.Counter(), collections.Counter()
    for e in nodes:
        count[e["args"]["op_name"]] += 1
        dur[e["args"]["op_name"]] += e["dur"]
    return {"kernels_per_forward": len(nodes) / n, "kernel_ms_per_forward": sum(dur.values()) / n / 1e3,
            "by_op": {op: {"n": count[op] / n, "ms": dur[op] / n / 1e3} for op, _ in dur.most_common()}}


def timings(paths: list[Path], repeats: int) -> list[dict]:
    """Median ms per forward of each width (and of the body alone), bundles interleaved per round."""
    full = [open_runtime(p) for p in paths]
    body = [open_runtime(p, output="hidden") for p in paths]
    samples = [collections.defaultdict(list) for _ in paths]
    for rnd in range(repeats + 1):  # round 0 warms up
        for i, (rt, bd) in enumerate(zip(full, body)):
            for r, key in ((rt, "B"), (bd, "body")):
                r.reset()
                r.forward(PROMPT)
                for b in WIDTHS if key == "B" else (1,):
                    ts = []
                    for j in range(8):
                        n = r.n_past
                        t = time.perf_counter()
                        r.forward([3000 + j * 8 + k for k in range(b)], n_logits=b)
                        ts.append(time.perf_counter() - t)
                        r.trim(n)
                    if rnd:
                        samples[i][f"{key}{b}"].append(statistics.median(ts) * 1e3)
    for r in full + body:
        r.close()
    out = []
    for s in samples:
        ms = {k: statistics.median(v) for k, v in s.items()}
        out.append({"ms_one_token": ms["B1"], "ms_body": ms["body1"], "ms_head": ms["B1"] - ms["body1"],
                    "c": {b: ms[f"B{b}"] / ms["B1"] for b in WIDTHS[1:]}, "ms": ms})
    return out


def graph_sizes(path: Path) -> dict:
    """Weight bytes a one-token forward reads and MACs per row, from the graph's MatMulNBits /
    MatMul / Gemm nodes and their initializers (a Gather reads one row of its table)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    size = {t.name: int(np.prod(t.dims)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
            for t in model.graph.initializer}
    dims = {t.name: tuple(t.dims) for t in model.graph.initializer}
    read, macs, head = 0, 0, 0
    for n in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "MatMulNBits":
            b = sum(size.get(i, 0) for i in n.input[1:])
            m = attrs["N"] * attrs["K"]
        elif n.op_type in ("MatMul", "Gemm") and n.input[1] in dims:
            b, m = size[n.input[1]], int(np.prod(dims[n.input[1]]))
        else:
            continue
        read, macs = read + b, macs + m
        if attrs.get("N", 0) > 100_000 or (n.input[1] in dims and max(dims[n.input[1]]) > 100_000):
            head += b
    return {"weight_bytes_per_token": read, "head_bytes": head, "macs_per_row": macs}


def machine() -> dict:
    """Copy bandwidth (numpy, 256 MiB, read + write counted) and fp32 GEMM rate (2 threads)."""
    a = np.ones(32 * 2**20, np.float64)
    b = np.empty_like(a)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t)
    x = np.random.default_rng(0).random((1024, 1024), np.float32)
    gs = []
    for _ in range(7):
        t = time.perf_counter()
        x @ x
        gs.append(time.perf_counter() - t)
    return {"copy_gb_s": 2 * a.nbytes / min(ts) / 1e9, "gemm_gflop_s": 2 * 1024**3 / min(gs) / 1e9,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load": os.getloadavg()}


def argmaxes_of_graph(path: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    with OnnxRuntime(path, threads=2, pad_rows=True, kv_capacity=1024) as rt:
        out = []
        for ids in seqs:
            rt.reset()
            out.append(np.asarray(rt.forward(ids, n_logits=len(ids))).argmax(-1))
    return out


def _share(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    return float(np.mean(np.concatenate([a == b for a, b in zip(got, ref)])))


def agreement(gguf: Path, paths: list[Path], per_class: int, ref_dir: Path, tokens: int = 32) -> dict:
    """Top-1 agreement per position of each graph with llama.cpp and with the fp32 reference."""
    import onnx
    from llama_cpp import Llama

    from edgespec.bench.suites import load_prompts
    from edgespec.exporters.gguf.source import read_gguf
    from edgespec.exporters.onnx.graph import GraphOptions, build_decoder

    llm = Llama(str(gguf), n_ctx=1024, logits_all=True, verbose=False, n_threads=2)
    seqs, cpp = [], []
    for cls in ("chat", "code", "grounded"):
        for p in load_prompts(cls)[:per_class]:
            text = p.text if p.text is not None else "\n".join(c for _, c in p.messages)
            ids = llm.tokenize(text.encode(), add_bos=True)
            gen = []
            for t in llm.generate(ids, top_k=1, reset=True):
                gen.append(int(t))
                if len(gen) == tokens:
                    break
            seq = ids + gen
            llm.reset()
            llm.eval(seq)
            seqs.append(seq)
            cpp.append(np.asarray(llm.scores[:len(seq)]).argmax(-1))
    ref_path = ref_dir / "ref.onnx"  # built once, kept for the next run
    if not ref_path.is_file():
        model = read_gguf(gguf)
        ref_dir.mkdir(parents=True, exist_ok=True)
        ref = build_decoder(model.spec, model.dequantized(), GraphOptions(kv_layout="append", fused_ops=False))
        onnx.save_model(ref, str(ref_path), save_as_external_data=True, location="ref.onnx.data")
        del ref, model
    fp32 = argmaxes_of_graph(ref_path, seqs)
    out, first = {}, None
    for p in paths:
        got = argmaxes_of_graph(p, seqs)
        row = {"with_llama_cpp": _share(got, cpp), "with_fp32": _share(got, fp32)}
        if first is None:
            first = got
        else:  # paired against the first bundle: positions only one of the two gets right
            for name, ref in (("llama_cpp", cpp), ("fp32", fp32)):
                a, b = (np.concatenate([x == r for x, r in zip(g, ref)]) for g in (first, got))
                row[f"{name}_only_first"], row[f"{name}_only_this"] = int((a & ~b).sum()), int((b & ~a).sum())
        out[str(p.parent.parent.name)] = row
    out["fp32_with_llama_cpp"] = _share(fp32, cpp)
    out["positions"] = int(sum(len(s) for s in seqs))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", action="append", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--agreement", type=Path, help="the GGUF the bundles came from")
    ap.add_argument("--per-class", type=int, default=2, help="--agreement: prompts per suite")
    ap.add_argument("--ref-dir", type=Path, default=Path(tempfile.gettempdir()) / "edgespec-fp32-ref",
                    help="--agreement: where the fp32 reference graph is built once")
    args = ap.parse_args(argv)
    paths = [target_file(b) for b in args.bundle]
    if args.agreement:
        agree = agreement(args.agreement, paths, args.per_class, args.ref_dir)
        print(json.dumps(agree, indent=1))
        if args.out:
            args.out.write_text(json.dumps({"agreement": agree}, indent=1))
        return 0
    mach = machine()
    result = {"machine": mach, "bundles": []}
    for b, p, t in zip(args.bundle, paths, timings(paths, args.repeats)):
        prof, sizes = kernel_profile(p), graph_sizes(p)
        sec = t["ms_one_token"] / 1e3
        phys = {"achieved_gb_s": sizes["weight_bytes_per_token"] / sec / 1e9,
                "bandwidth_fraction": sizes["weight_bytes_per_token"] / sec / 1e9 / mach["copy_gb_s"],
                "achieved_gmac_s": sizes["macs_per_row"] * 2 / sec / 1e9,  # the padded mode computes 2 rows
                "compute_fraction_fp32": sizes["macs_per_row"] * 2 * 2 / sec / 1e9 / mach["gemm_gflop_s"]}
        result["bundles"].append({"bundle": b.name, **t, **sizes, **phys, "profile": prof})
        print(f"{b.name}: {prof['kernels_per_forward']:.0f} kernels/forward, one token {t['ms_one_token']:.1f} ms "
              f"(body {t['ms_body']:.1f}, head {t['ms_head']:.1f}), c(B) "
              + " ".join(f"{k}:{v:.2f}" for k, v in t["c"].items())
              + f", {sizes['weight_bytes_per_token'] / 1e6:.0f} MB/token, {sizes['macs_per_row'] / 1e6:.0f} MMAC/row")
    print(f"machine: copy {mach['copy_gb_s']:.1f} GB/s, fp32 GEMM {mach['gemm_gflop_s']:.0f} GFLOP/s, "
          f"load {mach['load']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
