"""Settling the target's exact mode when an engine opens (the probe is runtimes/exactness.py).

Where some verify widths of the target as opened do not round like one-token forwards on this
machine, the backend's exact modes (BackendInfo.exact_modes) are opened and probed too, one copy
of the model at a time, and the target (with a draft on its body) switches to the first that is
exact at every width, else to the one exact the widest. The mode kept is remembered, so the next
load opens it directly. Where no width is exact, the engine decodes plainly unless allow_inexact
says to draft anyway.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ..runtimes import BACKENDS, Runtime, probe_exactness

__all__ = ["Settled", "settle_exact_mode", "close_all", "inexact_drafting"]

logger = logging.getLogger(__name__)
_warned_inexact: set[tuple[str, float]] = set()


def close_all(runtimes) -> None:
    """Close the runtimes of a (target, shared draft) pair; None stands for no draft."""
    for rt in runtimes:
        if rt is not None:
            rt.close()


@dataclass(frozen=True)
class Settled:
    """The probe's verdict and the runtimes the engine keeps: the target, the draft on its body
    (None where the draft has its own, or there is none), and the runtime options of their mode."""

    verdict: object  # runtimes.exactness.Exactness
    target: Runtime
    shared_draft: Runtime | None
    mode: dict


def settle_exact_mode(backend: str, target: Runtime, shared_draft: Runtime | None, files: list[Path], widest: int,
                      *, threads: int | None, retune: bool, reopen: Callable[..., object] | None, mode: dict,
                      stack: ExitStack, remember: Callable[[dict], None] | None, reach: int | None = None) -> Settled:
    """Probe `target` up to `widest` (and `reach` keys: None, the probe's default); with
    `reopen(**options)` (None: the mode cannot switch), try the backend's exact modes where the
    opened one is not exact at every width. One copy of the
    model is open at a time: the runtimes open now close before a candidate opens, and where the
    candidate is no better, the mode kept opens again (its probe is cached: no second probe). The
    runtimes open at the end are entered into `stack`; `mode` is the one opened now, and the mode
    kept is passed to `remember`."""
    verdict = probe_exactness(backend, target, files, widest, threads=threads, retune=retune, reach=reach)
    for options in BACKENDS[backend].exact_modes if reopen is not None else ():
        if verdict.fully_exact:
            break
        close_all((target, shared_draft))  # two models open at once: a first load peaked at 2.5x the model
        pair = _opened(reopen(**options))
        try:
            other = probe_exactness(backend, pair[0], files, widest, threads=threads, retune=retune, reach=reach)
        except BaseException:
            close_all(pair)
            raise
        if other.exact_width > verdict.exact_width:
            logger.info("%s: switching to %s, exact here (%s)", backend, options, other.describe())
            verdict, mode = other, options
        else:
            close_all(pair)
            pair = _opened(reopen(**mode))
        target = stack.enter_context(pair[0])
        shared_draft = stack.enter_context(pair[1]) if pair[1] is not None else None
    if reopen is not None and remember is not None:
        remember(mode)
    return Settled(verdict, target, shared_draft, mode)


def _opened(opened) -> tuple[Runtime, Runtime | None]:
    """(target, draft on its body or None) of what `reopen` returned: a runtime, or such a pair."""
    return opened if isinstance(opened, tuple) else (opened, None)


def inexact_drafting(backend: str, verdict, allow_inexact: bool) -> bool:
    """Whether drafting stays on where no verify width is exact: only under `allow_inexact`, and
    then with a warning once per process and figure (chats reload engines); else the engine
    decodes plainly, which is the target's own output."""
    if not allow_inexact:
        logger.warning("%s: %s; drafting is off, decoding plainly (--allow-inexact drafts anyway)", backend,
                       verdict.describe())
        return False
    if (backend, verdict.worst_diff) not in _warned_inexact:
        _warned_inexact.add((backend, verdict.worst_diff))
        logger.warning("%s: %s; drafting anyway (--allow-inexact): greedy output may differ from plain "
                       "decoding on near-ties", backend, verdict.describe())
    return True
