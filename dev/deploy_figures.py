"""The figures of docs/deploy.md: the default model's GGUF on llama.cpp's own server as `edgespec
deploy` runs it (weights not repacked, every speculative flag spelled out), without a draft, with
drafts of two costs, with its prompt-lookup types, and with the target over two rpc-server workers
on this machine.

    python dev/deploy_figures.py [--out dev/results/deploy] [--prompts chat,code,grounded] [--repeat 2]
                                 [--max-tokens 64] [--threads 2] [--draft-layers 6]

Configurations, interleaved per prompt and repeat (the order rotated), greedy, each run from an
empty cache to the end of the turn or --max-tokens, the prompt's token ids posted to /completion
and timed by the server's own `timings` (decode tokens after the first over the time after it):
- plain: `--spec-type none`
- draft, layer cut: the bundle's `--draft-layers N` draft (`export --format gguf --draft-layers N`)
- draft, the target itself: a draft that agrees on every token but costs a whole target forward
- ngram-simple, ngram-mod: llama.cpp's prompt lookup
- plain over RPC: the target's layers on two local rpc-server workers
The built-in prompt suites, not the held-out set. Writes out/figures.json and out/figures.md and
prints the table, naming the CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def export(work: Path, layers: int) -> Path:
    bundle = work / f"gemma3-270m-d{layers}.bundle"
    if not (bundle / "edgespec.json").is_file():
        from edgespec.exporters.export import ExportConfig, export_bundle
        from edgespec.models.catalog import preset_source

        export_bundle(ExportConfig(output=bundle, target=preset_source("gemma3-270m"), formats=("gguf",),
                                   draft_layers=layers, draft_vocab=None, force=True))
    return bundle


def configs(bundle: Path, workers: tuple[str, ...], threads: int) -> dict:
    """name -> ServerOptions, as `edgespec deploy` builds them (weights not repacked)."""
    from edgespec.bundle import load_bundle
    from edgespec.deploy import ServerOptions, SpecSettings
    from edgespec.deploy.command import bundle_models

    target, cut, _ = bundle_models(load_bundle(bundle))
    base = dict(model=target, threads=threads, context=4096, parallel=1, repack=False)
    return {
        "plain": ServerOptions(**base),
        "draft, layer cut": ServerOptions(**base, spec=SpecSettings(type="draft-simple"), draft=cut),
        "draft, the target itself": ServerOptions(**base, spec=SpecSettings(type="draft-simple"), draft=target),
        "ngram-simple": ServerOptions(**base, spec=SpecSettings(type="ngram-simple")),
        "ngram-mod": ServerOptions(**base, spec=SpecSettings(type="ngram-mod")),
        "plain over 2 rpc workers": ServerOptions(**base, rpc=workers),
    }


def measure(servers: dict, prompts: list[tuple[str, list[int]]], stop_ids, args) -> dict:
    from edgespec.bench.server_peer import completion_body, record_from_response
    from edgespec.decoding import SamplingParams

    runs: dict[str, list] = {name: [] for name in servers}
    names = list(servers)
    for rep in range(args.repeat):
        for i, (cls, ids) in enumerate(prompts):
            shift = (rep + i) % len(names)
            for name in names[shift:] + names[:shift]:
                doc = servers[name].post("/completion", completion_body(ids, args.max_tokens, SamplingParams(), True))
                runs[name].append(dataclasses.replace(record_from_response(doc, len(ids), stop_ids), cls=cls))
    return runs


def figures(runs: dict) -> dict:
    out = {}
    plain = runs["plain"]
    for name, rs in runs.items():
        tokens, secs = sum(r.decode_tokens for r in rs), sum(r.decode_s for r in rs)
        drafted, accepted = sum(r.drafted for r in rs), sum(r.accepted for r in rs)
        out[name] = {"tok_s": tokens / secs if secs else 0.0, "acceptance": accepted / drafted if drafted else None,
                     "drafted": drafted, "same_tokens_as_plain": sum(a.tokens == b.tokens for a, b in zip(rs, plain)),
                     "runs": len(rs)}
    return out


def table(figs: dict, meta: dict) -> str:
    base = figs["plain"]["tok_s"]
    lines = [f"{meta['cpu']}, {meta['threads']} threads, load average {meta['load']:.1f} at the start; "
             f"{meta['prompts']} prompts ({meta['n_prompts']}) x {meta['repeat']} repeats, greedy, up to "
             f"{meta['max_tokens']} tokens or the end of the turn; decode tok/s by llama-server's own timings, "
             "ratio of totals.", "",
             "| llama-server | decode tok/s | over plain | acceptance | runs with plain's tokens |",
             "| --- | --- | --- | --- | --- |"]
    for name, f in figs.items():
        acc = "–" if f["acceptance"] is None else f"{f['acceptance']:.0%} of {f['drafted']}"
        lines.append(f"| {name} | {f['tok_s']:.1f} | {f['tok_s'] / base:.2f}x | {acc} | "
                     f"{f['same_tokens_as_plain']} of {f['runs']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "deploy")
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgespec-deploy-figures"), help="where the bundle goes")
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--prompts", default="chat,code,grounded")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import dataclasses
    import os
    from contextlib import ExitStack

    from edgespec.bench.machine import machine_info
    from edgespec.bench.suites import encode_prompt, load_prompts
    from edgespec.bundle import load_bundle
    from edgespec.deploy import locate, read_help, server_argv
    from edgespec.deploy.process import RpcWorker, ServerProcess, free_port
    from edgespec.tokenizer import Tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    bundle = export(args.work, args.draft_layers)
    b = load_bundle(bundle)
    tok = Tokenizer(b.file(b.manifest.tokenizer.file), b.manifest.tokenizer)
    prompts = [(p.cls, encode_prompt(tok, p)) for p in load_prompts(args.prompts)]
    build = locate()
    h = read_help(build.server)
    with ExitStack() as stack:
        workers = tuple(stack.enter_context(RpcWorker(build.rpc_server, threads=args.threads)).address
                        for _ in range(2))
        servers = {}
        for name, o in configs(bundle, workers, args.threads).items():
            port = free_port()
            o = dataclasses.replace(o, port=port)
            servers[name] = stack.enter_context(ServerProcess(server_argv(h, o), host=o.host, port=port))
        meta = {"cpu": machine_info()["cpu"], "threads": args.threads, "load": os.getloadavg()[0],
                "prompts": args.prompts, "n_prompts": len(prompts), "repeat": args.repeat,
                "max_tokens": args.max_tokens, "build": build.record(), "python": platform.python_version()}
        runs = measure(servers, prompts, tok.stop_ids, args)
    figs = figures(runs)
    (args.out / "figures.json").write_text(json.dumps({"meta": meta, "figures": figs}, indent=2) + "\n")
    text = table(figs, meta)
    (args.out / "figures.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
