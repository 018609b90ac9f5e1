"""The process heap: give its freed pages back to the OS (no edgespec imports; every layer may use it)."""
from __future__ import annotations

import functools
import sys

__all__ = ["trim_heap"]


def trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim); a no-op elsewhere.

    Loading leaves large freed blocks behind that glibc keeps: the Gemma 3 tokenizer's JSON parse
    (~190 MiB of 310 MiB), onnxruntime's reads of external weights. Called before and after a
    model loads, the next allocations start from what is really in use, and so does the peak."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (macOS, Windows, musl: nothing to trim)."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
