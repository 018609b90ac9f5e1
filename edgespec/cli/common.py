"""Flags and error handling shared by the verbs. The engine flags are generated from
edgespec.engine.config's EngineConfig fields; importing this module loads no decoding code."""
from __future__ import annotations

import _thread
import argparse
import functools
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import ConfigError, EdgespecError

__all__ = ["add_engine_args", "add_sampling_args", "sampling_kwargs", "sampling_params", "cli_entry", "setup_logging",
           "open_engine", "engine_config_from_args", "print_memory_plan", "add_format_args",
           "response_format_from_args", "Terminated", "sigterm_as_interrupt"]

log = logging.getLogger(__name__)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags, one per EngineConfig field (edgespec.engine.config.OPTIONS), plus -v."""
    from ..engine.config import OPTIONS, EngineConfig

    g = p.add_argument_group("engine")
    defaults = EngineConfig()
    for name, opt in OPTIONS.items():
        if opt.kind == "true":
            g.add_argument(*opt.flags, action="store_true", dest=name, help=opt.help)
        elif opt.kind == "false":
            g.add_argument(*opt.flags, action="store_false", dest=name, help=opt.help)
        elif opt.kind == "both":  # None: the verb's default
            g.add_argument(*opt.flags, action=argparse.BooleanOptionalAction, default=None, dest=name, help=opt.help)
        else:
            g.add_argument(*opt.flags, type=opt.type, choices=opt.choices, default=getattr(defaults, name),
                           dest=name, metavar=opt.metavar, help=opt.help)
    g.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")


def engine_config_from_args(args: argparse.Namespace, **verb_defaults):
    """The EngineConfig of the parsed engine flags (validated here, before any model loads);
    `verb_defaults` fill the flags left unset (None), e.g. a verb's own --tune default."""
    from ..engine.config import OPTIONS, EngineConfig

    given = {name: getattr(args, name) for name in OPTIONS if hasattr(args, name)}
    for name, value in verb_defaults.items():
        if given.get(name) is None:
            given[name] = value
    given = {name: value for name, value in given.items() if value is not None or OPTIONS[name].kind == "value"}
    return EngineConfig(**given)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int | None, temperature: float = 0.0,
                      top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> None:
    """The sampling flags with the verb's defaults; `max_tokens` None: the verb adds its own --max-tokens."""
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 = greedy (default: {temperature:g})")
    g.add_argument("--top-p", type=float, default=top_p, help=f"nucleus sampling mass (0, 1] (default: {top_p:g})")
    g.add_argument("--top-k", type=int, default=top_k, help=f"keep the k likeliest tokens (0 = off; default: {top_k})")
    g.add_argument("--min-p", type=float, default=min_p,
                   help=f"keep tokens at least this times as likely as the likeliest, after top-p [0, 1) "
                        f"(0 = off; default: {min_p:g})")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    if max_tokens is not None:
        g.add_argument("--max-tokens", type=int, default=max_tokens,
                       help=f"new tokens per reply (default: {max_tokens})")


def add_format_args(p: argparse.ArgumentParser) -> None:
    """The structured-output flags: at most one of --json-schema, --grammar, --regex."""
    g = p.add_argument_group("structured output (the reply follows it; at most one)").add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="a JSON schema the reply is valid against (JSON, not free "
                                                         "whitespace); '-' reads it from stdin")
    g.add_argument("--grammar", metavar="FILE", help="a GBNF grammar (llama.cpp's, rule root) or a Lark grammar "
                                                     "(llguidance's, rule start) the reply follows")
    g.add_argument("--regex", metavar="PATTERN", help="a regular expression the whole reply matches")


def _read_spec(path: str, what: str) -> str:
    from pathlib import Path

    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def response_format_from_args(args: argparse.Namespace):
    """The ResponseFormat the flags ask for (None: free text), validated before any model loads."""
    from ..decoding.grammar import ResponseFormat

    if getattr(args, "json_schema", None):
        return ResponseFormat.json_schema(_read_spec(args.json_schema, "the JSON schema"))
    if getattr(args, "grammar", None):
        return ResponseFormat.grammar(_read_spec(args.grammar, "the grammar"))
    if getattr(args, "regex", None) is not None:
        return ResponseFormat.regex(args.regex)
    return None


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                max_tokens=args.max_tokens)


