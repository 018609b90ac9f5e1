"""The process heap: give its freed pages back to the OS (no edgespec imports; every layer may use it)."""
from __future__ import annotations

import functools
import sys

__all__ = ["drop_file_pages", "trim_heap"]

_MADV_DONTNEED = 4  # Linux's madvise advice (sys/mman.h)


def trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim); a no-op elsewhere.

    Loading leaves large freed blocks behind that glibc keeps: the Gemma 3 tokenizer's JSON parse
    (~190 MiB of 310 MiB), onnxruntime's reads of external weights. Called before and after a
    model loads, the next allocations start from what is really in use, and so does the peak."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def drop_file_pages(paths) -> int:
    """Let go of the resident pages of this process's file mappings of `paths` that hold no page
    of their own (none written: every page is the file's); how many mappings. Linux only (else 0).

    onnxruntime maps each external initializer of a session's model (private, writable); the
    weights it prepacks are unmapped once packed, but scales, norms and block mins stay mapped, and
    every page its loading read stays resident (Gemma 3 270M: 31 MiB, of which decoding reads back
    ~16). An unwritten page comes back from the file when read again: the data cannot change, only
    what stays resident. A mapping with a written (copied) page is left alone."""
    libc = _libc()
    if libc is None:
        return 0
    import ctypes
    import os

    dropped = 0
    for lo, hi in _clean_mappings({os.path.realpath(p) for p in paths}):
        dropped += libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) == 0
    return dropped


def _clean_mappings(files: set[str]) -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of `files` without anonymous (written) pages."""
    found, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
                current = None
                if len(head) == 6 and head[5].rstrip("\n") in files:
                    current = tuple(int(x, 16) for x in head[0].split("-"))
            elif current is not None and line.startswith("Anonymous:"):
                if int(line.split()[1]) == 0:
                    found.append(current)
                current = None
    return found


@functools.cache
def _libc():
    """The C library (ctypes), or None: not Linux."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (macOS, Windows, musl: nothing to trim)."""
    libc = _libc()
    return getattr(libc, "malloc_trim", None) if libc is not None else None
