"""Load a bundle and decode greedily; print what was read and produced as one JSON object.

tests/test_aarch64.py runs this same file with the x86-64 python and with the emulated aarch64
python (.ci/aarch64) and compares the two outputs: the bundle's bytes (sha256 of every file,
before and after loading) and the greedy token ids, plain and speculative, per backend.

usage: python aarch64_probe.py BUNDLE --backend onnxruntime [--backend openvino] --max-tokens N
       [--max-context N] [-k K] PROMPT...
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path


def checksums(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by path relative to it."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def greedy(bundle: Path, backend: str, prompts: list[str], max_tokens: int, speculative: bool,
           max_context: int | None = None, k: int | None = None) -> dict:
    """Greedy decoding of each prompt on one loaded engine (loading is the slow part under emulation).
    `max_context` bounds the caches, and so how far the exactness probe at the first load reaches;
    `k` fixes the draft length, and so the widest verify it probes (k + 1)."""
    from edgespec import load

    # plain: no draft model and no prompt lookup; speculative: the bundle's draft model (and lookup),
    # drafting even where the exactness probe finds a verify not bit-identical (the point is to compare)
    kw = (dict(use_draft=True, drafter="auto", allow_inexact=True, k=k) if speculative
          else dict(use_draft=False, drafter="none"))
    out = []
    t0 = time.perf_counter()
    with load(bundle, backend=backend, max_context=max_context, **kw) as engine:
        load_s = time.perf_counter() - t0
        for prompt in prompts:
            ids: list[int] = []
            drafted = 0
            for r in engine.stream(prompt, max_tokens=max_tokens, temperature=0.0):
                ids += r.token_ids
                drafted = r.stats.drafted if r.stats is not None else drafted
            out.append({"ids": ids, "text": engine.tokenizer.decode(ids), "drafted": drafted})
        exactness = getattr(engine, "exactness", None)
        verdict = exactness.describe() if exactness is not None and hasattr(exactness, "describe") else None
        probe_ms = getattr(exactness, "probe_ms", None) if exactness is not None and not exactness.cached else None
        exact_width = getattr(exactness, "exact_width", None)
    return {"drafter": engine.drafter_name, "exactness": verdict, "exact_width": exact_width, "prompts": out,
            "load_s": round(load_s, 1), "probe_ms": probe_ms, "decode_s": round(time.perf_counter() - t0 - load_s, 1)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="aarch64_probe.py")
    p.add_argument("bundle", type=Path)
    p.add_argument("prompts", nargs="+")
    p.add_argument("--backend", action="append", required=True)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-context", type=int, default=None,
                   help="bound the caches (and the exactness probe's reach): a shorter probe under emulation")
    p.add_argument("-k", type=int, default=None, help="a fixed draft length: the probe checks verify widths 2..k+1")
    args = p.parse_args(argv)
    before = checksums(args.bundle)
    # speculative first: its load settles the target's exact mode, which the plain load then reads
    # from the cache instead of probing the widths of the default drafting again
    runs = {b: {mode: greedy(args.bundle, b, args.prompts, args.max_tokens, mode == "speculative", args.max_context,
                             args.k)
                for mode in ("speculative", "plain")} for b in args.backend}
    out = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch_installed": importlib.util.find_spec("torch") is not None,
        "checksums": before,
        "unchanged_by_loading": checksums(args.bundle) == before,
        "runs": runs,
    }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
