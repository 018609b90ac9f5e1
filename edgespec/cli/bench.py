"""`edgespec bench [BUNDLE]`: plain vs speculative decoding, measured side by side;
`edgespec bench compare A.json B.json ... --report DIR`: runs from several devices in one report."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from datetime import datetime, timezone

from ..errors import ConfigError
from .common import add_engine_args, cli_entry, open_engine, setup_logging

__all__ = ["main", "build_parser", "build_compare_parser"]

DESCRIPTION = """Measure what speculative decoding buys on this machine. Plain and speculative greedy
decoding run alternately in one process on the same loaded model, per prompt class (chat, code,
input-grounded, long context), with warm-up, repeats and medians; the speed-up is measured, and
speculative output is checked token for token against plain output. When the bundle's target came
from a GGUF (or with --peer-gguf), llama-cpp-python's own plain decode of that GGUF runs alongside,
on the same prompt token ids: the `x llama.cpp` column."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (as every edgespec error) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"edgespec: error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def _k_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected draft lengths like 1,2,4,8, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="edgespec bench", description=DESCRIPTION,
                epilog="Compare saved runs: edgespec bench compare A.json B.json ... --report DIR")
    p.add_argument("bundle", nargs="?", default=None, help="bundle folder (default: the embedded Gemma 3 270M)")
    g = p.add_argument_group("benchmark")
    g.add_argument("--prompts", default="all", metavar="SUITE|FILE.jsonl",
                   help="built-in suites: all (default), chat, code, grounded, long, or several joined by commas; "
                        "or a .jsonl file of {\"id\", \"messages\" | \"text\", \"class\"} lines")
    g.add_argument("--repeat", type=int, default=3, help="measured runs per prompt and configuration (default: 3)")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per run (default: 64)")
    g.add_argument("--warmup", type=int, default=1, help="unmeasured passes before measuring (default: 1)")
    g.add_argument("--stop-at-eos", action="store_true",
                   help="end a run at the model's end-of-turn/EOS token (default: fixed-length runs, as llama-bench)")
    g.add_argument("--k-sweep", type=_k_list, default=(), metavar="K1,K2,...",
                   help="also measure fixed draft lengths, e.g. 1,2,4,8 (plotted as speed per draft length)")
    g.add_argument("--json", default=None, metavar="FILE", help="write the results (versioned schema) here")
    g.add_argument("--report", default=None, metavar="DIR", help="write report.md and PNG plots into DIR")
    g.add_argument("--label", default=None, help="name of this run in reports (default: CPU, cores, backend)")
    g = p.add_argument_group("peer (llama.cpp)")
    g.add_argument("--peer-gguf", default=None, metavar="FILE",
                   help="also measure llama-cpp-python's own plain decode of this GGUF (default: the GGUF the "
                        "bundle's target came from, or the bundle's GGUF target, when there is one)")
    g.add_argument("--no-peer", action="store_true", help="do not measure llama.cpp")
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


def _load_engine(args: argparse.Namespace):
    # bench checks that drafting output equals plain: only draft where exact
    if getattr(args, "require_exact", None) is None:
        args.require_exact = True
    return open_engine(args)  # the shared engine flags, --memory-budget and --max-context included


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


