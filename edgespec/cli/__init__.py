"""`edgespec` command: a thin dispatcher that imports a verb's module only when it runs.

`edgespec --help` therefore loads no onnxruntime, OpenVINO or torch."""
from __future__ import annotations

import importlib
import os
import sys

__all__ = ["main", "run", "VERBS"]

VERBS: dict[str, tuple[str, str]] = {
    "export": ("edgespec.cli.export", "convert a target (and draft) model into a bundle"),
    "chat": ("edgespec.cli.chat", "chat with a bundle, streaming, with speculative decoding"),
    "generate": ("edgespec.cli.generate", "complete a prompt (plain text, streamed)"),
    "info": ("edgespec.cli.info", "show a bundle's manifest and the installed backends"),
    "serve": ("edgespec.cli.serve", "serve a bundle over an OpenAI-compatible HTTP API"),
    "bench": ("edgespec.cli.bench", "measure plain vs speculative decoding; `bench compare` merges runs"),
    "distill": ("edgespec.cli.distill", "train a light draft head for a bundle on its own target (drafter 'head')"),
    "plan": ("edgespec.cli.plan", "show how a bundle fits a memory budget (--memory-budget 1.5GB)"),
    "deploy": ("edgespec.cli.deploy", "print or --run the llama-server command for a bundle's GGUF target and draft"),
}


def _usage() -> str:
    lines = ["usage: edgespec <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in VERBS.items()]
    lines += ["", "Run `edgespec <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from .. import __version__

        print(f"edgespec {__version__}")
        return 0
    verb = VERBS.get(argv[0])
    if verb is None:
        print(f"edgespec: error: unknown command '{argv[0]}' (commands: {', '.join(VERBS)})", file=sys.stderr)
        return 2
    try:
        return importlib.import_module(verb[0]).main(argv[1:])
    except BrokenPipeError:
        # the reader left (`edgespec generate ... | head`): stop quietly, as `cat` would; stdout
        # goes to devnull so the interpreter's last flush does not fail again
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, the status a shell gives a command killed by the closed pipe
    except OSError as e:  # an unwritable cache folder, a full disk: the system's reason, on one line
        where = f": {e.filename}" if e.filename else ""
        print(f"edgespec: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1


def run() -> int:
    """The `edgespec` command itself (console script, `python -m edgespec`): it owns its process,
    so edgespec's onnxruntime sessions share one thread pool there (runtimes/onnxruntime/pool.py: plain
    decoding is faster). `main` alone, as tests and other programs call it, leaves the pools be."""
    from ..runtimes.onnxruntime.pool import share_threads

    share_threads()
    return main()
