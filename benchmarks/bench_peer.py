"""edgespec against llama.cpp, side by side, greedy and sampled: `edgespec bench` with its llama.cpp peers.

    python benchmarks/bench_peer.py [--bundle BUNDLE] [--modes greedy,chat,t1] [--prompts FILE.jsonl]
                                    [--repeat 2] [--max-tokens 96] [--long | --long-only] [--long-limit N]
                                    [--server-peers NAME,... | --no-server] [--out DIR]
                                    [-- extra edgespec bench flags]

Runs the `edgespec bench` command as a user runs it, once per sampling mode, on the default bundle
(the embedded Gemma 3 270M, exported on first use; its target came from the Q4_K_M GGUF, which is
what llama.cpp decodes) or on BUNDLE. Modes: `greedy`; `chat`, the sampler `edgespec chat` uses by
default (temperature 0.7, top-p 0.95, top-k 40); `t1`, pure temperature 1 (top-k 0, top-p 1), the
OpenAI API's default. The llama.cpp peer samples at the same settings. Prompts: the held-out set
in benchmarks/data/heldout.jsonl (chat, code and grounded prompts no tuning has seen), or FILE.
`--long` adds the `long` class, `--long-only` runs it alone: the questions of
benchmarks/data/long.jsonl after a ~2k- or ~8k-token document of licence text shipped inside the
installed packages (edgespec/bench/long_prompts.py), with the context raised to `--long-context`
for edgespec and for llama-cpp-python's n_ctx; `--long-limit N` keeps its first N questions (a
smoke run). Every run starts from empty caches (cold time to first token, no prefix reuse).

In one process per mode, per prompt and repeat, interleaved: edgespec plain, edgespec speculative,
llama-cpp-python's own plain decode of the GGUF, and llama.cpp's own server on the same GGUF
(`--server-peers`, default plain, ngram-simple and ngram-mod: its prompt-lookup modes, which need
no draft model; the project builds it from the same llama.cpp source, edgespec/deploy/build.py),
timed by its own `timings` and recorded with its build and flags; all from the same prompt token
ids. Every run
stops at the model's end of turn (or --max-tokens). Decode tokens/s count the tokens after the
first step over the time after it. `x llama.cpp` is the ratio of totals (all decode tokens over
all decode time, edgespec's over the peer's, on the same prompts and repeats); the median of
paired per-prompt ratios stands beside it.

Writes into DIR (default: benchmarks/results/bench_peer/): per mode a folder with results.json
(the bench's versioned JSON), report.md with its plots, and run.log (the console output, with the
machine line); and summary.md, one table of decode speed (against llama-cpp-python), one against
llama-server (plain and its best speculative type per class), and one of cold time to first token
over the modes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = {
    "greedy": ["--temperature", "0"],
    "chat": ["--temperature", "0.7", "--top-p", "0.95", "--top-k", "40"],
    "t1": ["--temperature", "1", "--top-p", "1", "--top-k", "0"],
}
TITLES = {"greedy": "greedy", "chat": "chat's defaults (T 0.7, top-p 0.95, top-k 40)",
          "t1": "pure temperature 1 (top-k 0, top-p 1)"}


def _x(m: dict, key: str) -> str:
    v = m.get(key)
    return "–" if v is None else f"{v:.2f}x"


def summary_rows(mode: str, doc: dict) -> list[str]:
    """Markdown rows of one mode's results: per class and overall, llama.cpp, plain and speculative."""
    rows = []
    for cls, block in [*doc["classes"].items(), ("all", doc["overall"])]:
        peer, plain, spec = block.get("llama.cpp", {}), block["plain"], block.get("speculative", {})
        acc = spec.get("acceptance")
        rows.append(
            f"| {mode} | {cls} | {peer.get('tok_s', 0):.1f} | {plain['tok_s']:.1f} ({_x(plain, 'x_llamacpp')}; "
            f"{_x(plain, 'x_llamacpp_paired')}) | {spec.get('tok_s', 0):.1f} ({_x(spec, 'x_llamacpp')}; "
            f"{_x(spec, 'x_llamacpp_paired')}) | {'–' if acc is None else f'{acc:.0%}'} / "
            f"{spec.get('mean_accepted_length', 0):.2f} |")
    return rows


