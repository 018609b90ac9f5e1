"""A fair queue in front of the one engine: a single worker thread runs the generations one at
a time, in the order the requests arrived (FIFO), and hands each Response to the request's
event loop. A request whose client went away is cancelled: skipped while queued, stopped
at its next decoding step while running (the engine rewinds its caches)."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..decoding import GenerationStats
from ..errors import EdgespecError

if TYPE_CHECKING:
    from ..decoding import SamplingParams
    from ..decoding.grammar import Grammar
    from ..engine.engine import Engine, Response
    from ..engine.session import ReplyShaper

__all__ = ["Job", "GenerationWorker", "QueueFull"]

logger = logging.getLogger(__name__)

_END = object()  # end of a job's output


class QueueFull(Exception):
    """More requests are waiting than the server accepts."""


@dataclass
class Job:
    """One request's generation: its input, a cancel flag, and an asyncio queue of outputs."""

    tokens: list[int]
    params: SamplingParams
    max_tokens: int
    stop: Sequence[str]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    stats: GenerationStats = field(default_factory=GenerationStats)
    done: threading.Event = field(default_factory=threading.Event)
    shaper: ReplyShaper | None = None  # a transcript reply's shaping (session.ReplyShaper), or None
    grammar: Grammar | None = None  # what the reply follows (a response format, tool calls), compiled

    def put(self, item) -> None:
        """From the worker thread: hand an output to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop is gone (the server is shutting down)
            self.cancel.set()

    async def responses(self) -> AsyncIterator[Response]:
        """The generation's Responses as they come. Leaving early (a client that disconnected)
        cancels the job."""
        try:
            while True:
                item = await self.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel.set()  # harmless when the job has ended


class GenerationWorker:
    """Runs queued Jobs on `engine` in one thread, first come first served."""

    def __init__(self, engine: Engine, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        decoder = getattr(engine, "decoder", None)
        if decoder is not None:  # a request's greedy reply must not depend on the requests before it
            decoder.independent_requests = True
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self.current: Job | None = None  # the job that runs now
        self.completed = 0  # jobs that ran to the end
        self.cancelled = 0  # jobs stopped early or skipped (their client left) or failed

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="edgespec-generation", daemon=True)
                self._thread.start()

    def submit(self, job: Job) -> Job:
        if self._closed:
            raise QueueFull("the server is shutting down")
        self.start()
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self._jobs.maxsize} requests are already waiting; retry later") from None
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancel.is_set():  # the client left while it waited
                job.put(_END)
                self._finish(job, cancelled=True)
                continue
            self.current = job
            reason, stream = None, None
            try:
                stream = self.engine.stream_ids(job.tokens, job.params, job.max_tokens, job.stop, stats=job.stats,
                                                stop_event=job.cancel, wait=True, grammar=job.grammar)
                for r in stream:
                    r = r if job.shaper is None else job.shaper.shape(r)
                    reason = r.finish_reason
                    job.put(r)
                    if reason is not None:  # the shaper may end the reply before the engine does
                        break
                job.put(_END)
            except EdgespecError as e:
                logger.warning("generation failed: %s", e)
                job.put(e)
            except Exception as e:  # keep serving the next request
                logger.exception("generation failed")
                job.put(e)
            finally:
                if stream is not None:
                    stream.close()  # ended early: the engine rewinds its caches
                self.current = None
                self._finish(job, cancelled=reason in (None, "cancelled"))

    def _finish(self, job: Job, cancelled: bool) -> None:
        if cancelled:
            self.cancelled += 1
        else:
            self.completed += 1
        job.done.set()

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel the running and the queued jobs and stop the thread."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.put(_END)
        if self.current is not None:
            self.current.cancel.set()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
