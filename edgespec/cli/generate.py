"""`edgespec generate [BUNDLE] PROMPT`: plain completion, streamed to stdout."""
from __future__ import annotations

import argparse
import sys

from ..engine.inputs import check_text
from ..errors import ConfigError
from .common import (
    add_engine_args,
    add_format_args,
    add_sampling_args,
    cli_entry,
    open_engine,
    print_memory_plan,
    response_format_from_args,
    sampling_kwargs,
    setup_logging,
    validate_sampling,
)

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgespec generate", description="Complete a prompt, streaming the text.")
    p.add_argument("args", nargs="+", metavar="[BUNDLE] PROMPT",
                   help="optional bundle folder or .gguf file, then the prompt ('-' reads it from stdin)")
    add_sampling_args(p, max_tokens=128)
    add_format_args(p)
    add_engine_args(p)
    p.add_argument("--stats", action="store_true", help="print speed and acceptance to stderr at the end")
    return p


def read_stdin() -> str:
    """All of stdin as UTF-8; a ConfigError naming the first bad byte instead of a traceback."""
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


@cli_entry
def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.args) > 2:
        parser.error("give at most a bundle and one prompt (quote the prompt)")
    args.bundle, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    if prompt == "-":
        if args.json_schema == "-":
            raise ConfigError("stdin can give the prompt or the JSON schema, not both")
        prompt = read_stdin()
    if not prompt:
        raise ConfigError("the prompt is empty; give the text to complete (or '-' to read it from stdin)")
    check_text(prompt, "the prompt", argv=True)
    setup_logging(args.verbose)
    validate_sampling(args)
    fmt = response_format_from_args(args)
    with open_engine(args) as engine:
        print_memory_plan(engine, args.verbose)
        stats = None
        for r in engine.stream(prompt, **sampling_kwargs(args), response_format=fmt):
            sys.stdout.write(r.text)
            sys.stdout.flush()
            stats = r.stats
        sys.stdout.write("\n")
        if args.stats and stats is not None:
            print(_format_stats(stats), file=sys.stderr)
    return 0


def _format_stats(st) -> str:
    acc = f", acceptance {st.acceptance:.0%}, {st.mean_accepted_length:.2f} tokens/step" if st.drafted else ""
    forced = f", {st.forced} forced by the grammar" if st.forced else ""
    return (f"[{st.new_tokens} tokens, {st.tokens_per_s:.1f} tok/s, first token {st.first_token_s * 1e3:.0f} ms"
            f"{acc}{forced}]")