def _servers(doc: dict) -> tuple[str | None, list[str]]:
    """The plain llama-server peer and the speculative ones that ran."""
    names = [c for c in doc["configs"] if c.startswith("llama-server")]
    return ("llama-server" if "llama-server" in names else None), [c for c in names if "+" in c]


def _key(peer: str) -> str:
    return "x_" + peer.replace("-", "_").replace("+", "_")


def server_rows(mode: str, doc: dict) -> list[str]:
    """Markdown rows against llama-server: its plain speed and its best speculative type's (per
    class, by its own timings), and edgespec's ratios over each."""
    plain_peer, spec_peers = _servers(doc)
    rows = []
    for cls, block in [*doc["classes"].items(), ("all", doc["overall"])]:
        plain, spec = block["plain"], block.get("speculative", {})
        best = max(spec_peers, key=lambda c: block.get(c, {}).get("tok_s", 0), default=None)
        q0, qb = block.get(plain_peer or "", {}), block.get(best or "", {})
        acc = qb.get("acceptance")
        k0, kb = _key(plain_peer or ""), _key(best or "")
        rows.append(
            f"| {mode} | {cls} | {q0.get('tok_s', 0):.1f} | {qb.get('tok_s', 0):.1f} "
            f"({best.partition('+')[2] if best else '–'}, {'–' if acc is None else f'{acc:.0%}'}) | "
            f"{_x(plain, k0)} | {_x(spec, k0)} | {_x(spec, kb)} |")
    return rows


def _ttft(m: dict, ref: float | None) -> str:
    ms = m.get("ttft_ms")
    if ms is None:
        return "–"
    return f"{ms:.0f}" + (f" ({ms / ref:.2f}x)" if ref else "")


def ttft_rows(mode: str, doc: dict) -> list[str]:
    """Markdown rows of one mode's cold time to first token: per class and overall, median ms."""
    rows = []
    for cls, block in [*doc["classes"].items(), ("all", doc["overall"])]:
        peer, plain, spec = block.get("llama.cpp", {}), block["plain"], block.get("speculative", {})
        ref = peer.get("ttft_ms")
        rows.append(f"| {mode} | {cls} | {_ttft(peer, None)} | {_ttft(plain, ref)} | {_ttft(spec, ref)} |")
    return rows


