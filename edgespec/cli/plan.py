"""`edgespec plan [BUNDLE] --memory-budget SIZE`: how a bundle fits a memory budget.

Loads the bundle the way `chat` would (so the numbers are measured, not guessed) and prints
where the bytes go, the two lower bounds, and the plan: context, draft length, draft kept."""
from __future__ import annotations

import argparse

from .common import add_engine_args, cli_entry, open_engine, setup_logging

__all__ = ["main", "build_parser"]

# without a budget: plan against this much, which shows the bounds and the full-context footprint
_UNBOUNDED = "1TiB"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgespec plan", description="Show how a bundle fits a memory budget.")
    p.add_argument("bundle", nargs="?", default=None, help="bundle or .gguf file (default: the embedded Gemma 3 270M)")
    add_engine_args(p)
    return p


@cli_entry
def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    unbounded = args.memory_budget is None
    with open_engine(args, memory_budget=_UNBOUNDED) as engine:
        from ..memory import describe_plan

        text = describe_plan(engine.memory_plan)
        if unbounded:  # the first line names the stand-in budget: say what the numbers are instead
            lines = text.splitlines()
            lines[0] = f"no memory budget: footprint at a {engine.memory_plan.kv_capacity}-token context"
            text = "\n".join(lines)
        print(text)
    return 0
