"""Sweep VocabTrim K × draft layers on the default model (issue: VocabTrim draft heads).

    python dev/sweep_vocabtrim.py [--bundle B] [--ks 4096,8192,16384,32768,full]
                                       [--layers 18,12,9] [--precision int4] [--json out.json]

Calibrates once, builds each draft in a temp dir, and for each one runs plain and speculative
greedy decoding alternately on the bundle's target (same process, same runtime), reporting
medians: draft ms/token, acceptance, tokens/step, end-to-end tok/s and the ratio to plain.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import onnx

import edgespec
from edgespec.bench import timed_decode
from edgespec.exporters.draft_shape import select_layers
from edgespec.exporters.onnx.graph import GraphOptions, build_decoder
from edgespec.exporters.onnx.quantize import SCHEMES, quantize_model
from edgespec.exporters.sources import load_source
from edgespec.exporters.spec import spec_from_hf
from edgespec.exporters.vocabtrim import always_kept_ids, builtin_prompts, calibrate, choose_vocab, coverage
from edgespec.models.catalog import preset_source
from edgespec.runtimes.onnxruntime.runtime import OnnxRuntime

PROMPTS = [
    "The history of the printing press begins",
    "def quicksort(items):\n    ",
    "<start_of_turn>user\nGive me three tips for better sleep.<end_of_turn>\n<start_of_turn>model\n",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--ks", default="4096,8192,16384,32768,full")
    ap.add_argument("--layers", default="18,12,9")
    ap.add_argument("--precision", default="int4", choices=sorted(SCHEMES))
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    engine = edgespec.load(args.bundle, use_draft=False)
    target = engine.target
    source = load_source(preset_source())
    spec = spec_from_hf(source.model)
    weights = {k: v.detach().float().numpy() for k, v in source.model.state_dict().items()}
    template = engine.bundle.manifest.tokenizer.chat_template
    cal = calibrate(source.model, source.tokenizer, builtin_prompts(), "built-in", chat_template=template)
    always = {i for i in always_kept_ids(source.tokenizer, spec.family) if i < spec.vocab_size}
    print(f"calibration: {cal.n_tokens} tokens; always kept: {len(always)}")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n_layers in (int(x) for x in args.layers.split(",")):
            layers = select_layers(spec.n_layers, n_layers)
            for k_str in args.ks.split(","):
                keep = None if k_str == "full" else choose_vocab(cal.counts, int(k_str), always)
                model = build_decoder(spec, weights, GraphOptions(layers=layers, vocab_keep=keep, tie_head=False))
                model = quantize_model(model, SCHEMES[args.precision])
                path = Path(tmp) / f"d_{n_layers}_{k_str}" / "model.onnx"
                path.parent.mkdir()
                onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data")
                del model
                with OnnxRuntime(path) as draft:
                    plain, spec_runs = [], []
                    for _ in range(args.repeat):
                        for ids in prompts:
                            plain.append(timed_decode(target, None, ids, args.max_tokens))
                            spec_runs.append(timed_decode(target, draft, ids, args.max_tokens, k=args.k, id_map=keep))
                same = all(s.tokens == p.tokens for s, p in zip(spec_runs, plain))
                row = {
                    "layers": n_layers, "K": k_str,
                    "coverage": round(coverage(cal.counts, keep), 4) if keep is not None else 1.0,
                    "draft_ms_per_token": round(statistics.median(r.draft_ms / r.drafted for r in spec_runs), 2),
                    "acceptance": round(statistics.median(r.acceptance for r in spec_runs), 3),
                    "tokens_per_step": round(statistics.median(r.mean_accepted_length for r in spec_runs), 2),
                    "plain_tok_s": round(statistics.median(r.tok_s for r in plain), 2),
                    "spec_tok_s": round(statistics.median(r.tok_s for r in spec_runs), 2),
                    "identical": same,
                }
                row["ratio"] = round(statistics.median(s.tok_s / p.tok_s for s, p in zip(spec_runs, plain)), 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