def write_summary(out: Path, docs: dict[str, dict]) -> Path:
    first = next(iter(docs.values()))
    m = first["machine"]
    lines = [
        "# edgespec against llama-cpp-python, greedy and sampled", "",
        f"Machine: {m['cpu']} ({m['arch']}; {' '.join(m.get('isa') or [])}), {m['cores_usable']} usable cores. "
        f"Libraries: " + ", ".join(f"{k} {v}" for k, v in sorted(first["libraries"].items()) if v) + ".", "",
        "Decode tok/s after the first step; in brackets, over llama-cpp-python's: the ratio of totals, then the "
        "median of paired per-prompt ratios. Acceptance / tokens per target forward of speculative decoding.", "",
        "| mode | class | llama-cpp-python tok/s | edgespec plain | edgespec speculative | acceptance / tok per step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, doc in docs.items():
        lines += summary_rows(mode, doc)
    if any(any(_servers(doc)) for doc in docs.values()):
        lines += ["", "Against llama.cpp's own server (`llama-server`, the same llama.cpp source built with its "
                  "defaults; its speed by its own `timings`, tokens after the first over the time after it), "
                  "ratios of totals:", "",
                  "| mode | class | llama-server tok/s | its best speculative tok/s (type, acceptance) | "
                  "edgespec plain x plain | edgespec speculative x plain | edgespec speculative x its best |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for mode, doc in docs.items():
            lines += server_rows(mode, doc)
    lines += ["", "Cold time to first token (median ms, from empty caches; in brackets, over llama-cpp-python's):",
              "", "| mode | class | llama-cpp-python | edgespec plain | edgespec speculative |",
              "| --- | --- | --- | --- | --- |"]
    for mode, doc in docs.items():
        lines += ttft_rows(mode, doc)
    lines += ["", "Modes: " + "; ".join(f"`{k}`: {TITLES[k]}" for k in docs) + ".",
              "Greedy speculative output identical to plain: "
              + ("yes" if docs.get("greedy", {}).get("identical", True) else "**NO**") + "."]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _count_tokens(bundle: str | None):
    """Tokens of a text by the bundle's tokenizer (the default bundle's without one)."""
    from tokenizers import Tokenizer

    from edgespec.bundle import load_bundle
    from edgespec.engine.engine import default_bundle

    folder = Path(bundle) if bundle else default_bundle()
    tok = Tokenizer.from_file(str(load_bundle(folder).file(load_bundle(folder).manifest.tokenizer.file)))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def prompts_file(args) -> Path:
    """The prompts this run measures: --prompts, with the long class after them (--long) or alone
    (--long-only), written to DIR/prompts.jsonl."""
    if not (args.long or args.long_only):
        return args.prompts
    from edgespec.bench.long_prompts import long_prompts, read_questions

    questions = read_questions(args.long_questions)[:args.long_limit]
    lines = [] if args.long_only else [ln for ln in args.prompts.read_text(encoding="utf-8").splitlines() if ln.strip()]
    lines += [json.dumps(r) for r in long_prompts(questions, _count_tokens(args.bundle))]
    path = args.out / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_mode(mode: str, args, extra: list[str]) -> dict:
    out = args.out / mode
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "edgespec", "bench", *([args.bundle] if args.bundle else []),
           "--prompts", str(args.prompt_file), "--repeat", str(args.repeat), "--max-tokens", str(args.max_tokens),
           "--stop-at-eos", "--seed", str(args.seed), *MODES[mode], "--peers", args.peers,
           "--json", str(out / "results.json"), "--report", str(out), *extra]
    print(f"{mode}: {' '.join(cmd[1:])}", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = f"$ edgespec {' '.join(cmd[3:])}\n\n{proc.stderr}\n{proc.stdout}"
    local_paths = [(str(HERE.parent) + "/", ""), (str(Path.home()), "~")]
    if args.bundle:
        local_paths.insert(0, (str(args.bundle), Path(args.bundle).name))
    for local, shown in local_paths:  # no machine paths in results
        log = log.replace(local, shown)
    (out / "run.log").write_text(log, encoding="utf-8")
    sys.stderr.write(proc.stderr)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"bench_peer: mode {mode} failed (exit {proc.returncode}); see {out / 'run.log'}")
    return json.loads((out / "results.json").read_text(encoding="utf-8"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=None, help="bundle folder (default: the embedded Gemma 3 270M)")
    ap.add_argument("--modes", default="greedy,chat,t1", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--prompts", type=Path, default=HERE / "data" / "heldout.jsonl")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_peer")
    long = ap.add_mutually_exclusive_group()
    long.add_argument("--long", action="store_true", help="add the long class (2k- and 8k-token documents)")
    long.add_argument("--long-only", action="store_true", help="run the long class alone")
    ap.add_argument("--long-questions", type=Path, default=HERE / "data" / "long.jsonl")
    ap.add_argument("--long-limit", type=int, default=None, help="keep the long class's first N questions")
    ap.add_argument("--long-context", type=int, default=16384,
                    help="edgespec's --max-context and llama-cpp-python's n_ctx with the long class")
    servers = ap.add_mutually_exclusive_group()
    servers.add_argument("--server-peers", default="llama-server,llama-server+ngram-simple,llama-server+ngram-mod",
                         help="llama.cpp's own server as peers: llama-server (plain) and llama-server+TYPE")
    servers.add_argument("--no-server", action="store_true", help="llama-cpp-python alone as the peer")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more `edgespec bench` flags")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    extra = [a for a in args.extra if a != "--"]
    args.prompt_file = prompts_file(args)
    args.peers = ",".join(["llama.cpp", *([] if args.no_server else [args.server_peers])])
    if (args.long or args.long_only) and "--max-context" not in extra:
        extra += ["--max-context", str(args.long_context)]
    docs = {mode: run_mode(mode, args, extra) for mode in modes}
    print(f"summary: {write_summary(args.out, docs)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
