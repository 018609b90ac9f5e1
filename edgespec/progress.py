"""Progress of long work on stderr: what each step does in plain words, and a bar where it counts.

Library code that may run for more than a few seconds (a bundle built on first use, an export,
the exactness probe, VocabTrim's calibration, tuning) reports through `task()`; a task quacks
like a tqdm bar, so a builder that was handed a bar keeps calling the same two methods:

    with task("calibrating VocabTrim", total=len(prompts), unit="prompt") as t:
        for p in prompts:
            t.set_postfix_str(p.name)  # what it does now
            ...
            t.update()                 # one more done

The reporter in effect shows it. The default, `Console`, writes to stderr: a tqdm bar on a
terminal, plain lines elsewhere (a pipe, a log file). A task shows nothing during its first
`delay_s` (a quick step stays quiet, and a bad input stays one error line), unless it is
announced (the first-run build says at once what it is doing and why). Once shown, a plain line
is written when the step's words change and at least every `every_s`, so a long step is never
silent; on a terminal the bar's clock keeps ticking. EDGESPEC_PROGRESS=0 turns it off;
`reporting(reporter)` puts another in effect for a block (None: silent), e.g. an app's own.
"""
from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, TextIO

__all__ = ["Console", "Reporter", "Task", "current", "reporting", "task"]

PROGRESS_ENV = "EDGESPEC_PROGRESS"


class Shown(Protocol):
    """What a reporter gives back for one task."""

    def show(self, done: int, note: str | None) -> None: ...
    def end(self, ok: bool) -> None: ...


class Reporter(Protocol):
    """Shows tasks: `begin` is called when a task starts, its handle with each change."""

    def begin(self, what: str, total: int | None, unit: str, announce: bool) -> Shown: ...


class Task:
    """A running task, as library code sees it (tqdm's method names)."""

    def __init__(self, shown: Shown | None) -> None:
        self._shown, self.n, self.note = shown, 0, None

    def update(self, n: int = 1) -> None:
        """`n` more units done."""
        self.n += n
        if self._shown is not None:
            self._shown.show(self.n, self.note)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        """What the task does now, in a few words."""
        self.note = text
        if self._shown is not None:
            self._shown.show(self.n, text)


_reporter: contextvars.ContextVar[Reporter | None | str] = contextvars.ContextVar("edgespec_progress",
                                                                                  default="default")


def current() -> Reporter | None:
    """The reporter in effect: the one `reporting` set, else the Console (None: silent)."""
    r = _reporter.get()
    if r != "default":
        return r  # type: ignore[return-value]
    if os.environ.get(PROGRESS_ENV, "").strip().lower() in ("0", "off", "no", "false"):
        return None
    return Console()


@contextmanager
def reporting(reporter: Reporter | None) -> Iterator[None]:
    """Show the tasks started in this block (this thread or task) with `reporter`; None: nothing."""
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)


@contextmanager
def task(what: str, total: int | None = None, unit: str = "step", *, announce: bool = False) -> Iterator[Task]:
    """Report the block as one task: `what` it is, `total` units if it counts them; `announce`:
    show it at once rather than after a quiet start."""
    reporter = current()
    shown = reporter.begin(what, total, unit, announce) if reporter is not None else None
    ok = False
    try:
        yield Task(shown)
        ok = True
    finally:
        if shown is not None:
            shown.end(ok)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"


class Console:
    """Tasks on a text stream (stderr): a tqdm bar on a terminal, plain lines elsewhere."""

    def __init__(self, stream: TextIO | None = None, *, delay_s: float = 3.0, every_s: float = 30.0,
                 tty: bool | None = None) -> None:
        self.stream = stream
        self.delay_s, self.every_s = delay_s, every_s
        self.tty = tty

    def begin(self, what: str, total: int | None, unit: str, announce: bool) -> Shown:
        stream = self.stream if self.stream is not None else sys.stderr
        if stream is None:  # started with stderr closed (`2>&-`): nowhere to say it
            return _Unshown()
        tty = self.tty if self.tty is not None else bool(getattr(stream, "isatty", lambda: False)())
        kind = _Bar if tty else _Lines
        return kind(stream, what, total, unit, 0.0 if announce else self.delay_s, self.every_s)


class _Unshown:
    def show(self, done: int, note: str | None) -> None:
        pass

    def end(self, ok: bool) -> None:
        pass


class _Ticking:
    """A task shown by a thread of its own, so the caller's work is never held up by the stream
    and a step that sends no news is still shown to be alive."""

    TICK_S = 0.5

    def __init__(self, stream: TextIO, what: str, total: int | None, unit: str, delay_s: float,
                 every_s: float) -> None:
        self.stream, self.what, self.total, self.unit = stream, what, total, unit
        self.delay_s, self.every_s = delay_s, every_s
        self.t0 = time.monotonic()
        self.done, self.note = 0, None
        self.visible = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="edgespec-progress", daemon=True)
        if delay_s <= 0:
            self._tick()
        self._thread.start()

    def show(self, done: int, note: str | None) -> None:
        self.done, self.note = done, note

    def end(self, ok: bool) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            if self.visible:
                self.close(ok)

    def _run(self) -> None:
        while not self._stop.wait(self.TICK_S):
            with self._lock:
                if not self._stop.is_set():
                    self._tick()

    def _tick(self) -> None:
        elapsed = time.monotonic() - self.t0
        if not self.visible and elapsed < self.delay_s:
            return
        try:
            self.tick(elapsed)
        except (OSError, ValueError):  # the stream is gone (a closed pipe): stop showing, keep working
            self._stop.set()
        self.visible = True

    def counted(self) -> str:
        if self.total is None:
            return ""
        plural = "" if self.total == 1 else "es" if self.unit.endswith(("s", "x", "ch", "sh")) else "s"
        return f" [{self.done}/{self.total} {self.unit}{plural}]"

    def tick(self, elapsed: float) -> None:
        raise NotImplementedError

    def close(self, ok: bool) -> None:
        raise NotImplementedError


class _Lines(_Ticking):
    """Plain lines: one when the task shows up, one when its words change, one at least every
    `every_s`, and one at its end."""

    last_line = 0.0
    said: list | None = None  # [the words last written], None before the first line

    def _write(self, text: str) -> None:
        self.stream.write(f"edgespec: {text}\n")
        self.stream.flush()

    def tick(self, elapsed: float) -> None:
        now = [self.note]  # a count alone changing waits for the next periodic line
        if self.said is not None and now == self.said and elapsed - self.last_line < self.every_s:
            return
        note = f": {self.note}" if self.note else ""
        still = f" ({_clock(elapsed)})" if self.said is not None else ""
        self._write(f"{self.what}{note}{self.counted()}{still}")
        self.said, self.last_line = now, elapsed

    def close(self, ok: bool) -> None:
        if ok:
            self._write(f"{self.what}: done in {_clock(time.monotonic() - self.t0)}")


class _Bar(_Ticking):
    """A tqdm bar, made when the task shows up; its clock is refreshed every tick."""

    bar = None

    def tick(self, elapsed: float) -> None:
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc=self.what, unit=self.unit, file=self.stream, leave=False,
                            dynamic_ncols=True, mininterval=0)
        self.bar.n = self.done
        self.bar.set_postfix_str(self.note or "", refresh=False)
        self.bar.refresh()

    def close(self, ok: bool) -> None:
        self.tick(time.monotonic() - self.t0)  # its last count shown, then
        self.bar.close()  # gone from the screen: a finished step needs no line there
