"""onnxruntime's process-wide thread pool, for a process that edgespec owns.

The default configuration runs a target cut into a body and its heads (runtimes/onnxruntime/split.py):
three sessions, one after another, on every step. Each session with a pool of its own must not
spin-wait between runs (its spinning threads would hold the cores the next session needs), so
every run wakes sleeping threads, and a plain step costs markedly more than the fused graph alone,
spinning. On onnxruntime's process-wide pool the same threads run every session and may spin
between runs, which makes both plain and speculative decoding faster (figures in
docs/backend-onnxruntime.md and BENCHMARKS.md). `session.force_spinning_stop` (spin
within a run only) gained less.

The catch is onnxruntime's: once that pool exists, a session built with a pool of its own is
refused ("use_per_session_threads must be false when using a global thread pool"), and the pool's
size can never change. So edgespec makes it only where asked: the `edgespec` command asks (it owns
its process), and so may an application that builds no onnxruntime sessions of its own
(`edgespec.share_threads()`). The first edgespec session then makes the pool with its own thread
count, and every later edgespec session runs on it. Sessions on either kind of pool round alike:
the kernels split their work by the thread count, which is the same.
"""
from __future__ import annotations

import logging
import threading

__all__ = ["pool_state", "share_threads", "shared_pool"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state = {"allowed": False, "made": None}  # made: the pool's size (0: onnxruntime's choice), or "theirs"


def share_threads() -> None:
    """Let edgespec's onnxruntime sessions run on one process-wide thread pool, made by the next
    session with that session's thread count. Call it only where the process builds no onnxruntime
    sessions of its own: onnxruntime then refuses those (a one-line error naming
    `use_per_session_threads`). Sessions built before keep their own pools."""
    with _lock:
        _state["allowed"] = True


def shared_pool(threads: int | None) -> bool:
    """Whether a session should run on the process-wide pool (then it ignores its own thread
    count): allowed by `share_threads()`, and made now with `threads` (None: onnxruntime's choice)
    if no session made it before."""
    with _lock:
        if not _state["allowed"]:
            return False
        if _state["made"] is None:
            import onnxruntime as ort

            try:
                ort.set_global_thread_pool_sizes(threads or 0, 1)
                _state["made"] = threads or 0
                logger.debug("onnxruntime's process-wide pool: %s threads", threads or "default")
            except Exception as e:  # made by other code in this process: its sessions and ours must use it
                logger.debug("onnxruntime's process-wide pool exists already (%s)", str(e).splitlines()[0])
                _state["made"] = "theirs"
        return True


def pool_state() -> dict:
    """{"allowed": bool, "made": None | thread count (0: onnxruntime's choice) | "theirs"}: what
    bench records with its figures, and what tests check."""
    with _lock:
        return dict(_state)
