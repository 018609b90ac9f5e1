"""What reading a bundle's ONNX graph without the `onnx` package saves: memory and import time.

runtimes/onnxruntime/wire.py decodes the few fields of a decoder graph the runtimes need at the
protobuf wire level. The alternative is `import onnx` and `onnx.load_model(path,
load_external_data=False)`. Each sample is a fresh process that imports numpy (and, in the "ort"
context, onnxruntime, as every process that opens an ONNX bundle does), then reads one graph one
way; it reports its resident set after a gc (steady), its high-water mark (peak, VmHWM), the time
of the reader's import and of the read. The configurations are interleaved, their order rotated
each round, and the median and the spread (min..max) of each are written with their paired
differences.

Models: a tiny random-weight Llama exported here (edgespec.exporters.tiny, onnx format, no draft),
and any --model given (e.g. the default bundle's target/model.onnx from edgespec's cache).

    nice -n 15 python dev/wire_rss.py [--repeats 5] [--model PATH ...] [--out dev/results/wire_rss.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("wire", "onnx")
CONTEXTS = ("bare", "ort")


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def child(mode: str, context: str, model: str) -> dict:
    """One sample, in this (fresh) process."""
    import gc

    import numpy  # noqa: F401  both readers need it; imported before the clock starts

    if context == "ort":
        import onnxruntime  # noqa: F401
    base = _status()
    t0 = time.perf_counter()
    if mode == "wire":
        from edgespec.runtimes.onnxruntime.wire import read_model

        t1 = time.perf_counter()
        nodes = len(read_model(model).nodes)
    else:
        import onnx

        t1 = time.perf_counter()
        nodes = len(onnx.load_model(model, load_external_data=False).graph.node)
    t2 = time.perf_counter()
    gc.collect()
    after = _status()
    return {"import_ms": 1e3 * (t1 - t0), "read_ms": 1e3 * (t2 - t1), "nodes": nodes,
            "base_rss": base["VmRSS"], "steady_rss": after["VmRSS"], "peak_rss": after["VmHWM"]}


def _tiny_model(work: Path) -> Path:
    from edgespec.exporters.export import ExportConfig, export_bundle
    from edgespec.exporters.tiny import make_model

    src = make_model("llama", work / "llama")
    bundle = export_bundle(ExportConfig(output=work / "tiny.bundle", target=src, draft=None))
    return next(bundle.rglob("*.onnx"))


def _sample(mode: str, context: str, model: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, context, str(model)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _measure(model: Path, repeats: int) -> dict:
    configs = [(c, m) for c in CONTEXTS for m in MODES]
    samples: dict[str, list[dict]] = {f"{c}/{m}": [] for c, m in configs}
    for r in range(repeats):
        for c, m in configs[r % len(configs):] + configs[:r % len(configs)]:  # rotated: no config always first
            samples[f"{c}/{m}"].append(_sample(m, c, model))
    keys = ("steady_rss", "peak_rss", "import_ms", "read_ms")
    result = {"model": model.name, "graph_bytes": model.stat().st_size, "nodes": samples["bare/wire"][0]["nodes"],
              "configs": {k: {f: _summary([s[f] for s in v]) for f in keys} for k, v in samples.items()},
              "samples": samples}
    # paired by round: onnx minus wire, same context, sampled next to each other
    result["onnx_minus_wire"] = {
        c: {f: _summary([o[f] - w[f] for o, w in zip(samples[f"{c}/onnx"], samples[f"{c}/wire"])]) for f in keys}
        for c in CONTEXTS}
    return result


def _machine() -> dict:
    import numpy
    import onnx
    import onnxruntime

    info = {}
    for ln in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = ln.partition(":")
        info.setdefault(key.strip(), value.strip())
    cpu = f"{info.get('model name', platform.processor())} (family {info.get('cpu family')}, model {info.get('model')})"
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__}


def _report(result: dict) -> str:
    lines = [f"{result['model']} ({result['graph_bytes']} bytes, {result['nodes']} nodes)"]
    for c, diff in result["onnx_minus_wire"].items():
        cfg = result["configs"]
        lines.append(f"  {c}: steady RSS wire {cfg[c + '/wire']['steady_rss']['median'] / 2**20:.1f} MiB, "
                     f"onnx {cfg[c + '/onnx']['steady_rss']['median'] / 2**20:.1f} MiB")
        for f, unit, scale in (("steady_rss", "MiB", 2**20), ("peak_rss", "MiB", 2**20),
                               ("import_ms", "ms", 1), ("read_ms", "ms", 1)):
            d = diff[f]
            lines.append(f"    onnx - wire {f}: median {d['median'] / scale:+.1f} {unit} "
                         f"(min {d['min'] / scale:+.1f}, max {d['max'] / scale:+.1f})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", type=Path, action="append", default=[], help="an .onnx graph to read as well")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "wire_rss.json")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "CONTEXT", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        models = [_tiny_model(Path(tmp)), *args.model]
        results = [_measure(m, args.repeats) for m in models]
    out = {"what": "onnx.load_model vs runtimes/onnxruntime/wire.read_model, fresh processes",
           "repeats": args.repeats, "machine": _machine(), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(_report(r) for r in results))


if __name__ == "__main__":
    main()
