"""The CPUs this process may run on: its affinity mask, which `taskset`, a cgroup's cpuset or a
launcher's pinning narrows (what every default thread count and core choice starts from), or every
CPU the system reports where the platform has no such mask (macOS, Windows)."""
from __future__ import annotations

import os

__all__ = ["usable_cpu_ids", "usable_cpu_count"]


def usable_cpu_ids() -> list[int]:
    """The ids of the CPUs this process may run on, ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def usable_cpu_count() -> int:
    """How many CPUs this process may run on (at least one)."""
    return max(1, len(usable_cpu_ids()))
