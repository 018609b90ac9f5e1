"""Reading the process's memory: resident set size now, and its peak sampled in a thread."""
from __future__ import annotations

import threading
import time

__all__ = ["rss_bytes", "anon_bytes", "PeakRSS"]


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
    """Samples RSS every `interval_s` in a daemon thread while the block runs.

        with PeakRSS() as peak:
            work()
        peak.peak, peak.start
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        import psutil

        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="edgespec-peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())
