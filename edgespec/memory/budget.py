"""Memory sizes as people write them: "1.5GB", "900MiB", "2g", "512 MB", 1073741824.

Decimal units (KB, MB, GB, TB) are powers of 1000 and binary units (KiB, MiB, GiB, TiB) powers
of 1024, as on a disk label; a bare letter (K, M, G, T, as in `docker -m 2g`) is binary.
"""
from __future__ import annotations

import math
import re

from ..checks import is_number
from ..errors import MemoryBudgetError

__all__ = ["parse_bytes", "format_bytes", "UNITS"]

UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """Bytes in `text`; a MemoryBudgetError (one line, with examples) when it is not a size."""
    if isinstance(text, bool):
        raise MemoryBudgetError(f"memory budget must be a size like 1.5GB or 900MiB, got {text!r}")
    if is_number(text):
        value, unit = float(text), ""
    else:
        m = _PATTERN.match(str(text))
        if not m or m.group(2).lower() not in UNITS:
            raise MemoryBudgetError(f"memory budget must be a size like 1.5GB, 900MiB or 2g, got {text!r}")
        value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value * UNITS[unit]):  # nan, inf, or 400 digits: int() would raise a bare error
        raise MemoryBudgetError(f"memory budget must be a finite size like 1.5GB, got {str(text)[:40]!r}")
    n = int(value * UNITS[unit])
    if n <= 0:
        raise MemoryBudgetError(f"memory budget must be positive, got {text!r}")
    return n


def format_bytes(n: int | float) -> str:
    """Binary units with three significant digits: 1.41 GiB, 900 MiB, 36.0 KiB."""
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 1000 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"
