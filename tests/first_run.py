"""README's first command as a new user runs it: `edgespec chat` from an empty cache, in a process
of its own, its peak resident set read from the kernel (the child's own ru_maxrss, what
`/usr/bin/time -v` reports) and its wall time. The slow tier builds the default bundle this way
(conftest.default_cache), so the figure costs no build of its own."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FirstRun", "QUESTION", "run_first_chat"]

QUESTION = "What is the capital of France?\n"


@dataclass(frozen=True)
class FirstRun:
    returncode: int
    peak_rss: int  # bytes: the child's own ru_maxrss
    seconds: float
    stdout: str
    stderr: str


def run_first_chat(cache: Path, *args: str, timeout_s: float = 3600) -> FirstRun:
    """`edgespec chat ARGS` with a question piped in, on `cache` as EDGESPEC_CACHE. The tuning and
    the progress lines a user's first run has are left on (the test session turns both off). The child
    is reaped with os.wait4, which returns its own rusage (RUSAGE_CHILDREN would give the largest
    child the session ever had)."""
    # as a user's first run: tuning on, and the progress lines the test session silences shown
    env = {k: v for k, v in os.environ.items() if k not in ("EDGESPEC_TUNE", "EDGESPEC_PROGRESS")}
    env["EDGESPEC_CACHE"] = str(cache)
    with tempfile.TemporaryFile("w+") as stdin, tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err:
        stdin.write(QUESTION)
        stdin.seek(0)
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "edgespec", "chat", *args], stdin=stdin, stdout=out,
                                stderr=err, env=env)
        watchdog = threading.Timer(timeout_s, proc.kill)
        watchdog.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            watchdog.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return FirstRun(proc.returncode, int(usage.ru_maxrss) * 1024, seconds, out.read(), err.read())
