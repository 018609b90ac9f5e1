"""A context asked for past the model's trained context.

A model attends no further than the positions it was trained on: past them its rotary angles are
ones it never saw and its replies fall apart, while the KV cache asked for still costs memory.
The export records the trained context in the manifest (`target.context_length`,
exporters/context.py); a bundle from before that records none and is not checked.
"""
from __future__ import annotations

from ..errors import ConfigError

__all__ = ["check_max_context"]


def check_max_context(max_context: int | None, trained: int | None) -> None:
    """ConfigError (one line, naming both) when `max_context` is past the `trained` context; no
    check where either is unknown (no limit asked for, or a bundle that records none)."""
    if max_context is None or trained is None:
        return
    if max_context > trained:
        raise ConfigError(f"max_context {max_context} is past the model's trained context of {trained} tokens; "
                          f"use --max-context {trained} or less")
