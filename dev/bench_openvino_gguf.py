"""A GGUF's own blocks on OpenVINO (compressed u4/u8 constants) against today's fp32 OpenVINO
export, onnxruntime's transcoded target and llama-cpp-python, on the same GGUF.

    python dev/bench_openvino_gguf.py --source-ir S/target/openvino/model.xml \\
        [--fp32-ir F/target/openvino/model.xml] [--onnx B/target/model.onnx] [--gguf FILE] \\
        [--prompts 16] [--tokens 64] [--threads 2] [--out dev/results/openvino_gguf.json]

Make the IRs with `edgespec export --format openvino --draft none -o S` (the GGUF's blocks) and
`... --target-precision fp32 -o F` (what a GGUF source got before). Each configuration runs in
a fresh process: load, then per prompt (bench_lean_bundle's chat, code, grounded and long
prompts, chat-formatted) a prefill and --tokens greedy one-token forwards. Reported per
configuration: peak RSS (VmHWM), load seconds, the tokens before the first difference from
llama.cpp's greedy decode (median over prompts), and the one-token decode ms (median over every
decode step of every prompt, after a warm-up prompt) measured in one more process that holds
every configuration and gives them turns prompt by prompt, so a shared machine's load falls on
all of them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _ids(source_ir: Path, n: int) -> list[list[int]]:
    """The first n chat/code/grounded/long prompts, chat-formatted by the bundle's own tokenizer
    (the same prompts benchmarks/bench_lean_bundle.py measures)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_lean_bundle import prompts

    return prompts(n, source_ir.parents[2])  # <bundle>/target/openvino/model.xml


def _edgespec_decode(rt, ids: list[int], n: int):
    import numpy as np

    rt.reset()
    logits = rt.forward(ids, 1)
    out, times = [], []
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        t = time.perf_counter()
        logits = rt.forward([out[-1]], 1)
        times.append(time.perf_counter() - t)
    return out, times


def _llama_decode(llm, ids: list[int], n: int):
    import llama_cpp
    import numpy as np

    def last() -> np.ndarray:  # the last position's logits (logits_all=False keeps only those)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))

    llm.reset()
    llm.eval(ids)
    out, times = [], []
    for _ in range(n):
        out.append(int(np.argmax(last())))
        t = time.perf_counter()
        llm.eval([out[-1]])
        times.append(time.perf_counter() - t)
    return out, times


def _open(kind: str, path: str, n: int, threads: int):
    """A function ids -> (greedy tokens, per-token decode seconds) on one configuration."""
    if kind == "llamacpp":
        from llama_cpp import Llama

        # logits_all=False: llama.cpp keeps the last position's logits only; all of them would fill
        # llama-cpp-python's (positions, 262k) float table, GBs of RSS that are not llama.cpp's
        llm = Llama(path, n_ctx=1024, n_threads=threads, n_batch=512, logits_all=False, verbose=False)
        return lambda ids: _llama_decode(llm, ids, n)
    if kind == "onnxruntime":
        from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime as R
    else:
        from edgespec.runtimes.openvino.runtime import OpenVinoRuntime as R
    rt = R(path, threads=threads, kv_capacity=1024)
    return lambda ids: _edgespec_decode(rt, ids, n)


def worker(kind: str, path: str, ids_list: list[list[int]], n: int, threads: int) -> dict:
    """One configuration alone in this process (peak RSS, load time, tokens): load, a warm-up
    prompt, then every prompt."""
    t = time.perf_counter()
    run = _open(kind, path, n, threads)
    load = time.perf_counter() - t
    run(ids_list[0])  # warm-up (first-inference allocations, kernel caches)
    tokens = [run(ids)[0] for ids in ids_list]
    return {"load_s": round(load, 2), "peak_rss_mib": round(peak_rss() / 2**20, 1), "tokens": tokens}


def timing(configs: dict[str, tuple[str, str]], ids_list: list[list[int]], n: int, threads: int) -> dict:
    """Decode ms of every configuration in one process, taking turns prompt by prompt, so a
    machine shared with other jobs slows them alike: name -> median ms per one-token forward."""
    runs = {name: _open(kind, path, n, threads) for name, (kind, path) in configs.items()}
    for run in runs.values():
        run(ids_list[0])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for ids in ids_list:
        for name, run in runs.items():
            times[name] += run(ids)[1]
    return {name: round(1000 * statistics.median(ts), 2) for name, ts in times.items()}


def peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM, which starts afresh at exec (ru_maxrss keeps the
    parent's high-water mark across fork + exec, so every worker would report the parent's)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source-ir", type=Path, required=True)
    ap.add_argument("--fp32-ir", type=Path)
    ap.add_argument("--onnx", type=Path)
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--timing", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        ids_list = json.loads(sys.stdin.read())
        print(json.dumps(worker(*args.worker, ids_list, args.tokens, args.threads)))
        return
    if args.timing:
        configs, ids_list = json.loads(sys.stdin.read())
        print(json.dumps(timing(configs, ids_list, args.tokens, args.threads)))
        return
    if args.gguf is None:
        from edgespec.models.catalog import preset_source

        args.gguf = preset_source()
    ids_list = _ids(args.source_ir, args.prompts)
    configs = {"openvino_gguf_blocks": ("openvino", args.source_ir), "openvino_fp32": ("openvino", args.fp32_ir),
               "onnxruntime_transcoded": ("onnxruntime", args.onnx), "llamacpp": ("llamacpp", args.gguf)}
    results = {}
    for name, (kind, path) in configs.items():
        if path is None:
            continue
        proc = subprocess.run([sys.executable, __file__, "--source-ir", str(args.source_ir), "--tokens",
                               str(args.tokens), "--threads", str(args.threads), "--worker", kind, str(path)],
                              input=json.dumps(ids_list), capture_output=True, text=True, env=dict(os.environ))
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-2000:]}")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(name, {k: v for k, v in results[name].items() if k != "tokens"}, file=sys.stderr)
    configs = {name: (kind, str(path)) for name, (kind, path) in configs.items() if path is not None}
    proc = subprocess.run([sys.executable, __file__, "--source-ir", str(args.source_ir), "--tokens",
                           str(args.tokens), "--threads", str(args.threads), "--timing"],
                          input=json.dumps([configs, ids_list]), capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise SystemExit(f"timing failed:\n{proc.stderr[-2000:]}")
    for name, ms in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        results[name]["decode_ms_median_interleaved"] = ms
    peer = results.get("llamacpp")
    for r in results.values():
        if peer is not None:
            r["llamacpp_tokens_before_first_difference_median"] = statistics.median(
                first_difference(a, b) for a, b in zip(r["tokens"], peer["tokens"]))
        del r["tokens"]
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                       "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
           "prompts": len(ids_list), "tokens": args.tokens, "results": results}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
