"""Greedy agreement with the exact product of a GGUF's blocks, edgespec and llama.cpp side by side.

Issue 42's yardstick compares edgespec's greedy text with llama-cpp-python's on the same file. Both
round the activations to 8 bits per block before the integer products, each its own way, so where
they part may be either one's rounding. Here each quant type is also decoded by llama-cpp-python on
the file expanded to F32 by llama.cpp's own quantizer (each block dequantized as its kernels do, F32
KV cache): the exact product of the same blocks. Per held-out prompt, the tokens before the first
difference: edgespec vs exact, llama.cpp vs exact, edgespec vs llama.cpp; medians per type.

    python dev/iq_quants/exact_agreement.py [--types Q4_K_M,IQ4_XS,IQ4_NL,Q3_K_M,Q2_K] [--tokens 64]
                                            [--work DIR] [--out dev/results/iq_quants_exact.md]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from heldout_agreement import export, first_difference, llama_cpp, ours  # noqa: E402

from edgespec.bench.suites import encode_prompt, load_prompts  # noqa: E402
from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.exporters.gguf.export import quantize  # noqa: E402
from edgespec.models.catalog import preset_source  # noqa: E402
from edgespec.tokenizer import Tokenizer  # noqa: E402

FTYPES = {"F32": 0, "Q4_K_M": 15, "IQ4_XS": 30, "IQ4_NL": 25, "Q3_K_M": 12, "Q2_K": 10, "Q5_K_M": 17}


def files_for(name: str, work: Path) -> tuple[Path, Path]:
    """(the quant type's GGUF, its F32 expansion), made from one F32 expansion of the default file."""
    src = preset_source()
    f32 = work / "F32.gguf"
    if not f32.exists():
        quantize(src, f32, FTYPES["F32"], threads=2, allow_requantize=True)
    q = src if name == "Q4_K_M" else work / f"{name}.gguf"
    if not q.exists():
        quantize(f32, q, FTYPES[name], threads=2)
    exact = work / f"{name}-as-F32.gguf"
    if not exact.exists():
        quantize(q, exact, FTYPES["F32"], threads=2, allow_requantize=True)
    return q, exact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K_M,IQ4_XS,IQ4_NL,Q3_K_M,Q2_K")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "edgespec-exact-agreement")
    ap.add_argument("--out", type=Path, default=ROOT / "dev" / "results" / "iq_quants_exact.md")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(str(ROOT / "benchmarks" / "data" / "heldout.jsonl"))
    t0, rows, tok = time.perf_counter(), {}, None
    for name in [t.strip() for t in args.types.split(",") if t.strip()]:
        q, exact = files_for(name, args.work)
        bundle = export(q, args.work / f"{name}.bundle")
        if tok is None:
            b = load_bundle(bundle)
            tok = Tokenizer(bundle / b.manifest.tokenizer.file, b.manifest.tokenizer)
        ids = [encode_prompt(tok, p) for p in prompts]
        mine = ours(bundle, ids, args.tokens, args.threads)
        theirs = llama_cpp(q, ids, args.tokens, True, args.threads)
        truth = llama_cpp(exact, ids, args.tokens, True, args.threads)
        rows[name] = ([first_difference(a, r) for a, r in zip(mine, truth)],
                      [first_difference(a, r) for a, r in zip(theirs, truth)],
                      [first_difference(a, r) for a, r in zip(mine, theirs)])
        print(name, [statistics.median(r) for r in rows[name]], f"{time.perf_counter() - t0:.0f} s", flush=True)
    lines = ["# Gemma 3 270M per quant type: greedy tokens before the first difference from the exact product",
             "",
             f"`python dev/iq_quants/exact_agreement.py --tokens {args.tokens}`: {len(prompts)} held-out prompts "
             "(benchmarks/data/heldout.jsonl, the bundle's chat rendering), greedy, the same prompt ids everywhere, "
             f"{args.tokens} tokens at most (a prompt that never differs counts {args.tokens}). exact: "
             "llama-cpp-python on the file expanded to F32 by llama.cpp's quantizer (F32 KV cache); edgespec: the "
             "file exported to ONNX (its own blocks); llama.cpp: llama-cpp-python on the file (F32 KV cache).",
             "",
             "| type | edgespec vs exact: median (mean) | llama.cpp vs exact: median (mean) "
             "| edgespec vs llama.cpp: median (mean) |",
             "| --- | --- | --- | --- |"]
    for name, (a, b, c) in rows.items():
        cells = [f"{statistics.median(r):g} ({statistics.mean(r):.1f})" for r in (a, b, c)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
