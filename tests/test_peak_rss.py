"""The first-run test's memory figure (tests/first_run.run_measured) is the child's own peak: not
the resident set of the process that spawned it (the kernel carries a spawner's high-water mark
into a new program's ru_maxrss at exec), and not blind to what the child itself holds."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tests.first_run import run_measured

MB = 1 << 20
HELD = 400 * MB  # what this process holds while it spawns


def _measure(code: str) -> tuple[int, int]:
    return run_measured([sys.executable, "-c", code], env=dict(os.environ), stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout_s=120)


def test_a_small_child_of_a_large_process_reports_its_own_small_peak():
    held = np.ones(HELD // 8)  # touched: resident
    code, peak = _measure("pass")
    assert held[-1] == 1.0
    assert code == 0
    assert 0 < peak < 100 * MB, f"{peak / MB:.0f} MB"


def test_a_child_s_own_allocation_is_counted():
    code, peak = _measure("import numpy as np; a = np.ones(300 * 2**20 // 8); print(a[-1])")
    assert code == 0
    assert peak >= 300 * MB, f"{peak / MB:.0f} MB"


def test_the_child_s_exit_code_is_passed_on():
    assert _measure("import sys; sys.exit(3)")[0] == 3
    assert _measure("import os, signal; os.kill(os.getpid(), signal.SIGTERM)")[0] == 128 + 15
