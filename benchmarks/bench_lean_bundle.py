"""The lean bundle (a GGUF's own blocks as MatMulNBits, no torch) against the fp32 bundle and llama.cpp.

    python benchmarks/bench_lean_bundle.py [--work DIR] [--prompts 16] [--tokens 64] [--threads 2]
                                           [--reuse] [--out benchmarks/results/bench_lean_bundle.json]

On the embedded Gemma 3 270M Q4_K_M GGUF, one fresh process per measured run:
  1. `edgespec export` of the default GGUF (torch-free path): wall time, bundle size, ONNX target
     file size; the same for `--target-precision fp32 --draft none` (the fp32 target, also
     torch-free now: gguf-py's dequantized weights, the same numbers transformers' GGUF loader
     gives; no draft, so no second VocabTrim calibration run);
  2. peak RSS of `edgespec generate` (64 tokens, greedy): the lean bundle speculative (its default)
     and target alone (--no-draft), the fp32 target alone;
  3. teacher-forced top-1 agreement of the lean target with the fp32 target on --prompts prompts
     (each prompt plus the fp32 target's own greedy continuation, argmax compared at every
     continuation position);
  4. greedy-token agreement of each target with llama-cpp-python's plain greedy decode of the same
     GGUF from the same token ids: tokens before the first difference, median over prompts.
Writes the JSON result to --out (and prints it).

    python benchmarks/bench_lean_bundle.py --memory BUNDLE [--repeat 3]
        [--out benchmarks/results/bench_lean_memory.json]

measures only peak RSS (one fresh process per run, the median of --repeat): `edgespec generate` of
BUNDLE on onnxruntime (64 tokens): as it opens by default, greedy and with chat's default sampler
(temperature 0.7, top-p 0.95, top-k 40); greedy with the draft on its own body, on the target's body
(--draft-body shared), without a draft, on the target's body in a process whose cache is empty
(the first load on a machine: the exactness probe settles the exact mode), and llama-cpp-python's
plain greedy and sampled runs of the same GGUF (n_ctx 4096, edgespec's default KV capacity), so the draft's cost
reads side by side with the peer; then `edgespec plan BUNDLE`'s lower bounds, and the load average
before and after (the machine may be shared: RSS does not depend on it, times do).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The process's own peak RSS in KiB: VmHWM, which starts afresh at exec (ru_maxrss keeps the
# spawning process's high-water mark across fork + exec, so a child would report this bench's own)
_PEAK_KIB = ("def _peak_kib():\n"
             "    try:\n"
             "        return next(int(ln.split()[1]) for ln in open('/proc/self/status') if ln.startswith('VmHWM:'))\n"
             "    except (OSError, StopIteration):\n"
             "        import resource\n"
             "        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n")

# run a CLI verb in this fresh interpreter as the `edgespec` command runs it (cli.run: onnxruntime's
# process-wide thread pool) and report its own peak RSS
_RSS_WRAPPER = (_PEAK_KIB + "import atexit, sys\n"
                "atexit.register(lambda: print('PEAK_RSS_KIB', _peak_kib(), file=sys.stderr))\n"
                "from edgespec.cli import run\n"
                "sys.argv[0] = 'edgespec'\n"
                "sys.exit(run())\n")


def run_cli(*args: str, env: dict | None = None) -> tuple[float, int, str]:
    """(seconds, peak RSS bytes, stdout) of `edgespec ARGS` in a fresh process."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RSS_WRAPPER, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    secs = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"edgespec {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    rss = [int(ln.split()[1]) * 1024 for ln in proc.stderr.splitlines() if ln.startswith("PEAK_RSS_KIB")]
    return secs, rss[-1], proc.stdout


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def onnx_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.parent.iterdir() if p.name.startswith(model.name))


def prompts(n: int, bundle: Path) -> list[list[int]]:
    """Token ids of the first n prompts of the chat, code and grounded suites (chat-formatted)."""
    from edgespec.bench.suites import load_prompts
    from edgespec.bundle import load_bundle
    from edgespec.tokenizer import Tokenizer

    b = load_bundle(bundle)
    tok = Tokenizer(b.file(b.manifest.tokenizer.file), b.manifest.tokenizer)
    out = []
    for cls in ("chat", "code", "grounded", "long"):
        for p in load_prompts(cls):
            msgs = [{"role": r, "content": c} for r, c in p.messages] if p.is_chat else None
            out.append(tok.encode_chat(msgs) if msgs else tok.encode(p.text))
    # interleave the suites so a small n still covers all of them
    return sorted(out, key=lambda ids: out.index(ids) % 8)[:n]


