"""Would a per-row int8 head verify cheaper? (issue 22, item 3: measured, not adopted)

    python dev/head_int8_rows.py [--bundle BUNDLE] [--out dev/results/head_int8_rows.json]

The default target's head (Gemma 3's tied 262,144 x 640 table, Q8_0) is MatMulNBits with
activations quantized to int8 per 32-wide block (accuracy_level 4). From four rows on, a verify
pays ~3.3 ms per row for it: compute-bound, the per-block scales in the inner loop. onnxruntime's
plain int8 GEMM (MatMulInteger, MLAS QGEMM) has no per-block scales and runs several times faster
per row, but needs one scale per weight row and one per activation row. This measures that head
against the shipped one on real final hidden states of the default model (its target's body on
the bench prompts): ms per call at 1-16 rows (the heads alternated), and top-1 agreement with the
table's exact (float64) logits. Weights requantized per row to 8 bits (MLAS's u8s8 AVX2 kernel
may saturate its 16-bit pair sums) and to 7 bits (cannot saturate), each with activation rows in
one int8 part or two (the remainder quantized again). Activation rows are quantized on their own,
so a row's logits do not depend on the rows beside it (checked): exactness would hold.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROWS = (1, 2, 4, 8, 16)


def per_row_head(table: np.ndarray, bits: int, parts: int = 1):
    """An onnxruntime session: hidden (1, M, K) -> (M, N) logits of `table` requantized per row to
    `bits` (symmetric). Activations per row to uint8 with zero point 128; with parts=2 the
    remainder is quantized again, so a row is two uint8 rows (about 15 bits) and the product
    runs over 2M rows."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    qmax = (1 << (bits - 1)) - 1
    scale = np.abs(table).max(1) / qmax
    scale[scale == 0] = 1
    codes = np.clip(np.rint(table / scale[:, None]), -qmax, qmax).astype(np.int8)
    n, k = table.shape
    const = lambda a, name: numpy_helper.from_array(np.asarray(a), name)  # noqa: E731
    inits = [const(np.ascontiguousarray(codes.T), "w"), const(scale.astype(np.float32), "ws"),
             const(np.float32(127), "c127"), const(np.float32(128), "c128"), const(np.float32(1e-30), "eps"),
             const(np.uint8(128), "zp"), const(np.array([-1, k], np.int64), "shape")]
    node = helper.make_node
    nodes = [node("Reshape", ["hidden", "shape"], ["x0"])]
    for p in range(parts):  # part p quantizes what the parts before it left: x{p} -> q{p} * s{p}
        nodes += [node("Abs", [f"x{p}"], [f"a{p}"]), node("ReduceMax", [f"a{p}"], [f"m{p}"], keepdims=1, axes=[1]),
                  node("Max", [f"m{p}", "eps"], [f"n{p}"]), node("Div", [f"n{p}", "c127"], [f"s{p}"]),
                  node("Div", [f"x{p}", f"s{p}"], [f"d{p}"]), node("Round", [f"d{p}"], [f"r{p}"]),
                  node("Add", [f"r{p}", "c128"], [f"u{p}"]), node("Cast", [f"u{p}"], [f"q{p}"], to=TensorProto.UINT8),
                  node("Mul", [f"r{p}", f"s{p}"], [f"b{p}"]), node("Sub", [f"x{p}", f"b{p}"], [f"x{p + 1}"])]
    if parts == 1:
        nodes += [node("MatMulInteger", ["q0", "w", "zp"], ["acc"]),
                  node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
                  node("Mul", ["accf", "ws"], ["y1"]), node("Mul", ["y1", "s0"], ["logits"])]
    else:
        nodes += [node("Concat", ["q0", "q1"], ["qq"], axis=0), node("MatMulInteger", ["qq", "w", "zp"], ["acc"]),
                  node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
                  node("Concat", ["s0", "s1"], ["ss"], axis=0), node("Mul", ["accf", "ss"], ["y0"]),
                  node("Split", ["y0"], ["h0", "h1"], axis=0),
                  node("Add", ["h0", "h1"], ["y1"]), node("Mul", ["y1", "ws"], ["logits"])]
    graph = helper.make_graph(nodes, "per_row_head",
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "M", k])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # the heads' pools take turns
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    from edgespec.bench.suites import encode_prompt, load_prompts
    from edgespec.bundle import load_bundle
    from edgespec.engine.engine import default_bundle
    from edgespec.exporters.gguf.source import read_gguf
    from edgespec.models.catalog import preset_source
    from edgespec.runtimes.onnxruntime.graphs import head_model, session
    from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime
    from edgespec.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "head_int8_rows.json")
    args = ap.parse_args()
    b = load_bundle(args.bundle or default_bundle())
    tok = Tokenizer(b.file(b.manifest.tokenizer.file), b.manifest.tokenizer)
    target = b.file(b.manifest.target.formats["onnx"].file)
    body = OnnxRuntime(target, threads=2, output="hidden")
    rows = []
    for cls in ("chat", "code", "grounded"):
        for p in load_prompts(cls):
            ids = encode_prompt(tok, p)
            body.reset()
            rows.append(np.array(body.forward(ids, n_logits=len(ids))).reshape(len(ids), -1)[::2])
    hidden = np.concatenate(rows).astype(np.float32)
    table = read_gguf(preset_source()).tensors["model.embed_tokens.weight"].dequantize().astype(np.float32)
    truth = np.concatenate([(hidden[i:i + 64].astype(np.float64) @ table.T.astype(np.float64)).argmax(1)
                            for i in range(0, len(hidden), 64)])
    shipped = session(head_model(target), target.parent, threads=2, spin=False, initializers={})
    heads = {"shipped (MatMulNBits Q8_0, accuracy_level 4)": lambda h: shipped.run(None, {"hidden": h})[0]}
    for bits, parts in ((8, 1), (7, 1), (8, 2), (7, 2)):
        s = per_row_head(table, bits, parts)
        name = f"per-row int{bits} weights, {'int8' if parts == 1 else 'two int8'} activations (MatMulInteger)"
        heads[name] = lambda h, s=s: s.run(None, {"hidden": h})[0]
    ms = {name: {m: [] for m in ROWS} for name in heads}
    for _ in range(args.repeat):  # alternated: a slow patch of the machine hits every head
        for m in ROWS:
            for name, run in heads.items():
                t0 = time.perf_counter()
                run(hidden[None, :m])
                ms[name][m].append(1e3 * (time.perf_counter() - t0))
    result = {"rows": len(hidden), "heads": {}}
    for name, run in heads.items():
        top = np.concatenate([run(hidden[None, i:i + 8]).reshape(-1, len(table)).argmax(1)
                              for i in range(0, len(hidden), 8)])
        alone = run(hidden[None, 3:4]).reshape(-1)
        beside = run(hidden[None, :8]).reshape(8, -1)[3]
        result["heads"][name] = {
            "ms_by_rows": {m: round(float(np.median(v)), 2) for m, v in ms[name].items()},
            "top1_agreement_with_exact": round(float((top == truth).mean()), 4),
            "row_independent_of_batch": bool(np.array_equal(alone, beside)),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
