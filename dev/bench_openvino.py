"""OpenVINO side by side, in one process, on the same IR weights:

1. The runtime's exact mode (KV in edgespec's buffer, dynamic int8 activations, keys and queries
   padded in the attention, one-row decodes), plain and with the same drafting. The previous mode
   (KV in OpenVINO's state, f32 activations), measured against it in the results recorded up to
   2026-11-27, is a test baseline now (tests/ov_state_kv.py), which dev/ does not import.
2. OpenVINO GenAI's LLMPipeline (plain decode, and with draft_model when it accepts the IR)
   against edgespec plain and speculative (the draft model alone, and the default drafting:
   prompt lookup plus the model under the cost policy, with the draft on the target's body
   where `draft_body="auto"` picks it, and on its own body), per target precision.

GenAI reads a stateful copy of the bundle's own IR (runtimes.openvino_graph.make_stateful, plus the
beam_idx input and last-position logits GenAI expects), so both sides run the same compressed
weights. Configurations are interleaved per prompt; medians are reported, since the 2 cores
are shared with other jobs.

    python dev/bench_openvino.py BUNDLE [BUNDLE...] [--tokens 64] [--reps 3] [--prompts chat,code]
                                      [--only NAMES] [--out report.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["genai_model", "main"]

logger = logging.getLogger(__name__)

PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a short story about a lighthouse keeper who",
]


def genai_model(xml: Path):
    """The bundle's IR as GenAI's LLMPipeline wants it: stateful, a beam_idx input, and logits for
    the last position only."""
    import openvino as ov
    import openvino.opset13 as ops

    from edgespec.runtimes.openvino.graph import make_stateful

    model = ov.Core().read_model(str(xml))
    make_stateful(model)
    ids = model.input("input_ids").get_node()
    s = ops.gather(ops.shape_of(ids), ops.constant(1), ops.constant(0))
    last = ops.range(ops.subtract(s, ops.constant(1, np.int64)), s, ops.constant(1, np.int64), "i64")
    li = model.input("logits_index").get_node()
    li.output(0).replace(last.output(0))
    model.remove_parameter(li)
    beam = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    beam.output(0).set_names({"beam_idx"})
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            consumers = list(op.output(0).get_target_inputs())
            gathered = ops.gather(op.output(0), beam, ops.constant(0))
            for c in consumers:  # taken before the Gather existed: it is not among them
                c.replace_source_output(gathered.output(0))
    model.add_parameters([beam])
    model.validate_nodes_and_infer_types()
    return model


def _edgespec_run(engine, ids, n_new):
    """Decode tok/s after the first token (as GenAI's throughput), exactly n_new tokens: no stop
    ids, as GenAI runs with ignore_eos."""
    import time

    from edgespec.decoding import SamplingParams

    tokens = list(ids)
    t_first = n_first = None
    for _ in engine.decoder.stream(tokens, SamplingParams(), n_new):
        if t_first is None:  # the first step includes the prompt: time the rest
            t_first, n_first = time.perf_counter(), len(tokens) - len(ids)
    rate = (len(tokens) - len(ids) - n_first) / (time.perf_counter() - t_first)
    for rt in filter(None, (engine.decoder.target, engine.decoder.draft)):
        rt.reset()  # every run starts cold; the trackers see the reset and follow
    return rate, tokens[len(ids):]


def _genai_dir(bundle: Path, role: str, root: Path) -> Path:
    """A folder LLMPipeline reads: the stateful IR, tokenizer IRs, a config."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import PreTrainedTokenizerFast

    from edgespec.bundle import load_bundle

    m = load_bundle(bundle).manifest
    entry = getattr(m, role)
    out = root / f"{bundle.name}-{role}"
    out.mkdir(parents=True, exist_ok=True)
    ov.save_model(genai_model(bundle / entry.formats["openvino"].file),
                  str(out / "openvino_model.xml"), compress_to_fp16=False)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(bundle / m.tokenizer.file))
    tok, detok = convert_tokenizer(hf_tok, with_detokenizer=True)
    ov.save_model(tok, str(out / "openvino_tokenizer.xml"))
    ov.save_model(detok, str(out / "openvino_detokenizer.xml"))
    cfg = {"model_type": m.model_type, "eos_token_id": m.tokenizer.stop_token_ids,
           "bos_token_id": m.tokenizer.bos_token_id}
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "generation_config.json").write_text(json.dumps(cfg))
    return out


def _genai_run(pipe, ids, n_new):
    import openvino as ov
    import openvino_genai as og

    cfg = og.GenerationConfig()
    cfg.max_new_tokens, cfg.ignore_eos, cfg.do_sample = n_new, True, False
    if getattr(pipe, "edgespec_k", None):
        cfg.num_assistant_tokens = pipe.edgespec_k
    res = pipe.generate(ov.Tensor(np.asarray([ids], dtype=np.int64)), cfg)
    return res.perf_metrics.get_throughput().mean, list(res.tokens[0])


