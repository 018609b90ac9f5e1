"""`edgespec bench [BUNDLE]`: plain vs speculative decoding, measured side by side;
`edgespec bench compare A.json B.json ... --report DIR`: runs from several devices in one report."""
from __future__ import annotations

import argparse
import sys

from .common import (
    add_engine_args,
    add_sampling_args,
    cli_entry,
    engine_config_from_args,
    sampling_params,
    setup_logging,
)

__all__ = ["main", "build_parser", "build_compare_parser"]

DESCRIPTION = """Measure what speculative decoding buys on this machine. Plain and speculative decoding
run alternately in one process on the same loaded model, per prompt class (chat, code,
input-grounded, long context), with warm-up and repeats; speeds are total tokens over total time
after each run's first step. Greedy by default, where speculative output is checked token for
token against plain output; --temperature and the other sampling flags measure sampled decoding.
When the bundle's target came from a GGUF (or with --peer-gguf), llama-cpp-python's own plain
decode of that GGUF runs alongside at the same sampling settings, on the same prompt token ids:
the `x llama.cpp` column (ratio of totals; the JSON also has the median of paired ratios).
--peers adds llama.cpp's own server, plain and with its speculative modes, on the same GGUF."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (as every edgespec error) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"edgespec: error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def _k_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected draft lengths like 1,2,4,8, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="edgespec bench", description=DESCRIPTION,
                epilog="Compare saved runs: edgespec bench compare A.json B.json ... --report DIR")
    p.add_argument("bundle", nargs="?", default=None, help="bundle or .gguf file (default: the embedded Gemma 3 270M)")
    g = p.add_argument_group("benchmark")
    g.add_argument("--prompts", default="all", metavar="SUITE|FILE.jsonl",
                   help="built-in suites: all (default), chat, code, grounded, long, or several joined by commas; "
                        "or a .jsonl file of {\"id\", \"messages\" | \"text\", \"class\"} lines")
    g.add_argument("--repeat", type=int, default=3, help="measured runs per prompt and configuration (default: 3)")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per run (default: 64)")
    g.add_argument("--warmup", type=int, default=1, help="unmeasured passes before measuring (default: 1)")
    g.add_argument("--stop-at-eos", action="store_true",
                   help="end a continuation prompt's run at EOS (default: fixed length, as llama-bench); chat prompts "
                        "always end where edgespec chat ends a reply")
    g.add_argument("--k-sweep", type=_k_list, default=(), metavar="K1,K2,...",
                   help="also measure fixed draft lengths, e.g. 1,2,4,8 (plotted as speed per draft length)")
    g.add_argument("--cooldown", type=float, default=0.0, metavar="SECONDS",
                   help="pause this long before every measured run, so a phone or a fanless board starts each "
                        "run cooler (clocks and temperatures are recorded either way; default: 0)")
    g.add_argument("--json", default=None, metavar="FILE", help="write the results (versioned schema) here")
    g.add_argument("--report", default=None, metavar="DIR", help="write report.md and PNG plots into DIR")
    g.add_argument("--label", default=None, help="name of this run in reports (default: CPU, cores, backend)")
    # greedy unless asked: chat's sampler is one flag set away (--temperature 0.7 --top-p 0.95 --top-k 40)
    add_sampling_args(p, max_tokens=None)
    g = p.add_argument_group("peer (llama.cpp)")
    g.add_argument("--peer-gguf", default=None, metavar="FILE",
                   help="also measure llama-cpp-python's own plain decode of this GGUF (default: the GGUF the "
                        "bundle's target came from, or the bundle's GGUF target, when there is one)")
    g.add_argument("--no-peer", action="store_true", help="do not measure llama.cpp")
    g.add_argument("--peers", type=_names, default=("llama.cpp",), metavar="NAME,...",
                   help="which llama.cpp peers run: llama.cpp (llama-cpp-python in this process; the default), "
                        "llama-server (llama.cpp's own server, plain, timed by its own timings), "
                        "llama-server+TYPE (with its speculative type: ngram-simple, ngram-mod, ngram-map-k, "
                        "ngram-map-k4v, draft-simple); e.g. llama.cpp,llama-server,llama-server+ngram-simple")
    g.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary or its folder (default: $EDGESPEC_LLAMA_BIN, the build edgespec "
                        "made, llama-server on PATH, else one built now from the pinned llama-cpp-python's sources)")
    g.add_argument("--peer-draft-gguf", default=None, metavar="FILE",
                   help="llama-server+draft-simple's draft (default: the bundle's standalone GGUF draft)")
    add_engine_args(p)
    return p


def build_compare_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="edgespec bench compare",
                description="Merge bench results (e.g. from several devices) into one report.")
    p.add_argument("results", nargs="+", metavar="RESULT.json", help="files written by `edgespec bench --json`")
    p.add_argument("--report", required=True, metavar="DIR", help="write report.md and PNG plots into DIR")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the merged runs as one file")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def _compare(argv: list[str]) -> int:
    from ..bench.compare import merge_runs
    from ..bench.report import require_matplotlib, write_report
    from ..bench.schema import compare_document, save_compare

    args = build_compare_parser().parse_args(argv)
    setup_logging(args.verbose)
    require_matplotlib()
    runs = merge_runs(args.results)
    md = write_report(runs, args.report)
    if args.json:
        save_compare(compare_document(runs), args.json)
    print(f"compared {len(runs)} runs: {md}")
    return 0


def _gguf_given(bundle: str | None) -> str | None:
    """The GGUF file named instead of a bundle: the peer decodes that same file (unless --no-peer)."""
    return bundle if bundle is not None and str(bundle).lower().endswith(".gguf") else None


def _run(argv: list[str]) -> int:
    from ..bench.live import format_table
    from ..bench.measure import BenchConfig
    from ..bench.orchestrate import BenchRequest, run_benchmark, save_results

    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    req = BenchRequest(bundle=args.bundle, engine=engine_config_from_args(args),
                       bench=BenchConfig(repeat=args.repeat, max_tokens=args.max_tokens, warmup=args.warmup,
                                         stop_at_eos=args.stop_at_eos, k_sweep=args.k_sweep,
                                         sampling=sampling_params(args), cooldown_s=args.cooldown),
                       prompts=args.prompts, json=args.json, report=args.report, label=args.label,
                       peer_gguf=args.peer_gguf or (None if args.no_peer else _gguf_given(args.bundle)),
                       peer=not args.no_peer, peers=args.peers, llama_server=args.llama_server,
                       peer_draft_gguf=args.peer_draft_gguf)
    doc = run_benchmark(req, notify=lambda line: print(f"edgespec bench: {line}", file=sys.stderr))
    print("\n".join(format_table(doc["classes"], doc["overall"])))
    if doc["mismatches"]:  # greedy runs only: sampled ones are not compared token for token
        print(f"WARNING: greedy speculative output differed from plain decoding in {len(doc['mismatches'])} "
              f"run(s); speculative decoding must be lossless (see the JSON's 'mismatches')", file=sys.stderr)
    if args.json:
        print(f"results: {save_results(doc, args.json)}", file=sys.stderr)
    if args.report:
        from ..bench.report import write_report

        print(f"report: {write_report([doc], args.report)}", file=sys.stderr)
    return 0 if not doc["mismatches"] else 1


@cli_entry
def main(argv: list[str]) -> int:
    if argv and argv[0] == "compare":
        return _compare(argv[1:])
    return _run(argv)
