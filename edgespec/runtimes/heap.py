"""The process heap: give its freed pages back to the OS (no edgespec imports; every layer may use it)."""
from __future__ import annotations

import functools
import sys

__all__ = ["drop_file_pages", "fixed_mmap_threshold", "lazy_zeros", "trim_heap"]

_MADV_DONTNEED = 4  # Linux's madvise advice (sys/mman.h)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value


def trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim); a no-op elsewhere.

    Loading leaves large freed blocks behind that glibc keeps: the Gemma 3 tokenizer's JSON parse
    (most of what it peaked at), onnxruntime's reads of external weights. Called before and after a
    model loads, the next allocations start from what is really in use, and so does the peak."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def fixed_mmap_threshold() -> bool:
    """Serve every block of MMAP_THRESHOLD or more with its own mapping, given back when freed
    (glibc's mallopt); False where the allocator is not glibc's. Process-wide and permanent.

    glibc raises the threshold to the largest mapped block freed so far, and from then on serves
    such blocks from the heap and keeps up to twice that free at its top. A prompt fed in chunks
    over a growing context asks for ever larger blocks, so the heap grows chunk after chunk, to
    far more than one forward uses (docs/memory-budgets.md). With the
    threshold fixed, a forward's scratch is what it uses while it runs, which a memory plan can
    measure once and count. Page faults per forward go up (why it is set only under a budget)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    return bool(mallopt is not None and _malloc_trim() is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def lazy_zeros(shape: tuple[int, ...], dtype="float32"):
    """A zero-filled numpy array whose memory is committed a 4 KiB page at a time as it is written
    (an anonymous mapping advised against huge pages where the OS has the advice).

    numpy asks for transparent huge pages on arrays of 4 MiB or more, so a KV buffer written a row
    at a time commits 2 MiB on its first row, or does not, as the kernel finds a huge page free or
    not, so the first prompt's memory varied from one process to the next
    (docs/memory-budgets.md). Here memory follows the context actually used."""
    import mmap

    import numpy as np

    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # anonymous: zero pages until written; the array keeps it alive
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def drop_file_pages(paths) -> int:
    """Let go of the resident pages of this process's file mappings of `paths` that hold no page
    of their own (none written: every page is the file's); how many mappings. Linux only (else 0).

    onnxruntime maps each external initializer of a session's model (private, writable); the
    weights it prepacks are unmapped once packed, but scales, norms and block mins stay mapped, and
    every page its loading read stays resident, though decoding reads back only part of them. An
    unwritten page comes back from the file when read again: the data cannot change, only
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