def sampling_params(args: argparse.Namespace):
    """The SamplingParams of the parsed sampling flags (validated: a bad value is a ConfigError)."""
    from ..decoding import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed)


def validate_sampling(args: argparse.Namespace) -> None:
    """Fail on bad sampling flags before any model is loaded."""
    from ..decoding import check_max_tokens

    sampling_params(args)
    check_max_tokens(args.max_tokens, "--max-tokens")


def open_engine(args: argparse.Namespace, **verb_defaults):
    """Load `args.bundle` with the engine flags (see engine_config_from_args)."""
    from ..engine.engine import load

    return load(args.bundle, engine_config_from_args(args, **verb_defaults))


def print_memory_plan(engine, verbose: int) -> None:
    """With -v, the memory plan of an engine loaded under a budget, on stderr."""
    plan = getattr(engine, "memory_plan", None)
    if verbose and plan is not None:
        from ..memory import describe_plan

        print(describe_plan(plan), file=sys.stderr)


def setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP), unwinding as Ctrl-C does. Its own class because CPython marks a plain
    KeyboardInterrupt that leaves exec'd source text (dataclasses and namedtuple build their
    methods that way, all through transformers' import) as unhandled, and a `python -m` process
    then ends by SIGINT, whatever exit code it returns after catching it; and so that a verb that
    takes Ctrl-C as "stop this reply" (chat) can still tell that it must end."""


# a terminal closing sends SIGHUP; both end the process by default, leaving a build's staging folder
_ENDING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
# long enough for the callback that swallowed the signal to have returned
_REDELIVERY_DELAY_S = 0.01


@contextmanager
def sigterm_as_interrupt() -> Iterator[list[int]]:
    """While the block runs, SIGTERM and SIGHUP raise Terminated where the process is, so it
    unwinds as Ctrl-C does (a bundle being built, GBs in its staging folder, is removed; an old
    bundle stays) instead of dying outright. A signal the parent set to be ignored (`nohup`) stays
    ignored. Yields a list that receives the signal that came."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield got
        return

    def terminate(signum, frame) -> None:
        got.append(signum)
        raise Terminated

    previous = {sig: signal.getsignal(sig) for sig in _ENDING}
    for sig, handler in previous.items():
        if handler is signal.SIG_DFL:
            signal.signal(sig, terminate)
    hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_redeliver, got=got, fallback=hook)
    try:
        yield got
    finally:
        sys.unraisablehook = hook
        for sig, handler in previous.items():
            if handler is signal.SIG_DFL:
                signal.signal(sig, handler)


def _redeliver(unraisable, *, got: list[int], fallback: Callable) -> None:
    """A signal that lands while Python runs a callback whose exceptions it ignores (a weakref's,
    as importlib's module locks have, or a `__del__`) raises Terminated there, and the process
    would go on as if it never came. Call its handler again, from another thread a moment later:
    raised here, it would be lost the same way (this hook's own exceptions are ignored too); it
    then runs in the code that follows, where it can unwind. Once the block has ended and the
    default action is back, `interrupt_main` does nothing."""
    if isinstance(unraisable.exc_value, Terminated) and got:
        again = threading.Timer(_REDELIVERY_DELAY_S, _thread.interrupt_main, (got[-1],))
        again.daemon = True
        again.start()
        return
    fallback(unraisable)


def cli_entry(fn: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
    """Turn user-facing errors into one line on stderr and a non-zero exit code; SIGTERM or
    SIGHUP unwind the verb (cleaning up what it was writing) and exit as a shell reports a kill
    by that signal (128 + its number)."""

    @functools.wraps(fn)
    def wrapper(argv: list[str]) -> int:
        with sigterm_as_interrupt() as ended:
            code = _run(fn, argv)
        return 128 + ended[0] if ended else code

    return wrapper


def _run(fn: Callable[[list[str]], int], argv: list[str]) -> int:
    try:
        return fn(argv)
    except EdgespecError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        return 1  # the wrapper returns the signal's status
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except Exception as e:
        if not _raised_while_terminating(e):
            raise
        # a library that mishandles an exception raised inside it (numpy takes a file object for a
        # path when one lands in its check) turns the unwinding into another error: the signal is the cause
        log.debug("ending by signal, unwound through %r", e)
        return 1  # the wrapper returns the signal's status


def _raised_while_terminating(e: BaseException) -> bool:
    """Whether `e` was raised while a Terminated was unwinding (it is in e's chain)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, Terminated):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False