def _bench_bundle(bundle: Path, args, tmp: Path, report: dict) -> None:
    """Every configuration on one bundle, interleaved per prompt; results go into `report`."""
    from edgespec.bundle import load_bundle
    from edgespec.engine.engine import load

    b = load_bundle(bundle)
    prec = b.manifest.target.formats["openvino"].precision
    configs = {}
    plain = load(bundle, backend="openvino", use_draft=False, threads=args.threads)
    spec = load(bundle, backend="openvino", drafter="model", k=args.k, threads=args.threads)
    configs["edgespec plain"] = lambda ids, e=plain: _edgespec_run(e, ids, args.tokens)
    configs["edgespec spec"] = lambda ids, e=spec: _edgespec_run(e, ids, args.tokens)
    default = load(bundle, backend="openvino", threads=args.threads)  # prompt lookup + model, cost policy
    configs["edgespec spec (default drafting)"] = lambda ids, e=default: _edgespec_run(e, ids, args.tokens)
    own = load(bundle, backend="openvino", threads=args.threads, draft_body="own")  # the draft's own body
    configs["edgespec spec (default drafting; own draft body)"] = lambda ids, e=own: _edgespec_run(e, ids, args.tokens)
    lookup = load(bundle, backend="openvino", drafter="ngram", threads=args.threads)
    configs["edgespec spec (prompt lookup)"] = lambda ids, e=lookup: _edgespec_run(e, ids, args.tokens)
    if not args.no_genai:
        try:
            import openvino_genai as og

            tdir = _genai_dir(bundle, "target", tmp)
            gp = og.LLMPipeline(str(tdir), "CPU", INFERENCE_PRECISION_HINT="f32")
            configs["genai plain f32"] = lambda ids, g=gp: _genai_run(g, ids, args.tokens)
            gb = og.LLMPipeline(str(tdir), "CPU")
            configs["genai plain default(bf16)"] = lambda ids, g=gb: _genai_run(g, ids, args.tokens)
        except Exception as e:  # report what GenAI refused, keep the rest
            logger.warning("OpenVINO GenAI plain: %s", str(e).splitlines()[0])
            report.setdefault("errors", []).append(f"genai plain: {str(e).splitlines()[0]}")
        if args.genai_draft is not None:  # GenAI needs a full-vocabulary draft: another bundle's target
            try:
                import openvino_genai as og

                ddir = _genai_dir(args.genai_draft, "target", tmp)
                gs = og.LLMPipeline(str(tdir), "CPU", draft_model=og.draft_model(str(ddir), "CPU"))
                gs.edgespec_k = args.k
                configs["genai spec"] = lambda ids, g=gs: _genai_run(g, ids, args.tokens)
            except Exception as e:
                logger.warning("OpenVINO GenAI speculative: %s", str(e).splitlines()[0])
                report.setdefault("errors", []).append(f"genai spec: {str(e).splitlines()[0]}")
    if args.only:
        keep = {c.strip() for c in args.only.split(",")} | {"edgespec plain"}
        configs = {k: v for k, v in configs.items() if k in keep}
    if args.prompts:
        from edgespec.bench.suites import encode_prompt, load_prompts

        ids_list = [encode_prompt(spec.tokenizer, pr) for pr in load_prompts(args.prompts)]
    else:
        ids_list = [spec.tokenizer.encode(t) for t in PROMPTS]
    times: dict[str, list[float]] = {k: [] for k in configs}
    outs: dict[str, list] = {k: [] for k in configs}
    for r in range(args.reps):
        for ids in ids_list:
            for name, run in configs.items():  # interleaved: contention hits all alike
                tps, toks = run(ids)
                times[name].append(tps)
                if r == 0:
                    outs[name].append(toks)
    med = {k: statistics.median(v) for k, v in times.items()}
    # per prompt and repetition against edgespec plain, run next to it: a busy minute slows both
    base = times["edgespec plain"]
    paired = {k: statistics.median(t / b for t, b in zip(v, base)) for k, v in times.items()}
    same = {k: outs[k] == outs["edgespec plain"] for k in outs}
    report[f"{bundle.name} ({prec})"] = {"median_tok_s": med, "median_paired_ratio_to_edgespec_plain": paired,
                                         "same_tokens_as_edgespec_plain": same}
    print(f"\n{bundle.name}: target {prec}, {args.tokens} new tokens, {args.reps} reps x {len(ids_list)} prompts")
    for k in configs:
        print(f"  {k:<50} {med[k]:7.1f} tok/s  x{paired[k]:.2f} paired   same tokens as edgespec plain: {same[k]}")
    for e in (plain, spec, default, own, lookup):
        e.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundles", nargs="+", type=Path)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("-k", type=int, default=4, help="draft length (fixed policy) for every speculative run")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-genai", action="store_true")
    p.add_argument("--genai-draft", type=Path, default=None,
                   help="a bundle whose (full-vocabulary) target IR serves as GenAI's draft_model")
    p.add_argument("--prompts", default=None,
                   help="a bench suite (chat, code, ... as `edgespec bench --prompts`) "
                        "instead of the 3 built-in prompts")
    p.add_argument("--only", default=None, help="comma-separated config names to run (default: all)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="edgespec-ovbench-") as scratch:  # GenAI's copies of the IR
        for bundle in args.bundles:
            _bench_bundle(bundle, args, Path(scratch), report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
