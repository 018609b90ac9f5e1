"""`edgespec deploy BUNDLE`: the llama-server command that serves a bundle's GGUF target with its
draft, printed (or, with --run, started), every speculative flag spelled for the llama-server build
it finds and checked against that build's --help.

    edgespec deploy model.bundle                      # print the command
    edgespec deploy model.bundle --run --port 8080    # start it (Ctrl-C stops it)
    edgespec deploy model.bundle --rpc 10.0.0.2:50052,10.0.0.3:50052   # the target's layers on RPC workers
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from .common import cli_entry, setup_logging

__all__ = ["main", "build_parser"]


def _rpc_list(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def build_parser() -> argparse.ArgumentParser:
    from ..deploy.command import DEFAULT_CONTEXT, DRAFT_N_MAX, DRAFT_N_MIN, DRAFT_P_MIN, SPEC_CHOICES

    p = argparse.ArgumentParser(
        prog="edgespec deploy", description="Print (or --run) the llama-server command for a bundle's GGUF target and "
        "draft, every speculative flag spelled for the llama-server build found. Flags after `--` go to llama-server "
        "as they are (checked against its --help).")
    p.add_argument("bundle", help="a bundle exported with --format gguf")
    p.add_argument("--run", action="store_true", help="start llama-server instead of printing its command")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary or its folder (default: $EDGESPEC_LLAMA_BIN, the build edgespec "
                        "made, `llama-server` on PATH, else build one now from the pinned llama-cpp-python's sources)")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec", choices=SPEC_CHOICES, default="auto",
                   help="auto: the bundle's standalone draft (draft-simple) when it is cheaper than the target, else "
                        "ngram-simple (prompt lookup); none: the target alone (default: auto)")
    g.add_argument("--draft-max", type=int, default=DRAFT_N_MAX,
                   help=f"longest draft per step (default: {DRAFT_N_MAX}, llama.cpp's)")
    g.add_argument("--draft-min", type=int, default=DRAFT_N_MIN,
                   help=f"shortest draft worth verifying (default: {DRAFT_N_MIN})")
    g.add_argument("--draft-p-min", type=float, default=DRAFT_P_MIN,
                   help=f"the draft stops below this probability of its own token (default: {DRAFT_P_MIN:g})")
    g = p.add_argument_group("server")
    g.add_argument("-c", "--context", type=int, default=None,
                   help=f"tokens of context (default: {DEFAULT_CONTEXT}, or the model's trained context if shorter)")
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: the usable cores)")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    g.add_argument("--parallel", type=int, default=None, help="requests served at once (default: llama-server's)")
    g.add_argument("--repack", action="store_true",
                   help="let llama.cpp repack the weights (faster one-token kernels on some CPUs, which round apart "
                        "from its batches: drafting may then change greedy output; default: off)")
    g.add_argument("--rpc", type=_rpc_list, default=(), metavar="HOST:PORT,...",
                   help="spread the target's layers over these llama.cpp rpc-server workers (the draft stays here)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


@cli_entry
def main(argv: list[str]) -> int:
    argv = list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    setup_logging(args.verbose)
    from ..deploy import DeployConfig, ServerCommand, locate, read_help, server_argv
    from ..deploy.command import deploy_options

    cfg = DeployConfig(bundle=args.bundle, spec=args.spec, draft_n_max=args.draft_max, draft_n_min=args.draft_min,
                       draft_p_min=args.draft_p_min, context=args.context, threads=args.threads, host=args.host,
                       port=args.port, parallel=args.parallel, rpc=args.rpc, repack=args.repack, extra=tuple(extra))
    opts, notes = deploy_options(cfg)  # the bundle first: a bad one fails before llama.cpp is looked for
    build = locate(args.llama_server)
    cmd = ServerCommand(argv=tuple(server_argv(read_help(build.server), opts)), options=opts, notes=notes)
    print(f"# llama-server: {build.server} ({build.source})", file=sys.stderr)
    for note in cmd.notes:
        print(f"# {note}", file=sys.stderr)
    for worker in cfg.rpc:
        print(f"# on {worker.rpartition(':')[0]}: rpc-server --host 0.0.0.0 --port {worker.rpartition(':')[2]}",
              file=sys.stderr)
    if not args.run:
        print(cmd.shell())
        return 0
    from ..deploy.process import child_env

    print(f"# serving on http://{cfg.host}:{cfg.port} (OpenAI API under /v1); Ctrl-C stops it", file=sys.stderr)
    try:
        return subprocess.run(list(cmd.argv), env=child_env()).returncode
    except KeyboardInterrupt:  # llama-server got the same Ctrl-C and stopped
        return 130
