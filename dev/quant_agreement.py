"""Top-1 agreement and cost of draft quantization schemes on the default model (issue: VocabTrim).

    python dev/quant_agreement.py [--bundle B] [--schemes int8,int4,int4-asym,nncf-int4,nncf-int4-awq]
                                       [--tokens 48] [--json out.json]

The draft's quantization is part of the speculative trade: a scheme that disagrees with the target
wastes the draft's work. The target (the bundle's fp32 ONNX graph) samples continuations of the
built-in calibration prompts locally (no dataset download); half of them calibrate the data-aware
schemes (nncf AWQ + scale estimation), the other half measure agreement: teacher-forced on the same
sequences, the share of positions where the draft's argmax (mapped through the bundle's VocabTrim id
map) equals the target's. Draft ms/token is timed on one-token steps, the schemes interleaved.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

import edgespec
from edgespec.decoding import SamplingParams
from edgespec.exporters.onnx.graph import GraphOptions, build_decoder
from edgespec.exporters.onnx.quantize import SCHEMES, quantize_model
from edgespec.exporters.sources import load_source
from edgespec.exporters.spec import spec_from_hf
from edgespec.exporters.vocabtrim import builtin_prompts
from edgespec.models.catalog import preset_source
from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime


def sample_texts(engine, prompts: list[dict], tokens: int, seed: int) -> list[list[int]]:
    """Prompt + a sampled continuation (T=0.8) from the target, as token ids."""
    out = []
    for i, p in enumerate(prompts):
        if p["kind"] == "text":
            ids = engine.tokenizer.encode(p["text"])
        else:
            ids = engine.tokenizer.encode_chat(p.get("messages") or [{"role": "user", "content": p["text"]}])
        seq = list(ids)
        for _ in engine.stream_ids(seq, SamplingParams(temperature=0.8, seed=seed + i), tokens):
            pass
        out.append((len(ids), seq))
    return out


def argmax_run(rt, seq: list[int], id_map: np.ndarray | None) -> np.ndarray:
    rt.reset()
    logits = rt.forward(seq, n_logits=len(seq))
    rt.reset()
    top = logits.argmax(-1)
    return id_map[top] if id_map is not None else top


def nncf_compress(model: onnx.ModelProto, data: list[dict] | None) -> onnx.ModelProto:
    import nncf

    kw = dict(mode=nncf.CompressWeightsMode.INT4_ASYM, group_size=32, ratio=1.0)
    if data is not None:
        kw.update(dataset=nncf.Dataset(data), awq=True, scale_estimation=True, subset_size=len(data))
    return nncf.compress_weights(model, **kw)


def calib_inputs(seqs, n_layers: int, kv_heads: int, head_dim: int) -> list[dict]:
    empty = np.zeros((1, kv_heads, 0, head_dim), np.float32)
    items = []
    for _, seq in seqs:
        item = {"input_ids": np.asarray([seq], np.int64), "n_logits": np.asarray([1], np.int64)}
        for j in range(n_layers):
            item[f"past_key_{j}"] = empty
            item[f"past_value_{j}"] = empty
        items.append(item)
    return items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default=None, help="a bundle with a VocabTrim draft (its id map is used)")
    ap.add_argument("--schemes", default="int8,int4,int4-asym,nncf-int4,nncf-int4-awq")
    ap.add_argument("--prompts", type=int, default=16, help="half calibrate, half evaluate")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--timing-steps", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--samples", type=Path, default=None, help="cache the target's sampled sequences here")
    args = ap.parse_args()

    engine = edgespec.load(args.bundle, use_draft=False, drafter="none")
    id_map = engine.bundle.id_map()
    prompts = builtin_prompts()[: args.prompts]
    t0 = time.perf_counter()
    if args.samples and args.samples.exists():  # reuse: sampling is the slow part on a busy machine
        seqs = [tuple(x) for x in json.loads(args.samples.read_text())]
    else:
        seqs = sample_texts(engine, prompts, args.tokens, seed=0)
        if args.samples:
            args.samples.write_text(json.dumps(seqs))
    calib, evals = seqs[0::2], seqs[1::2]
    print(f"sampled {sum(len(s) - n for n, s in seqs)} target tokens in {time.perf_counter() - t0:.0f} s")
    target_top = [argmax_run(engine.target, s, None) for _, s in evals]

    source = load_source(preset_source())
    spec = spec_from_hf(source.model)
    weights = {k: v.detach().float().numpy() for k, v in source.model.state_dict().items()}
    opts = GraphOptions(vocab_keep=id_map, tie_head=False)

    def fp32():  # fresh each time: the quantizers edit the graph they are given
        return build_decoder(spec, weights, opts)

    schemes = {
        "int8": lambda: quantize_model(fp32(), SCHEMES["int8"]),
        "int4": lambda: quantize_model(fp32(), SCHEMES["int4"]),
        "int4-asym": lambda: quantize_model(fp32(), replace(SCHEMES["int4"], symmetric=False)),
        "nncf-int4": lambda: nncf_compress(fp32(), None),
        "nncf-int4-awq": lambda: nncf_compress(
            fp32(), calib_inputs(calib, spec.n_layers, spec.n_kv_heads, spec.head_dim)),
    }
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        runtimes = {}
        for name in args.schemes.split(","):
            t0 = time.perf_counter()
            model = schemes[name]()
            path = Path(tmp) / name / "model.onnx"
            path.parent.mkdir()
            onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data")
            rt = OnnxRuntime(path)
            ops = sorted({n.op_type for n in model.graph.node if n.op_type in
                          ("MatMulNBits", "DequantizeLinear", "GatherBlockQuantized", "MatMul", "Gemm")})
            hits = total = 0
            for (n_prompt, seq), ref in zip(evals, target_top):
                top = argmax_run(rt, seq, id_map)
                hits += int((top[n_prompt - 1:-1] == ref[n_prompt - 1:-1]).sum())
                total += len(seq) - n_prompt
            rows[name] = dict(agreement=hits / total, build_s=time.perf_counter() - t0, ops=ops,
                              mb=sum(p.stat().st_size for p in path.parent.iterdir()) / 2**20, ms=[])
            runtimes[name] = rt
            print(f"{name:<14} agreement {hits / total:.1%}  ({rows[name]['mb']:.0f} MB, ops {ops})", flush=True)
        # one-token step cost, schemes interleaved so a busy neighbour hits all alike
        ctx = evals[0][1][:32]
        for _ in range(args.repeat):
            for name, rt in runtimes.items():
                rt.reset()
                rt.forward(ctx)
                t0 = time.perf_counter()
                for t in ctx[: args.timing_steps]:
                    rt.forward([t])
                rows[name]["ms"].append(1000 * (time.perf_counter() - t0) / args.timing_steps)
        for rt in runtimes.values():
            rt.close()
    print(f"\ndraft: K={len(id_map)} head, {spec.n_layers} layers; eval {len(evals)} sequences "
          f"x {args.tokens} sampled tokens")
    print(f"{'scheme':<14} {'agreement':>9} {'ms/token':>9} {'MB':>6}")
    for name, r in rows.items():
        r["ms_median"] = statistics.median(r["ms"])
        print(f"{name:<14} {r['agreement']:>9.1%} {r['ms_median']:>9.1f} {r['mb']:>6.0f}")
    if args.json:
        args.json.write_text(json.dumps({"bundle": str(engine.bundle.path), "rows": rows}, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