def _run(argv: list[str]) -> int:
    from ..bench.live import LiveTable, format_table
    from ..bench.measure import BenchConfig, run_bench
    from ..bench.suites import load_prompts

    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    cfg = BenchConfig(repeat=args.repeat, max_tokens=args.max_tokens, warmup=args.warmup,
                      stop_at_eos=args.stop_at_eos, k_sweep=args.k_sweep)
    prompts = load_prompts(args.prompts)
    # every output and input is checked before minutes of measuring, not after
    if args.no_peer and args.peer_gguf:
        raise ConfigError("--peer-gguf and --no-peer contradict each other; give one")
    if args.json:
        from ..bench.schema import check_json_path

        check_json_path(args.json)
    if args.peer_gguf:
        from ..bench.peer import check_gguf

        check_gguf(args.peer_gguf)
    if args.report:
        from ..bench.report import check_report_dir, require_matplotlib

        require_matplotlib()
        check_report_dir(args.report)
    import psutil

    from ..bench.costs import verify_costs
    from ..bench.document import build_document
    from ..bench.machine import machine_info
    from ..bench.measure import build_decoders
    from ..bench.runner import PeakRSS

    machine = machine_info()
    proc = psutil.Process()
    rss = PeakRSS()
    rss.start()
    try:
        rss_before = proc.memory_info().rss
        with _load_engine(args) as engine, contextlib.ExitStack() as stack:
            rss_after = proc.memory_info().rss
            configs = list(build_decoders(engine, cfg.k_sweep))  # fails early if nothing drafts
            peer = None if args.no_peer else _open_peer(args, engine)
            if peer is not None:
                stack.callback(peer.close)
                configs.append(peer.name)
            classes = list(dict.fromkeys(p.cls for p in prompts))
            print(f"edgespec bench: {engine.bundle.path.name} on {machine['cpu']} ({machine['arch']}, "
                  f"{machine['cores_usable']} cores), {engine.backend}; drafter {engine.drafter_name}, policy "
                  f"{engine.policy_name}, k={engine.k}; {len(prompts)} prompts in {len(classes)} classes × "
                  f"{cfg.repeat} repeats × {len(configs)} configurations, {cfg.max_tokens} tokens each",
                  file=sys.stderr)
            exactness = getattr(engine, "exactness", None)
            if exactness is not None:
                print(f"edgespec bench: {exactness.describe()}", file=sys.stderr)
            costs = verify_costs(engine.target)
            if costs is not None:
                print("edgespec bench: c(B) " + ", ".join(f"{b}: {c:.2f}" for b, c in costs["c"].items())
                      + f" over {costs['one_token_ms']:.1f} ms", file=sys.stderr)
            table = LiveTable(configs, classes, repeat=cfg.repeat)
            started, t0 = datetime.now(timezone.utc), time.perf_counter()
            try:
                runs = run_bench(engine, prompts, cfg, on_run=table.update, rss=rss, peer=peer)
            finally:
                table.close()
            doc = build_document(
                engine, runs, cfg, prompts_spec=args.prompts, configs=configs, machine=machine, label=args.label,
                prompts=prompts,
                backend={"name": engine.backend, "device": args.device, "draft_backend": engine.draft_backend,
                         "draft_device": args.draft_device or (args.device if engine.draft_backend else None),
                         "threads": args.threads},
                memory={"rss_before_load": rss_before, "rss_after_load": rss_after, "engine": engine.memory()},
                memory_budget=args.memory_budget, started=started, duration_s=time.perf_counter() - t0,
                peer=peer.describe() if peer is not None else None, verify_costs=costs)
    finally:
        rss.stop()
    print("\n".join(format_table(doc["classes"], doc["overall"])))
    if doc["mismatches"]:
        print(f"WARNING: greedy speculative output differed from plain decoding in {len(doc['mismatches'])} "
              f"run(s); speculative decoding must be lossless (see the JSON's 'mismatches')", file=sys.stderr)
    if args.json:
        print(f"results: {_save(doc, args.json)}", file=sys.stderr)
    if args.report:
        from ..bench.report import write_report

        print(f"report: {write_report([doc], args.report)}", file=sys.stderr)
    return 0 if not doc["mismatches"] else 1


def _open_peer(args: argparse.Namespace, engine):
    """The llama.cpp peer for this bundle (or --peer-gguf), or None: no GGUF to run it on, or
    llama-cpp-python missing (then one line says how to get it, and the bench runs without it)."""
    from ..bench.peer import LlamaCppPeer, find_peer_gguf, missing_reason

    source = find_peer_gguf(engine.bundle, args.peer_gguf)
    if source is None:
        return None
    reason = missing_reason()
    if reason is not None:
        print(f"edgespec bench: no llama.cpp column: {reason}", file=sys.stderr)
        return None
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    peer = LlamaCppPeer(source, threads=threads, n_ctx=getattr(engine, "context_limit", None) or 4096,
                        vocab_size=engine.target.vocab_size)
    print(f"edgespec bench: peer llama.cpp (llama-cpp-python {peer.describe()['version']}) on {source.path.name}, "
          f"{threads} threads", file=sys.stderr)
    return peer


def _save(doc: dict, path: str) -> str:
    """Write the results; if that fails after all (the folder went away), keep them in a temporary
    file and say where, so a long run is never lost."""
    import tempfile

    from ..bench.schema import save

    try:
        return str(save(doc, path))
    except ConfigError as e:
        fd, spare = tempfile.mkstemp(prefix="edgespec-bench-", suffix=".json")
        os.close(fd)
        save(doc, spare)
        raise ConfigError(f"{e}; the results are in {spare}") from None


@cli_entry
def main(argv: list[str]) -> int:
    if argv and argv[0] == "compare":
        return _compare(argv[1:])
    return _run(argv)
