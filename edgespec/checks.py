"""Checks of values a caller, a file or a flag hands over: the one home of their shared rules.

Python counts `True` as the integer 1 and a JSON file or a form may hold `"4"` where 4 was meant;
a value that is neither is the caller's mistake and is named as one, with the bound it missed.
Each check raises the error type its caller's layer raises (a `ConfigError` for options, an
`ExportError` for a source model's metadata, a `ValueError` for a record read back from a cache).
"""
from __future__ import annotations

import math
import numbers

from .errors import ConfigError

__all__ = ["is_int", "is_number", "integer", "number", "one_of"]


def is_int(value: object) -> bool:
    """An integer (numpy's included) that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real number (numpy's included) that is not a bool; NaN and infinities count."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _span(least: float | None, most: float | None, above: float | None = None) -> str:
    low = f"> {above}" if above is not None else f">= {least}" if least is not None else ""
    if most is None:
        return f" {low}" if low else ""
    if least is not None and above is None:
        return f" in {least}..{most}"
    return f" {low} and <= {most}" if low else f" <= {most}"


def integer(value: object, name: str, *, least: int | None = None, most: int | None = None,
            error: type[Exception] = ConfigError) -> int:
    """`value` as an int, else `error("<name> must be an integer <bound>, got <value>")`."""
    if not is_int(value) or (least is not None and value < least) or (most is not None and value > most):
        raise error(f"{name} must be an integer{_span(least, most)}, got {value!r}")
    return int(value)


def number(value: object, name: str, *, least: float | None = None, most: float | None = None,
           above: float | None = None, error: type[Exception] = ConfigError) -> float:
    """`value` as a finite float within the bounds (`above` is strict), else `error(...)` naming them."""
    ok = is_number(value) and math.isfinite(value) and (least is None or value >= least) \
        and (most is None or value <= most) and (above is None or value > above)
    if not ok:
        raise error(f"{name} must be a finite number{_span(least, most, above)}, got {value!r}")
    return float(value)


def one_of(value: object, name: str, choices: tuple[str, ...] | list[str], *,
           error: type[Exception] = ConfigError) -> str:
    """`value` when it is one of `choices`, else `error("<name> must be one of a, b, got <value>")`."""
    if not isinstance(value, str) or value not in choices:
        raise error(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value
