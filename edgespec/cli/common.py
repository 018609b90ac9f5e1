"""Flags and error handling shared by the verbs: one source for sampling and engine options."""
from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable

from ..errors import EdgespecError

__all__ = ["add_engine_args", "add_sampling_args", "sampling_kwargs", "cli_entry", "setup_logging", "open_engine",
           "print_memory_plan"]


# listed here, not imported, so `--help` loads no decoding code; tests/test_policy.py keeps them
# equal to edgespec.decoding's DRAFTERS and POLICIES and edgespec.choices' DRAFT_BODIES
DRAFTER_CHOICES = ("auto", "model", "ngram", "both", "none")
POLICY_CHOICES = ("fixed", "heuristic", "confidence", "cost")
DRAFT_BODY_CHOICES = ("auto", "shared", "own")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--backend", default=None,
                   help="runtime backend (default: the first installed one that runs the bundle; see `edgespec info`)")
    g.add_argument("--device", default=None, help="device for the target, e.g. CPU, GPU, NPU, AUTO (default: CPU)")
    g.add_argument("--draft-backend", default=None, help="run the draft on another backend (default: as the target)")
    g.add_argument("--draft-device", default=None, help="device for the draft (default: as the target)")
    g.add_argument("--no-draft", action="store_true",
                   help="do not load the draft model: plain decoding, or prompt lookup with --drafter ngram")
    g.add_argument("--drafter", choices=DRAFTER_CHOICES, default="auto",
                   help="who proposes drafts: the draft model, ngram (prompt lookup, no model needed), both, "
                        "or none; auto = both when the bundle has a draft model, else ngram")
    g.add_argument("--draft-policy", choices=POLICY_CHOICES, default=None, dest="policy",
                   help="draft length per step: fixed; heuristic (+2/-1); confidence (fixed, stops when the "
                        "draft is unsure); cost (measures costs and acceptance online, falls back to plain "
                        "decoding when drafting does not pay). Default: cost, or fixed when -k is given")
    g.add_argument("-k", "--draft-tokens", type=int, default=None, dest="k",
                   help="draft length per step; adaptive policies range up to twice this (default: 4)")
    g.add_argument("--draft-body", choices=DRAFT_BODY_CHOICES, default="auto",
                   help="shared: run the draft model on the target's body, loading only the draft's head (one "
                        "body's weights and KV cache); own: load the draft's own body; auto (default): shared "
                        "for a self-draft without a layer cut on an int8/int4 target, where the backend can "
                        "(OpenVINO, dynamic shapes, no --memory-budget)")
    g.add_argument("--static-shapes", action="store_true", dest="static",
                   help="OpenVINO: fixed KV capacity and verify width k+1, as NPUs need (NPU turns it on)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads per model (default: backend's choice)")
    g.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="memory for the whole process, e.g. 1.5GB or 900MiB: sizes the KV cache and draft length, "
                        "drops the draft model if it does not fit (see `edgespec plan`)")
    g.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="most tokens a conversation holds (default: 4096, or what --memory-budget allows); "
                        "chat drops its oldest turns beyond it")
    g.add_argument("--require-exact", action=argparse.BooleanOptionalAction, default=None,
                   help="draft only where a verify forward rounds bit for bit like plain decoding on this "
                        "machine (measured by a probe at the first load, cached; `edgespec info BUNDLE` shows "
                        "it); otherwise greedy drafting runs with a warning. Default: on for bench, off "
                        "elsewhere")
    g.add_argument("--retune", action="store_true",
                   help="measure this machine again (the exactness probe) instead of reading the cache")
    g.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                      top_k: int = 0) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 = greedy (default: {temperature:g})")
    g.add_argument("--top-p", type=float, default=top_p, help=f"nucleus sampling mass (0, 1] (default: {top_p:g})")
    g.add_argument("--top-k", type=int, default=top_k, help=f"keep the k likeliest tokens (0 = off; default: {top_k})")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"new tokens per reply (default: {max_tokens})")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                max_tokens=args.max_tokens)


def validate_sampling(args: argparse.Namespace) -> None:
    """Fail on bad sampling flags before any model is loaded."""
    from ..decoding import SamplingParams
    from ..errors import ConfigError

    SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")


def open_engine(args: argparse.Namespace):
    from ..api import load
    from ..errors import ConfigError

    if args.k is not None and args.k < 0:
        raise ConfigError(f"-k must be >= 0, got {args.k}")
    return load(args.bundle, backend=args.backend, device=args.device, draft_backend=args.draft_backend,
                draft_device=args.draft_device, use_draft=not args.no_draft, k=args.k, policy=args.policy,
                drafter=args.drafter, threads=args.threads, static=getattr(args, "static", False),
                draft_body=getattr(args, "draft_body", "auto"),
                require_exact=bool(getattr(args, "require_exact", None)), retune=getattr(args, "retune", False),
                **_memory_kwargs(args))


def _memory_kwargs(args: argparse.Namespace) -> dict:
    """--memory-budget, validated before any model loads; absent for verbs without it."""
    out = {}
    if getattr(args, "max_context", None) is not None:
        out["max_context"] = args.max_context
    budget = getattr(args, "memory_budget", None)
    if budget is not None:
        from ..memory import parse_bytes

        parse_bytes(budget)
        out["memory_budget"] = budget
    return out


def print_memory_plan(engine, verbose: int) -> None:
    """With -v, the memory plan of an engine loaded under a budget, on stderr."""
    plan = getattr(engine, "memory_plan", None)
    if verbose and plan is not None:
        from ..memory import describe_plan

        print(describe_plan(plan), file=sys.stderr)


def setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def cli_entry(fn: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
    """Turn user-facing errors into one line on stderr and a non-zero exit code."""

    @functools.wraps(fn)
    def wrapper(argv: list[str]) -> int:
        try:
            return fn(argv)
        except EdgespecError as e:
            print(f"edgespec: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("", file=sys.stderr)
            return 130

    return wrapper