def greedy(rt, ids: list[int], n: int) -> list[int]:
    rt.reset()
    logits = rt.forward(ids, 1)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = rt.forward([out[-1]], 1)
    return out


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    import numpy as np

    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def target_file(bundle: Path) -> Path:
    from edgespec.bundle import load_bundle

    b = load_bundle(bundle)
    return b.file(b.manifest.target.formats["onnx"].file)


def agreement(lean: Path, fp32: Path, gguf: Path, ids_list: list[list[int]], n: int, threads: int) -> dict:
    """lean, fp32: the two target ONNX files."""
    from llama_cpp import Llama

    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

    ref, new = (OnnxRuntime(p, threads=threads, kv_capacity=2048) for p in (fp32, lean))
    llm = Llama(str(gguf), n_ctx=2048, n_threads=threads, n_batch=512, logits_all=True, verbose=False)
    agree = total = 0
    run_fp32, run_lean, times = [], [], {"lean": [], "fp32": []}

    for ids in ids_list:
        t = time.perf_counter()
        cont = greedy(ref, ids, n)
        times["fp32"].append((time.perf_counter() - t) / n)
        seq = ids + cont
        for rt in (ref, new):
            rt.reset()
        a = ref.forward(seq, n)  # logits predicting the n continuation tokens
        b = new.forward(seq, n)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += n
        peer = llama_greedy(llm, ids, n)
        run_fp32.append(first_difference(cont, peer))
        t = time.perf_counter()
        lean_cont = greedy(new, ids, n)
        times["lean"].append((time.perf_counter() - t) / n)
        run_lean.append(first_difference(lean_cont, peer))
    return {"teacher_forced_top1_lean_vs_fp32": round(agree / total, 4), "positions": total,
            "llamacpp_tokens_before_first_difference": {
                "lean": {"median": statistics.median(run_lean), "runs": run_lean},
                "fp32": {"median": statistics.median(run_fp32), "runs": run_fp32}},
            "plain_greedy_ms_per_token_median": {k: round(1e3 * statistics.median(v), 1) for k, v in times.items()}}


# llama-cpp-python's plain greedy generation in a fresh process: its own peak RSS
_LLAMA_RUN = (_PEAK_KIB + "import sys\n"
              "from llama_cpp import Llama\n"
              "llm = Llama(sys.argv[1], n_ctx=4096, n_threads=int(sys.argv[3]), verbose=False)\n"
              "llm(sys.argv[2], max_tokens=int(sys.argv[4]), temperature=float(sys.argv[5]), top_p=float(sys.argv[6]),"
              " top_k=int(sys.argv[7]), min_p=0.0, repeat_penalty=1.0)\n"
              "print('PEAK_RSS_KIB', _peak_kib(), file=sys.stderr)\n")

PROMPT = "The history of the printing press"


# chat's default sampler (edgespec chat; llama.cpp's own defaults but min-p)
SAMPLED = {"temperature": "0.7", "top_p": "0.95", "top_k": "40"}
GREEDY = {"temperature": "0", "top_p": "1", "top_k": "1"}


def llama_peak(gguf: Path, tokens: int, threads: int, sampling: dict = GREEDY) -> int:
    proc = subprocess.run([sys.executable, "-c", _LLAMA_RUN, str(gguf), PROMPT, str(threads), str(tokens),
                           sampling["temperature"], sampling["top_p"], sampling["top_k"]],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"llama-cpp-python failed:\n{proc.stderr[-2000:]}")
    return [int(ln.split()[1]) * 1024 for ln in proc.stderr.splitlines() if ln.startswith("PEAK_RSS_KIB")][-1]


def plan_bounds(bundle: Path, threads: int) -> dict:
    """`edgespec plan BUNDLE`'s lower bounds (MiB), as printed."""
    _, _, out = run_cli("plan", str(bundle), "--backend", "onnxruntime", "--threads", str(threads))
    line = next(ln for ln in out.splitlines() if ln.startswith("lower bounds"))
    figures = re.findall(r"(speculative|plain) ([\d.]+ [KMG]iB)", line)
    return {"line": line, **{k: _mib(v) for k, v in figures}}


def _mib(text: str) -> float:
    value, unit = text.split()
    return round(float(value) * {"MiB": 1, "GiB": 1024, "KiB": 1 / 1024}[unit], 1)


