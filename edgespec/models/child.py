"""A helper process that can be killed: the one home of the bounded child that renders chat templates.

Chat templates are the bundle's (or the GGUF's) code. jinja2's sandbox refuses attribute escapes
but not work, and a Python thread cannot be stopped, so every render runs in a child process,
`python -m <module>`, under an address-space limit; the caller waits for each answer with a time
limit and kills the child (starting a new one on the next request) when it passes. Both the
library's renderer (models/templates.py) and the server's (server/render.py, which calls this
from a thread so its event loop only awaits) are a `ChildWorker` with their own `ChildSpec`.

The protocol is one JSON object per line. The parent first writes the spec's `hello` (what the
child needs to set itself up, such as the bundle folder); the child answers `{"ready": true}`
once it is set up (not counted against the time limit), or `{"error": ...}` when it cannot be;
then each request is answered by one object, the child's business. A timer kills the child at
the limit, which ends a blocked write or read: portable, unlike select() on a pipe.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BackendError

__all__ = ["ChildSpec", "ChildWorker", "ChildStartError", "ChildTimeout", "ChildDied", "ChildStopped",
           "limit_memory", "serve"]

logger = logging.getLogger(__name__)

Handler = Callable[[dict], dict]


@dataclass(frozen=True)
class ChildSpec:
    """What a child runs and the bounds it runs within."""

    module: str  # `python -m module` runs the child's side, a call of serve()
    memory_bytes: int  # its address-space limit
    startup_timeout_s: float  # for the child to start Python and set itself up on a busy machine
    line_limit: int  # bytes of one answer line
    name: str = "the chat template renderer"  # in messages
    hello: dict = field(default_factory=dict)  # the child's set-up, its first line
    env: tuple[tuple[str, str], ...] = ()  # variables for the child only


class ChildStartError(BackendError):
    """The child did not start, or did not say it was ready."""


class ChildTimeout(Exception):
    """The answer did not come within the time limit: the child was killed (the next request starts
    a new one)."""


class ChildDied(Exception):
    """The child exited, was killed or answered garbage before answering; `status` is its exit status."""

    def __init__(self, status: int | None) -> None:
        super().__init__(f"exit status {status}")
        self.status = status


class ChildStopped(Exception):
    """interrupt() was called: a request in progress was ended, new ones are refused."""


def limit_memory(nbytes: int) -> None:
    """Cap this process's address space (where the OS has the limit): a template that builds a
    huge string then fails with MemoryError instead of taking the machine's memory. For child
    processes only: it applies to everything the process does afterwards."""
    if sys.platform == "win32":
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = nbytes if hard == resource.RLIM_INFINITY else min(nbytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def _stop(proc: subprocess.Popen) -> None:
    """End a child: at the end of its input it exits; one that does not (it is rendering) is killed."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ChildWorker:
    """One child at a time, started on the first request (or by start()) and kept; requests are
    answered one at a time, each within its time limit. Thread-safe; the child is ended by close()
    (or when the worker is collected, or at exit)."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.restarts = 0  # children killed for passing the time limit
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def started(self) -> bool:
        """Whether a child was ever started here."""
        return self._finalizer is not None

    def start(self) -> None:
        """Start the child ahead of the first request. ChildStartError: it did not start."""
        with self._lock:
            self._running()

    def ask(self, request: dict, timeout_s: float) -> dict:
        """The child's answer to `request` (JSON values; TypeError or ValueError if not).
        ChildTimeout: past `timeout_s`; ChildDied: it exited or answered garbage; ChildStopped:
        interrupt() ended it; ChildStartError: no child could be started."""
        data = (json.dumps(request, ensure_ascii=True) + "\n").encode()
        with self._lock:
            try:
                return self._ask(data, timeout_s)
            except (ChildTimeout, ChildDied, ChildStartError):
                if self._stopping:  # interrupt() killed it
                    raise ChildStopped(f"{self.spec.name} was stopped") from None
                raise

    def _ask(self, data: bytes, timeout_s: float) -> dict:
        if self._stopping:
            raise ChildStopped(f"{self.spec.name} was stopped")
        proc = self._running()
        try:
            line, expired = _read_line(proc, timeout_s, data, self.spec.line_limit)
        except BaseException:  # Ctrl-C while it renders: its late answer must not reach the next request
            self._end()
            raise
        answer = None if expired else _parse(line)
        if isinstance(answer, dict):
            return answer
        self._end()  # killed by the timer, crashed, or answered garbage: the next request starts anew
        if expired:
            self.restarts += 1
            raise ChildTimeout(f"no answer within {timeout_s:g} s")
        raise ChildDied(proc.poll())

    def kill(self) -> None:
        """Kill the child now (its request is abandoned: its late answer must not reach the next
        one); the next request starts a new one. Safe from another thread or a signal handler."""
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()

    def interrupt(self) -> None:
        """End a request in progress and refuse new ones (the process is stopping). Safe to call
        from a signal handler: it only kills the child."""
        self._stopping = True
        self.kill()

    def close(self) -> None:
        """End the child: it exits at the end of its input, or is killed a second later. Does not
        wait for a request in progress (that one then fails)."""
        finalizer = self._finalizer
        if finalizer is not None:
            finalizer()  # runs _stop once

    def __enter__(self) -> ChildWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _end(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._proc = None

    def _running(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        return self._proc

    def _start(self) -> subprocess.Popen:
        spec = self.spec
        env = {**os.environ, **dict(spec.env)}
        # the child imports this package from where the parent did, whatever its working folder
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen([sys.executable, "-m", spec.module, str(spec.memory_bytes)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        except OSError as e:
            raise ChildStartError(f"cannot start {spec.name}: {e.strerror or e}") from None
        self._proc = proc
        self._finalizer = weakref.finalize(self, _stop, proc)
        hello = (json.dumps(spec.hello, ensure_ascii=True) + "\n").encode()
        line, expired = _read_line(proc, spec.startup_timeout_s, hello, spec.line_limit)
        ready = None if expired else _parse(line)
        if ready != {"ready": True}:
            self._end()
            raise ChildStartError(f"{spec.name} did not start ({_why_not_ready(ready, expired, spec, proc)})")
        return proc


def _why_not_ready(ready: Any, expired: bool, spec: ChildSpec, proc: subprocess.Popen) -> str:
    if expired:
        return f"not ready within {spec.startup_timeout_s:g} s"
    if isinstance(ready, dict) and "error" in ready:
        return str(ready["error"])
    return f"exit status {proc.poll()}"


def _read_line(proc: subprocess.Popen, timeout_s: float, request: bytes, limit: int) -> tuple[bytes, bool]:
    """(one line the child wrote after `request`, whether the time limit killed it first)."""
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        with contextlib.suppress(OSError):
            proc.kill()

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        proc.stdin.write(request)
        proc.stdin.flush()
        line = proc.stdout.readline(limit)
    except (OSError, ValueError):
        line = b""
    finally:
        timer.cancel()
    return line, expired.is_set()


def _parse(line: bytes) -> Any:
    if not line.endswith(b"\n"):  # cut at the line limit, or the child is gone
        return None
    try:
        return json.loads(line)
    except ValueError:
        return None


# -- the child's side ------------------------------------------------------------------------

def _watch_parent() -> None:
    """End this child when its parent is gone (killed outright while a render ran): otherwise a
    template that never ends would keep a core busy with no one waiting for it."""
    import time

    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _write(stdout, answer: dict) -> None:
    stdout.write(json.dumps(answer, ensure_ascii=True) + "\n")
    stdout.flush()


def _answer(handle: Handler, line: str, name: str) -> dict:
    try:
        return handle(json.loads(line))
    except MemoryError:
        return {"kind": "limit", "error": f"{name} ran out of memory"}
    except (ValueError, KeyError, TypeError) as e:
        return {"kind": "failed", "error": f"malformed request: {type(e).__name__}"}


def serve(setup: Callable[[dict], Handler], name: str = "the chat template renderer") -> None:
    """The child's main (`if __name__ == "__main__": serve(...)`): bound this process, build the
    handler from the parent's hello, then answer requests until stdin closes. `setup` raises to
    refuse to start (its message goes to the parent); the handler returns the answer object."""
    import signal

    # Ctrl-C in the terminal reaches the whole process group: the parent reports it and stops
    # this child (closes its input), which must not print a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    limit_memory(int(sys.argv[1]))
    threading.Thread(target=_watch_parent, daemon=True, name="edgespec-child-parent").start()
    stdin, stdout = sys.stdin, sys.stdout
    try:
        handle = setup(json.loads(stdin.readline() or "{}"))
    except Exception as e:  # noqa: BLE001 -- whatever stops the set-up, the parent reports it on one line
        _write(stdout, {"error": " ".join(f"{type(e).__name__}: {e}".split())[:300]})
        return
    _write(stdout, {"ready": True})
    for line in stdin:
        _write(stdout, _answer(handle, line, name))
