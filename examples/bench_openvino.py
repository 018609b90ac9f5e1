"""OpenVINO side by side, in one process, on the same IR weights:

1. KV rollback: edgespec's buffer KV layout (the shipped one: the runtime owns the cache, rollback
   is a length) against a stateful IR whose OpenVINO state is trimmed on rollback (the state
   is read, sliced and written back), plain and speculative.
2. OpenVINO GenAI's LLMPipeline (plain decode, and with draft_model when it accepts the IR)
   against edgespec plain and speculative, per target precision.

The stateful / GenAI IR is made from the bundle's own IR by graph surgery (new KV rows → full
present, KV inputs → OpenVINO state, a beam_idx input), so both sides run the same compressed
weights. Configurations are interleaved per repetition; medians are reported, since the 2 cores
are shared with other jobs.

    python examples/bench_openvino.py BUNDLE [BUNDLE...] [--tokens 64] [--reps 3] [--out report.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["stateful_model", "StatefulRuntime", "main"]

logger = logging.getLogger(__name__)

PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a short story about a lighthouse keeper who",
]


def stateful_model(xml: Path, for_genai: bool):
    """The bundle's buffer-layout IR made stateful: past_* become OpenVINO state holding the full
    present; for GenAI also a beam_idx input and logits for the last position only."""
    import openvino as ov
    import openvino.opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    model = ov.Core().read_model(str(xml))
    pairs = []
    for res in list(model.get_results()):
        name = res.output(0).get_any_name() if res.output(0).get_names() else res.get_friendly_name()
        if not name.startswith("new_"):
            continue
        present = res.input_value(0).get_node().input_value(0)  # Slice(Concat(past, new)) -> Concat
        kind, j = name.split("_")[1], name.split("_")[2]
        new_res = ops.result(present)
        new_res.output(0).set_names({f"present_{kind}_{j}"})
        model.add_results([new_res])
        model.remove_result(res)
        pairs.append((model.input(f"past_{kind}_{j}").get_node(), new_res))
    apply_make_stateful_transformation(model, pairs)
    if for_genai:
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


class StatefulRuntime:
    """edgespec's Runtime interface over a stateful IR: rollback trims every state tensor."""

    def __init__(self, model, threads=None, precision="f32") -> None:
        import openvino as ov

        from edgespec.runtimes.base import Capabilities

        self._ov = ov
        cfg = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
        if precision == "f32":  # as edgespec's runtime: the same kernels, so only the KV handling differs
            cfg["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
        if threads:
            cfg["INFERENCE_NUM_THREADS"] = threads
        self._req = ov.Core().compile_model(model, "CPU", cfg).create_infer_request()
        self.vocab_size = model.output("logits").get_partial_shape()[2].get_length()
        self.capabilities = Capabilities(backend="openvino-stateful")
        self._n = 0

    @property
    def n_past(self) -> int:
        return self._n

    def forward(self, token_ids, n_logits=1):
        S, n = len(token_ids), self._n
        n_logits = min(n_logits, S)
        self._req.infer({"input_ids": np.asarray([token_ids], dtype=np.int64),
                         "position_ids": np.arange(n, n + S, dtype=np.int64)[None],
                         "attention_mask": np.ones((1, n + S), dtype=np.int64),
                         "logits_index": np.arange(S - n_logits, S, dtype=np.int64)})
        self._n = n + S
        return np.array(self._req.get_tensor("logits").data[0])

    def trim(self, n_past):
        if n_past >= self._n:
            return
        if n_past == 0:
            self._req.reset_state()
        else:
            for st in self._req.query_state():
                st.state = self._ov.Tensor(np.ascontiguousarray(st.state.data[:, :, :n_past]))
        self._n = n_past

    def reset(self):
        self.trim(0)

    def memory_bytes(self):
        return {"weights": 0, "kv": 0}

    def close(self):
        self._req = None


def _edgespec_run(engine, ids, n_new):
    from edgespec.api import GenerationStats
    from edgespec.decoding import SamplingParams

    st = GenerationStats()
    tokens = list(ids)
    for _ in engine.stream_ids(tokens, SamplingParams(), n_new, stats=st):
        pass
    for rt in filter(None, (engine.decoder.target, engine.decoder.draft)):
        rt.reset()  # every run starts cold; the trackers see the reset and follow
    return st.tokens_per_s, tokens[len(ids):]


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
    ov.save_model(stateful_model(bundle / entry.formats["openvino"].file, for_genai=True),
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
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from edgespec.api import Engine
    from edgespec.bundle import load_bundle
    from edgespec.decoding import SpeculativeDecoder, make_policy

    report = {}
    tmp = Path(tempfile.mkdtemp(prefix="edgespec-ovbench-"))
    for bundle in args.bundles:
        b = load_bundle(bundle)
        prec = b.manifest.target.formats["openvino"].precision
        configs = {}
        plain = Engine(b, backend="openvino", use_draft=False, threads=args.threads)
        spec = Engine(b, backend="openvino", drafter="model", k=args.k, threads=args.threads)
        configs["edgespec plain"] = lambda ids, e=plain: _edgespec_run(e, ids, args.tokens)
        configs["edgespec spec"] = lambda ids, e=spec: _edgespec_run(e, ids, args.tokens)
        # stateful rollback, same weights, same decoder and drafter
        st_t = StatefulRuntime(stateful_model(bundle / b.manifest.target.formats["openvino"].file, False), args.threads)
        st_d = StatefulRuntime(stateful_model(bundle / b.manifest.draft.formats["openvino"].file, False), args.threads)
        st_engine = Engine(b, backend="openvino", use_draft=False, threads=args.threads)
        st_engine.decoder = SpeculativeDecoder(st_t, st_d, id_map=b.id_map(), drafter="model",
                                               policy=make_policy("fixed", args.k))
        configs["stateful spec"] = lambda ids, e=st_engine: _edgespec_run(e, ids, args.tokens)
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
        same = {k: outs[k] == outs["edgespec plain"] for k in outs}
        report[f"{bundle.name} ({prec})"] = {"median_tok_s": med, "same_tokens_as_edgespec_plain": same}
        print(f"\n{bundle.name}: target {prec}, {args.tokens} new tokens, {args.reps} reps x {len(PROMPTS)} prompts")
        for k in configs:
            print(f"  {k:<28} {med[k]:7.1f} tok/s   same tokens as edgespec plain: {same[k]}")
        for e in (plain, spec, st_engine):
            e.close()
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
