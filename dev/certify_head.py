"""Can a greedy verify skip the full 262k-row head? (issue 22, item 3: measured, not adopted)

    python dev/certify_head.py [--bundle BUNDLE] [--out dev/results/certify_head.json]

The idea: compute only the draft's VocabTrim rows of the head (16k of 262k) for a verify row, and
a cheap upper bound on every other row's logit; where the best VocabTrim logit beats the bound,
the argmax is certified without the full head (exact), else the full head runs. This measures
the certified fraction on real final hidden states of the default model (its target's body,
onnxruntime, output="hidden") with two bounds over the excluded rows e_j of the tied table:
  - Cauchy-Schwarz: h.e_j <= |h| max_j |e_j|;
  - clusters: k-means centres c with radii r: h.e_j <= h.c + |h| r (256 and 2048 clusters).
A second idea screens with a cheap head instead of skipping it: every row's logit from the table
requantized per row to int8 (onnxruntime's MatMulInteger runs that 2x faster than the shipped
head at 8 rows, dev/head_int8_rows.py), then the exact logit only for the rows the
screen's error bound cannot rule out. With x = x' + dx and e = e' + de (the int8 values and their
rounding residuals), |h.e - x'.e'| <= |dx| |e| + |x'| |de| (Cauchy-Schwarz, both residuals known);
a row is certified when one candidate is left, and the screen pays only if few are. With 8-bit
weights MLAS's u8s8 AVX2 kernel may saturate its 16-bit pair sums (the screen's value is then not
the product the bound assumes); 7-bit weights cannot saturate: both are reported.
It needs the GGUF's dequantized table (gguf-py, ~0.7 GB of float32).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

TEXTS = ["The capital of France is Paris. The capital of Italy is",
         "def reverse(s):\n    return s[::-1]\n\ndef is_even(n):",
         "Once upon a time, in a small village by the sea, there lived an old fisherman who",
         "Water boils at 100 degrees Celsius at sea level. At higher altitudes,"]


def kmeans_bound(x: np.ndarray, hidden: np.ndarray, k: int, rng, iterations: int = 6) -> np.ndarray:
    """Per hidden row, max over clusters of h.c + |h| r (an upper bound on h.e for every e in x)."""
    centres = x[rng.choice(len(x), k, replace=False)].copy()
    assign = np.empty(len(x), np.int64)
    for _ in range(iterations):
        for s in range(0, len(x), 32768):
            blk = x[s:s + 32768]
            d = (blk ** 2).sum(1)[:, None] - 2 * blk @ centres.T + (centres ** 2).sum(1)[None]
            assign[s:s + 32768] = d.argmin(1)
        for c in range(k):
            members = x[assign == c]
            if len(members):
                centres[c] = members.mean(0)
    radius = np.zeros(k, np.float32)
    np.maximum.at(radius, assign, np.linalg.norm(x - centres[assign], axis=1))
    return (hidden @ centres.T + np.linalg.norm(hidden, axis=1)[:, None] * radius[None]).max(1)


def int8_screen(table: np.ndarray, hidden: np.ndarray, weight_bits: int = 8) -> np.ndarray:
    """Per hidden row, how many table rows the per-row int8 screen (weights to `weight_bits` and
    activations to 8 bits, each with one scale per row) leaves as possible argmax under its
    rigorous error bound."""
    q = 127
    ws = np.abs(table).max(1) / ((1 << (weight_bits - 1)) - 1)
    wq = np.rint(table / ws[:, None])
    e_norm, de_norm = np.linalg.norm(table, axis=1), np.linalg.norm(table - wq * ws[:, None], axis=1)
    xs = np.abs(hidden).max(1) / q
    xq = np.rint(hidden / xs[:, None]) * xs[:, None]
    approx = (xq @ (wq * ws[:, None]).T).astype(np.float64)  # exact in int32 arithmetic, up to float rounding
    bound = np.linalg.norm(hidden - xq, axis=1)[:, None] * e_norm + np.linalg.norm(xq, axis=1)[:, None] * de_norm
    bound = bound * (1 + 1e-5) + 1e-4  # the float rounding of the screen itself
    best_low = (approx - bound).max(1)
    return (approx + bound >= best_low[:, None]).sum(1)


def main() -> None:
    from edgespec.bundle import load_bundle
    from edgespec.engine.engine import default_bundle
    from edgespec.exporters.gguf.source import read_gguf
    from edgespec.models.catalog import preset_source
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime
    from edgespec.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "certify_head.json")
    args = ap.parse_args()
    b = load_bundle(args.bundle or default_bundle())
    tok = Tokenizer(b.file(b.manifest.tokenizer.file), b.manifest.tokenizer)
    keep = np.load(b.file(b.manifest.draft.id_map))
    table = read_gguf(preset_source()).tensors["model.embed_tokens.weight"].dequantize().astype(np.float32)
    rest = table[np.setdiff1d(np.arange(len(table)), keep)]
    body = OnnxRuntime(b.file(b.manifest.target.formats["onnx"].file), threads=2, output="hidden")
    rows = []
    for text in TEXTS:
        ids = tok.encode(text)
        body.reset()
        rows.append(np.array(body.forward(ids, n_logits=len(ids))).reshape(len(ids), -1))
    hidden = np.concatenate(rows)
    logits = hidden @ table.T
    best_kept = logits[:, keep].max(1)
    norms = np.linalg.norm(hidden, axis=1)
    bounds = {"cauchy_schwarz": norms * np.linalg.norm(rest, axis=1).max()}
    rng = np.random.default_rng(0)
    for k in (256, 2048):
        bounds[f"kmeans_{k}"] = kmeans_bound(rest, hidden, k, rng)
    result = {
        "rows": len(hidden), "vocabtrim_rows": len(keep),
        "argmax_in_vocabtrim": float(np.isin(logits.argmax(1), keep).mean()),
        "median_best_vocabtrim_logit": float(np.median(best_kept)),
        "bounds": {name: {"certified": float((best_kept > bd).mean()), "median_bound": float(np.median(bd))}
                   for name, bd in bounds.items()},
    }
    result["int8_screen"] = {}
    for bits in (8, 7):  # 7-bit weights: MLAS's u8s8 AVX2 kernel cannot saturate, so its product is exact
        left = int8_screen(table, hidden, bits)
        result["int8_screen"][f"{bits}-bit weights"] = {
            "certified": float((left == 1).mean()), "median_candidates": float(np.median(left)),
            "p90_candidates": float(np.quantile(left, 0.9)), "max_candidates": int(left.max())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
