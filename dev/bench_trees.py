"""Tree verification (issue 23) beside llama.cpp: Token Recycling's draft trees against its chains.

    python dev/bench_trees.py [--chain-bundle DIR] [--tree-bundle DIR] [--prompts chat]
        [--max-tokens 96] [--repeat 2] [--threads 2] [--json dev/results/trees.json]

Three bundles of the same GGUF (the embedded Gemma 3 270M Q4_K_M): the default bundle (with its
self-draft), the same target without a draft (`edgespec export --draft none`: its graph verifies
chains) and with `--tree` (`edgespec export --tree --draft none`: attention summed in blocks so a
tree's rows round as a chain's, exporters/onnx/tree.py). The last two are exported into a
temporary folder unless given. In one process, per prompt and repeat, in a rotating order, all
from empty caches and the same prompt token ids:

  llama.cpp            llama-cpp-python's own plain greedy decode of the GGUF (the peer)
  default              the default bundle, the engine's default drafting (lookup, else the model)
  chain:plain          the chain graph, plain decoding
  chain:recycle        the chain graph, Token Recycling (chains), the cost policy
  tree:plain           the tree graph, plain decoding (what its block-wise attention costs)
  tree:recycle-chains  the tree graph, Token Recycling with chains only
  tree:recycle         the tree graph, Token Recycling drafting trees where the measured verify
                       costs and the table's rank statistics promise more (the engine's choice)
  tree:2111            the tree graph, Token Recycling drafting the tree (2, 1, 1, 1) whenever the
                       cost policy drafts: the top-2 after the root, each continued by a chain of 3

Decode tokens/s after the first token (as `edgespec bench` times its peer); `x llama.cpp` and
`x plain` are medians of paired per-prompt ratios. Greedy outputs must equal the same bundle's
plain decoding. Also reports acceptance, tokens per step, the share of steps that drafted a tree,
and what the recycling drafter learned (how often the target's token was the table's top-1, -2, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import edgespec
from edgespec.bench.machine import library_versions, machine_info
from edgespec.bench.peer import LlamaCppPeer, find_peer_gguf
from edgespec.bench.suites import encode_prompt, load_prompts
from edgespec.decoding import RecyclingDrafter, SamplingParams, SpeculativeDecoder, make_policy

CONFIGS = ("llama.cpp", "default", "chain:plain", "chain:recycle", "tree:plain", "tree:recycle-chains",
           "tree:recycle", "tree:2111")


def export_bundle(out: Path, *flags: str) -> Path:
    """The default GGUF without a draft, by the CLI a user runs."""
    subprocess.run([sys.executable, "-m", "edgespec", "export", "--draft", "none", *flags, "-o", str(out)], check=True)
    return out


def fixed_shape(engine, shape: tuple[int, ...]) -> SpeculativeDecoder:
    """Token Recycling always drafting `shape` on `engine`'s target, the cost policy gating it."""
    policy = make_policy("cost", engine.k)
    return SpeculativeDecoder(engine.target, drafter=RecyclingDrafter(engine.target.vocab_size, shape=shape),
                              policy=policy, limits=engine.opened.limits)


def run_decoder(engine, decoder, ids: list[int], max_tokens: int) -> dict:
    """One greedy generation from empty caches: tokens, decode seconds after the first step."""
    engine.target.reset()
    if engine.draft is not None:
        engine.draft.reset()
    tokens = list(ids)
    steps = []
    t0 = time.perf_counter()
    first = None
    for step in decoder.stream(tokens, SamplingParams(), max_tokens):
        steps.append(step)
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    out = tokens[len(ids):]
    return {"tokens": out, "decode_s": end - first, "decoded": len(out) - len(steps[0].tokens),
            "total_s": end - t0, "steps": len(steps), "drafted": sum(s.drafted for s in steps),
            "accepted": sum(s.accepted for s in steps), "tree_steps": sum(s.source.endswith(":tree") for s in steps)}


def run_peer(peer: LlamaCppPeer, ids: list[int], max_tokens: int) -> dict:
    rec = peer.decode(ids, max_tokens)
    return {"tokens": rec.tokens, "decode_s": rec.total_s - rec.ttft_s, "decoded": len(rec.tokens) - 1,
            "total_s": rec.total_s, "steps": rec.steps, "drafted": 0, "accepted": 0, "tree_steps": 0}