def memory(bundle: Path, gguf: Path, tokens: int, threads: int, repeat: int) -> dict:
    """Peak RSS (MiB, median of `repeat` fresh processes) per configuration; the draft's cost as a
    share of llama-cpp-python's plain run."""
    runs: dict[str, list[int]] = {}
    sampled = ["--temperature", SAMPLED["temperature"], "--top-p", SAMPLED["top_p"], "--top-k", SAMPLED["top_k"]]
    configs = {"default": [], "default_sampled": sampled, "draft_own_body": ["--draft-body", "own"],
               "draft_shared_body": ["--draft-body", "shared"], "target_only": ["--no-draft"],
               "target_only_sampled": ["--no-draft", *sampled], "first_load_shared_body": ["--draft-body", "shared"]}
    load = [os.getloadavg()[0]]
    for _ in range(repeat):
        for name, extra in configs.items():
            with tempfile.TemporaryDirectory() as cache:  # an empty cache: no exact mode settled yet
                env = {"EDGESPEC_CACHE": cache} if name.startswith("first_load") else None
                _, rss, _ = run_cli("generate", str(bundle), PROMPT, "--backend", "onnxruntime", "--max-tokens",
                                    str(tokens), "--threads", str(threads), *extra, env=env)
            runs.setdefault(name, []).append(rss)
        runs.setdefault("llamacpp_plain", []).append(llama_peak(gguf, tokens, threads))
        runs.setdefault("llamacpp_plain_sampled", []).append(llama_peak(gguf, tokens, threads, SAMPLED))
    load.append(os.getloadavg()[0])
    mib = {k: round(statistics.median(v) / 2**20) for k, v in runs.items()}
    peer = mib["llamacpp_plain"]
    return {"peak_rss_mib": mib, "runs_mib": {k: [round(x / 2**20) for x in v] for k, v in runs.items()},
            "vs_llamacpp_plain": {k: round(v / peer, 2) for k, v in mib.items() if k != "llamacpp_plain"},
            "sampled_vs_llamacpp_sampled": {k: round(v / mib["llamacpp_plain_sampled"], 2)
                                            for k, v in mib.items() if k.endswith("_sampled")
                                            and not k.startswith("llamacpp")},
            "plan_lower_bounds_mib": plan_bounds(bundle, threads), "load_average_1min": load}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("lean-bench"), help="folder for the two bundles")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="result JSON (default: bench_lean_bundle.json, with --memory "
                                             "bench_lean_memory.json, in results/ beside this script)")
    ap.add_argument("--reuse", action="store_true", help="keep bundles already in --work (no export timing)")
    ap.add_argument("--memory", type=Path, metavar="BUNDLE", help="measure only peak RSS of BUNDLE's configurations")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per configuration with --memory")
    args = ap.parse_args()
    from edgespec.bundle import load_bundle
    from edgespec.models.catalog import preset_source

    gguf = preset_source()
    default_out = "bench_lean_memory.json" if args.memory is not None else "bench_lean_bundle.json"
    args.out = args.out or HERE / "results" / default_out
    if args.memory is not None:
        result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                              "cpus_visible": len(os.sched_getaffinity(0))},
                  "bundle": args.memory.name, "gguf": gguf.name, "tokens": args.tokens,
                  **memory(args.memory, gguf, args.tokens, args.threads, args.repeat)}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                                "cpus_visible": len(os.sched_getaffinity(0)), "python": platform.python_version()},
                    "gguf": {"file": gguf.name, "bytes": gguf.stat().st_size}, "bundles": {}}
    for name, flags in (("lean", []), ("fp32", ["--target-precision", "fp32", "--draft", "none"])):
        out = args.work / name
        row: dict = {}
        if not (args.reuse and (out / "edgespec.json").is_file()):
            secs, rss, _ = run_cli("export", "-o", str(out), "--force", *flags)
            row.update(export_seconds=round(secs, 1), export_peak_rss_mib=round(rss / 2**20))
        m = load_bundle(out).manifest
        target = out / m.target.formats["onnx"].file
        row.update(bundle_mib=round(folder_bytes(out) / 2**20, 1), onnx_target_mib=round(onnx_bytes(target) / 2**20, 1),
                   target_precision=m.target.formats["onnx"].precision,
                   draft_precision=m.draft.formats["onnx"].precision if m.draft else None)
        for mode, extra in (("speculative", []), ("target_only", ["--no-draft"])):
            if mode == "speculative" and m.draft is None:
                continue
            gen_secs, gen_rss, _ = run_cli("generate", str(out), "The history of the printing press",
                                           "--max-tokens", str(args.tokens), "--threads", str(args.threads), *extra)
            row[f"generate_{mode}_peak_rss_mib"] = round(gen_rss / 2**20)
            row[f"generate_{mode}_seconds"] = round(gen_secs, 1)
        result["bundles"][name] = row
        print(name, json.dumps(row), flush=True)
    ids = prompts(args.prompts, args.work / "lean")
    result["agreement"] = agreement(target_file(args.work / "lean"), target_file(args.work / "fp32"), gguf, ids,
                                    args.tokens, args.threads)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
