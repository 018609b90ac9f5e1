"""Reading the process's memory: resident set size now, and its peak sampled in a thread."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..runtimes.heap import fixed_mmap_threshold, trim_heap

__all__ = ["rss_bytes", "anon_bytes", "trim_heap", "fixed_mmap_threshold", "PeakRSS", "peak_during"]

T = TypeVar("T")
PROBE_INTERVAL_S = 0.0005  # a probe forward of a tiny model lasts a few ms...
PROBE_SECONDS, PROBE_RUNS = 0.05, 8  # ...so peak_during runs it again, for this long at most


def rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def anon_bytes() -> int | None:
    """Resident memory not backed by files (RSS minus resident file pages), where the platform
    tells them apart (Linux); None elsewhere."""
    import psutil

    info = psutil.Process().memory_info()
    shared = getattr(info, "shared", None)
    return None if shared is None else int(info.rss - shared)


class PeakRSS:
    """Samples this process's RSS every `interval_s` in a daemon thread.

        with PeakRSS() as peak:          # peak.peak, peak.base (RSS when it started)
            work()
        rss = PeakRSS().start()          # or by hand: mark() = peak since the previous mark
        ...; rss.mark(); ...; rss.stop()
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.base = self.peak = 0
        self._window = 0  # peak since the last mark()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> int:
        rss = rss_bytes()
        self.peak = max(self.peak, rss)
        self._window = max(self._window, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def start(self) -> PeakRSS:
        self.base = self.peak = self._window = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="edgespec-peak-rss", daemon=True)
        self._thread.start()
        return self

    def mark(self) -> int:
        """Peak RSS since the previous mark (or the start); starts a new window."""
        self._sample()  # a window shorter than the interval still gets a reading
        peak, self._window = self._window, 0
        return peak

    def stop(self) -> int:
        """End sampling; the peak in bytes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return self.peak

    def __enter__(self) -> PeakRSS:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def peak_during(fn: Callable[[], T]) -> tuple[T, int]:
    """fn()'s result and the highest RSS this process reached while it ran (sampled every
    PROBE_INTERVAL_S, and once at the end). What a forward leaves behind is not its peak: an
    allocator may give its scratch back the moment it is freed. A repeatable `fn` (a probe
    forward) runs again while its runs last less than PROBE_SECONDS, up to PROBE_RUNS times: a
    tiny model's forward takes a few samples, and its peak may fall between two of them."""
    with PeakRSS(PROBE_INTERVAL_S) as peak:
        start = time.perf_counter()
        out = fn()
        for _ in range(PROBE_RUNS - 1):
            if time.perf_counter() - start >= PROBE_SECONDS:
                break
            fn()
    return out, peak.peak