def summarise(runs: dict, prompts: list, configs: list[str]) -> list[dict]:
    def rate(name: str, pid: str) -> float:  # the median run's decode tok/s
        return statistics.median(r["decoded"] / r["decode_s"] for r in runs[(name, pid)])

    rows = []
    for name in configs:
        flat = [r for p in prompts for r in runs[(name, p.id)]]
        plain = "tree:plain" if name.startswith("tree:") else "chain:plain"  # default: the same target
        drafted, accepted, steps = (sum(r[k] for r in flat) for k in ("drafted", "accepted", "steps"))
        rows.append({
            "config": name,
            "tok_s": round(sum(r["decoded"] for r in flat) / sum(r["decode_s"] for r in flat), 2),
            "x_llama_cpp": round(statistics.median(rate(name, p.id) / rate("llama.cpp", p.id) for p in prompts), 3),
            "x_plain": None if name == "llama.cpp" else round(statistics.median(
                rate(name, p.id) / rate(plain, p.id) for p in prompts), 3),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_step": round(sum(len(r["tokens"]) for r in flat) / steps, 2),
            "tree_step_share": round(sum(r["tree_steps"] for r in flat) / steps, 3),
            "identical_to_plain": None if name == "llama.cpp" else all(
                r["tokens"] == runs[(plain, p.id)][0]["tokens"] for p in prompts for r in runs[(name, p.id)]),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chain-bundle", type=Path, default=None, help="the GGUF exported with --draft none")
    ap.add_argument("--tree-bundle", type=Path, default=None, help="the GGUF exported with --tree --draft none")
    ap.add_argument("--prompts", default="chat")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts = load_prompts(args.prompts)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        chain_path = args.chain_bundle or export_bundle(Path(tmp) / "chain")
        tree_path = args.tree_bundle or export_bundle(Path(tmp) / "tree", "--tree")
        with edgespec.load(threads=args.threads) as default, edgespec.load(chain_path, threads=args.threads) as chain, \
                edgespec.load(tree_path, threads=args.threads) as tree:
            assert tree.target.capabilities.trees and not chain.target.capabilities.trees
            source = find_peer_gguf(default.bundle)
            with LlamaCppPeer(source, threads=args.threads, vocab_size=chain.target.vocab_size) as peer:
                decoders = {"default": (default, default.variant()),
                            "chain:plain": (chain, chain.variant(plain=True)),
                            "chain:recycle": (chain, chain.variant(drafter="recycle")),
                            "tree:plain": (tree, tree.variant(plain=True)),
                            "tree:recycle-chains": (tree, tree.variant(drafter="recycle", trees=False)),
                            "tree:recycle": (tree, tree.variant(drafter="recycle")),
                            "tree:2111": (tree, fixed_shape(tree, (2, 1, 1, 1)))}
                runs: dict = {}
                configs = list(CONFIGS)
                for i, prompt in enumerate(prompts):
                    ids = encode_prompt(chain.tokenizer, prompt)
                    for rep in range(args.repeat):
                        shift = (i * args.repeat + rep) % len(configs)
                        for name in configs[shift:] + configs[:shift]:
                            if name == "llama.cpp":
                                r = run_peer(peer, ids, args.max_tokens)
                            else:
                                r = run_decoder(*decoders[name], ids, args.max_tokens)
                            runs.setdefault((name, prompt.id), []).append(r)
                            print(f"{prompt.id} #{rep} {name}: {r['decoded'] / r['decode_s']:.1f} tok/s, "
                                  f"{r['accepted']}/{r['drafted']} accepted, {r['tree_steps']}/{r['steps']} tree steps",
                                  flush=True)
                rows = summarise(runs, prompts, configs)
                drafter = decoders["tree:recycle"][1].drafter
                report = {
                    "machine": {**machine_info(), "loadavg_before": [round(x, 2) for x in load_before],
                                "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
                    "versions": library_versions(), "peer": peer.describe(),
                    "exactness": {name: e.exactness.describe() if e.exactness else None
                                  for name, e in (("default", default), ("chain", chain), ("tree", tree))},
                    "threads": args.threads, "prompts": args.prompts, "n_prompts": len(prompts),
                    "max_tokens": args.max_tokens, "repeat": args.repeat, "results": rows,
                    "tree_recycle": {"reach": [round(float(x), 3) for x in drafter.reach()],
                                     "policy": decoders["tree:recycle"][1].policy.snapshot(),
                                     "shapes_considered": "tree.tree_shapes(16)"},
                }
    for row in rows:
        print(f"{row['config']:>20}: {row['tok_s']:6.2f} tok/s, x llama.cpp {row['x_llama_cpp']:.2f}, "
              f"x plain {row['x_plain']}, acc {row['acceptance']}, tokens/step {row['tokens_per_step']}, "
              f"trees {row['tree_step_share']}, identical {row['identical_to_plain']}")
    print("recycling reach (top-1..k):", report["tree_recycle"]["reach"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
