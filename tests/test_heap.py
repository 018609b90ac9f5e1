"""The process heap as memory planning sees it: KV buffers committed as written, a forward's
scratch given back, and the peak of a call that gives its memory back before it returns."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from edgespec.memory.measure import peak_during, rss_bytes
from edgespec.runtimes.heap import fixed_mmap_threshold, lazy_zeros

MiB = 2**20
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS read from /proc (Linux)")


@linux
def test_lazy_zeros_commits_only_the_rows_written():
    """16 MiB, past the 4 MiB from which numpy asks for huge pages: a row written commits its own
    page, not 2 MiB."""
    a = lazy_zeros((4096, 1, 1024))
    before = rss_bytes()
    a[100] = 1.0
    assert rss_bytes() - before < MiB
    assert a.dtype == np.float32 and a.flags.writeable and a.ctypes.data % 4096 == 0
    assert a[100].sum() == 1024 and not a[:100].any() and not a[101:].any()
    assert lazy_zeros((0, 4)).shape == (0, 4)


@linux
def test_peak_during_sees_memory_given_back_before_the_call_returns():
    def forward() -> float:
        # a mapping of its own, unmapped when freed: malloc'd scratch may land in a free block of
        # the heap instead, which keeps its pages (whether one is free depends on what ran before)
        scratch = lazy_zeros((64 * MiB // 4,))
        scratch[:] = 1.0
        return float(scratch[-1])

    before = rss_bytes()
    out, peak = peak_during(forward)
    assert out == 1.0 and peak - before > 48 * MiB
    assert rss_bytes() - before < 16 * MiB


def test_fixed_mmap_threshold_says_whether_the_allocator_took_it():
    glibc = sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver())
    assert fixed_mmap_threshold() is glibc
