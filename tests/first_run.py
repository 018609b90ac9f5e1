"""README's first command as a new user runs it: `edgespec chat` from an empty cache, in a process
of its own, its peak resident set read from the kernel (the child's own ru_maxrss, what
`/usr/bin/time -v` reports) and its wall time. The slow tier builds the default bundle this way
(conftest.default_cache), so the figure costs no build of its own.

The child is started by a small launcher process, never by the test process itself: at exec the
kernel carries the spawning process's high-water mark into the new program's ru_maxrss, so a child
spawned by a pytest worker holding a transformers model would report that worker's resident set.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FirstRun", "QUESTION", "run_first_chat", "run_measured"]

QUESTION = "What is the capital of France?\n"


@dataclass(frozen=True)
class FirstRun:
    returncode: int
    peak_rss: int  # bytes: the child's own ru_maxrss
    seconds: float
    stdout: str
    stderr: str


# Spawns argv[2:] with inherited stdio, reaps it with wait4 and writes its ru_maxrss (KiB) to
# argv[1]; exits with the child's code. A fresh interpreter of a few MB: what it hands on at exec is
# its own small high-water mark.
_LAUNCHER = ("import os, subprocess, sys\n"
             "proc = subprocess.Popen(sys.argv[2:])\n"
             "_, status, usage = os.wait4(proc.pid, 0)\n"
             "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
             "code = os.waitstatus_to_exitcode(status)\n"
             "sys.exit(code if code >= 0 else 128 - code)\n")


def run_measured(argv: list[str], *, env: dict, stdin, stdout, stderr, timeout_s: float) -> tuple[int, int]:
    """(exit code, peak RSS bytes) of `argv` run through the launcher: the child's own peak, whatever
    this process holds. On timeout the launcher's whole process group is killed."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "maxrss"
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(result), *argv], stdin=stdin, stdout=stdout,
                                stderr=stderr, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        peak = int(result.read_text()) * 1024 if result.exists() else 0
    return code, peak


def run_first_chat(cache: Path, *args: str, timeout_s: float = 3600) -> FirstRun:
    """`edgespec chat ARGS` with a question piped in, on `cache` as EDGESPEC_CACHE. The tuning and
    the progress lines a user's first run has are left on (the test session turns both off)."""
    # as a user's first run: tuning on, and the progress lines the test session silences shown
    env = {k: v for k, v in os.environ.items() if k not in ("EDGESPEC_TUNE", "EDGESPEC_PROGRESS")}
    env["EDGESPEC_CACHE"] = str(cache)
    with tempfile.TemporaryFile("w+") as stdin, tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err:
        stdin.write(QUESTION)
        stdin.seek(0)
        t0 = time.perf_counter()
        code, peak = run_measured([sys.executable, "-m", "edgespec", "chat", *args], env=env, stdin=stdin,
                                  stdout=out, stderr=err, timeout_s=timeout_s)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return FirstRun(code, peak, seconds, out.read(), err.read())
