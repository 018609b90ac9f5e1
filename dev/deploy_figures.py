"""The figures of docs/deploy.md: the default model's GGUF on llama.cpp's own server, without a
draft, with the bundle's layer-cut draft and with its prompt-lookup types, and the target split
over two rpc-server workers on this machine against one process.

    python dev/deploy_figures.py [--out dev/results/deploy] [--draft-layers 6] [--prompts chat,code,grounded]
                                 [--repeat 2] [--max-tokens 64] [--threads 2]

1. `edgespec export` the default model's GGUF with `--format gguf --draft-layers N` (once).
2. `edgespec bench` on it with the llama.cpp backend and the llama-server peers (plain,
   draft-simple, ngram-simple, ngram-mod), greedy, interleaved per prompt and repeat in one
   process, each server run timed by its own `timings`: out/bench.json and bench.log.
3. llama-server plain in one process against the same over two rpc-server workers on 127.0.0.1,
   interleaved per prompt and repeat, by the servers' timings: out/rpc.json.
The built-in prompt suites (not the held-out set). Prints a markdown table naming the CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = ["llama-server", "llama-server+draft-simple", "llama-server+ngram-simple", "llama-server+ngram-mod"]


def export(out: Path, layers: int) -> Path:
    bundle = out / f"gemma3-270m-d{layers}.bundle"
    if not (bundle / "edgespec.json").is_file():
        from edgespec.exporters.export import ExportConfig, export_bundle
        from edgespec.models.catalog import preset_source

        export_bundle(ExportConfig(output=bundle, target=preset_source("gemma3-270m"), formats=("gguf",),
                                   draft_layers=layers, draft_vocab=None, force=True))
    return bundle


def bench(bundle: Path, args) -> dict:
    out = args.out / "bench.json"
    cmd = [sys.executable, "-m", "edgespec", "bench", str(bundle), "--backend", "llamacpp", "--prompts", args.prompts,
           "--repeat", str(args.repeat), "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
           "--peers", ",".join(["llama.cpp", *PEERS]), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (args.out / "bench.log").write_text(f"$ edgespec {' '.join(cmd[3:])}\n\n{proc.stderr}\n{proc.stdout}")
    if proc.returncode != 0:
        raise SystemExit(f"bench failed: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def rpc(bundle: Path, args) -> dict:
    """llama-server plain in one process and over two local rpc-server workers, interleaved."""
    from edgespec.bench.server_peer import completion_body
    from edgespec.bench.suites import encode_prompt, load_prompts
    from edgespec.bundle import load_bundle
    from edgespec.decoding import SamplingParams
    from edgespec.deploy import DeployConfig, deploy_command, locate, read_help
    from edgespec.deploy.process import RpcWorker, ServerProcess, free_port
    from edgespec.tokenizer import Tokenizer

    build = locate()
    h = read_help(build.server)
    b = load_bundle(bundle)
    tok = Tokenizer(b.file(b.manifest.tokenizer.file), b.manifest.tokenizer)
    prompts = [encode_prompt(tok, p) for p in load_prompts(args.prompts)]
    speeds: dict[str, list[float]] = {"one process": [], "two rpc workers": []}
    texts: dict[str, list[list[int]]] = {k: [] for k in speeds}
    rpc_server = build.rpc_server
    with RpcWorker(rpc_server, threads=args.threads) as w1, RpcWorker(rpc_server, threads=args.threads) as w2:
        servers = {}
        for name, workers in (("one process", ()), ("two rpc workers", (w1.address, w2.address))):
            cfg = DeployConfig(bundle=str(bundle), spec="none", threads=args.threads, port=free_port(), rpc=workers)
            servers[name] = ServerProcess(deploy_command(cfg, h).argv, host=cfg.host, port=cfg.port)
        try:
            for rep in range(args.repeat):
                for i, ids in enumerate(prompts):
                    for name in (list(servers) if (rep + i) % 2 == 0 else list(servers)[::-1]):
                        doc = servers[name].post("/completion", completion_body(ids, args.max_tokens, SamplingParams(),
                                                                                stop_at_eos=False))
                        speeds[name].append(doc["timings"]["predicted_per_second"])
                        texts[name].append(doc["tokens"])
        finally:
            for s in servers.values():
                s.close()
    same = texts["one process"] == texts["two rpc workers"]
    return {"median_tok_s": {k: statistics.median(v) for k, v in speeds.items()},
            "tok_s": speeds, "greedy_identical": same}


def table(doc: dict, split: dict) -> str:
    m = doc["machine"]
    o = doc["overall"]
    lines = [f"{m['cpu']} ({m['arch']}, {m['cores_usable']} usable cores), load average {m.get('load_avg_1min')} at "
             f"the start; {doc['config']['prompts']} prompts x {doc['config']['repeat']} repeats, greedy, "
             f"{doc['config']['max_tokens']} tokens, llama-server timed by its own timings.", "",
             "| configuration | decode tok/s | acceptance | over llama-server plain |", "| --- | --- | --- | --- |"]
    base = o["llama-server"]["tok_s"]
    for name in ["llama.cpp", *PEERS, "plain", "speculative"]:
        q = o.get(name)
        if not q:
            continue
        acc = q.get("acceptance")
        label = {"llama.cpp": "llama-cpp-python plain", "plain": "edgespec plain (llama.cpp backend)",
                 "speculative": "edgespec speculative (llama.cpp backend)"}.get(name, name)
        lines.append(f"| {label} | {q['tok_s']:.1f} | {'–' if acc is None else f'{acc:.0%}'} | "
                     f"{q['tok_s'] / base:.2f}x |")
    r = split["median_tok_s"]
    lines += ["", f"llama-server plain, median over runs: one process {r['one process']:.1f} tok/s, target over two "
              f"rpc-server workers on 127.0.0.1 {r['two rpc workers']:.1f} tok/s; greedy tokens identical: "
              f"{split['greedy_identical']}."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "deploy")
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--prompts", default="chat,code,grounded")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgespec-deploy-figures"), help="where the bundle goes")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    bundle = export(args.work, args.draft_layers)
    doc = bench(bundle, args)
    split = rpc(bundle, args)
    (args.out / "rpc.json").write_text(json.dumps(split, indent=2) + "\n")
    text = table(doc, split)
    (args.out / "figures.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
