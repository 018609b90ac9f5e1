"""Executing a plan once: open the target (and draft), plan memory under a budget, settle the
target's exact mode, and record what was opened (opened.py), deviations and their reasons included.

`open_plan` is the only place that opens an engine's runtimes; `Engine` (engine.py) calls it
once, from its constructor, and then only reads what it returns.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from ..bundle import Bundle
from ..decoding.cache import batch_limit
from ..runtimes import BACKENDS, Runtime, exact_mode_memory, open_runtime, open_shared_pair
from .assembly import EnginePlan, decoder_limits, probe_width
from .cores import pin_process
from .exact_mode import inexact_drafting, settle_exact_mode
from .opened import DRAFT_DOES_NOT_FIT, DRAFTING_REFUSED, Deviation, Opened

__all__ = ["Runtimes", "open_plan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtimes:
    """The runtimes an engine runs, and the record of what was opened."""

    target: Runtime
    draft: Runtime | None
    opened: Opened


@dataclass
class _Opening:
    """What is open while a plan executes (local to open_plan: it never leaves it)."""

    plan: EnginePlan
    stack: ExitStack
    target: Runtime | None = None
    draft: Runtime | None = None
    draft_backend: str | None = None
    drafter: str | None = None
    deviations: list[Deviation] = field(default_factory=list)

    def drop_draft(self, reason: str) -> None:
        """Decode without the draft model from here on, recording why."""
        if self.draft is not None:
            self.draft.close()
        self.draft = self.draft_backend = None
        if self.drafter is not None:
            self.deviations.append(Deviation("drafter", self.drafter, None, reason))
        self.drafter = None


def open_plan(bundle: Bundle, plan: EnginePlan, stack: ExitStack, *, retune: bool) -> Runtimes:
    """Open what `plan` lists (everything opened is entered into `stack`), plan memory under a
    budget, settle the target's exact mode; `retune`: probe again instead of reading the cache."""
    st = _Opening(plan, stack, drafter=plan.drafter)
    pin_process(plan.cores)  # before any runtime starts its threads: they inherit the cores
    budget = _budget(bundle, plan)  # None: no budget
    files = [bundle.file(plan.target.file)] + ([bundle.file(plan.draft.file)] if plan.shared_body else [])
    modes = _ModeMemory.of(plan, files, retune=retune)
    if budget is not None and modes.remember is not None and modes.remembered is None:
        # a budget plans the runtimes it opens and cannot switch them afterwards: settle the mode
        # an unbudgeted engine would open here first, so both give the same greedy text
        modes = dataclasses.replace(modes, mode=_settle_first(plan, files, modes, retune))
    reopen = _open_models(st, bundle, budget, files, modes.mode)
    memory_plan = budget.finish({"target": st.target, "draft": st.draft}) if budget else None
    if memory_plan is not None and st.draft is not None and not memory_plan.use_draft:
        st.drop_draft(DRAFT_DOES_NOT_FIT)  # measured, it does not fit after all
    exactness = None
    # a plain engine probes only to settle its target's mode where no engine has here yet
    if st.drafter is not None or (plan.switchable and modes.remembered is None):
        exactness = _settle(st, files, reopen if plan.switchable else None, modes, memory_plan, retune)
    c = plan.config
    kv = [rt.kv_capacity for rt in (st.target, st.draft) if rt is not None]
    limits = decoder_limits(c.max_context, kv, memory_plan, exactness, plan.shared_body, plan.pacing.verify_limit,
                            c.prefill_chunk)
    opened = Opened(plan, st.draft_backend, st.drafter, limits, exactness, memory_plan, tuple(st.deviations))
    return Runtimes(st.target, st.draft, opened)


@dataclass(frozen=True)
class _ModeMemory:
    """The target's mode (runtimes/exactness.py): the one settled on here last time, opened
    straight away. Plain and speculative engines share it, so that their greedy outputs are the
    same model's (an exact mode such as padded rows rounds unlike the default)."""

    mode: dict
    remembered: dict | None
    remember: object  # Callable[[dict], None] | None

    @classmethod
    def of(cls, plan: EnginePlan, files: list[Path], *, retune: bool) -> _ModeMemory:
        c, backend = plan.config, plan.backend
        ctx_kw = {"kv_capacity": c.max_context} if c.max_context is not None and not plan.budgeted else {}
        modes = BACKENDS[backend].exact_modes if not c.static else ()  # static shapes have one width
        if not modes:
            return cls({}, None, None)
        options = {"threads": plan.threads, "device": c.device, **ctx_kw}
        recall, remember = exact_mode_memory(backend, files[:1], options)
        remembered = None if retune else recall()
        return cls(remembered or {}, remembered, remember)


def _settle_first(plan: EnginePlan, files: list[Path], modes: _ModeMemory, retune: bool) -> dict:
    """The mode an engine without a budget settles on here (exact_mode.py), for a budgeted one to
    open: the target (with a draft on its body) opened as planned, probed, switched where another
    mode is exact wider, the mode kept remembered; then closed before the budget measures."""
    options = dict(plan.target.options)
    if plan.shared_body:
        reopen = functools.partial(open_shared_pair, plan.backend, files[0], files[-1], **options)
    else:
        reopen = functools.partial(open_runtime, plan.backend, files[0], **options)
    with ExitStack() as stack:
        opened = reopen()
        target, shared = opened if isinstance(opened, tuple) else (opened, None)
        stack.enter_context(target)
        if shared is not None:
            stack.enter_context(shared)
        widest = probe_width(plan.drafter, plan.policy, plan.k, batch_limit(target, None))
        settled = settle_exact_mode(plan.backend, target, shared, files, widest, threads=plan.threads,
                                    retune=retune, reopen=reopen, mode={}, stack=stack, remember=modes.remember,
                                    reach=plan.config.probe_context)
    return settled.mode


def _open_models(st: _Opening, bundle: Bundle, budget, files: list[Path], mode: dict):
    """Open the target (with a draft on its body) in `mode`, and a draft on its own body; returns
    `reopen(**options)`, which opens the target (pair) again in another mode."""
    plan = st.plan
    options = {**plan.target.options, **mode}
    if plan.shared_body:
        # a trained draft head (edgespec distill) runs on the same body, opened for the drafter 'head' only
        head = bundle.manifest.draft_head if st.drafter == "head" else None
        extra = {} if head is None else {"draft_head": bundle.file(head.file)}
        reopen = functools.partial(open_shared_pair, plan.backend, files[0], files[-1], **options, **extra)
        pair = budget.open_pair(reopen) if budget else reopen()
        st.target = st.stack.enter_context(pair[0])
        st.draft = st.stack.enter_context(pair[1])
        st.draft_backend = plan.backend
    else:
        reopen = functools.partial(open_runtime, plan.backend, files[0], **options)
        st.target = st.stack.enter_context(budget.open_target(reopen) if budget else reopen())
    if plan.drafting.needs_model and budget is not None and not budget.load_draft:
        st.drop_draft(DRAFT_DOES_NOT_FIT)  # finish() says so once; a head opened with the body goes too
    if st.drafter is not None and plan.draft is not None and not plan.shared_body:
        open_draft = functools.partial(open_runtime, plan.draft.backend, bundle.file(plan.draft.file),
                                       **plan.draft.options)
        st.draft = st.stack.enter_context(budget.open_draft(open_draft) if budget else open_draft())
        st.draft_backend = plan.draft.backend
    return reopen


def _settle(st: _Opening, files: list[Path], reopen, modes: _ModeMemory, memory_plan, retune: bool):
    """Probe exactness and keep the target's exact mode (exact_mode.py); where no verify width
    is exact, drafting goes (unless allow_inexact). Returns the probe's verdict."""
    plan = st.plan
    max_batch = decoder_limits(None, [], memory_plan, None, False).max_batch
    widest = probe_width(st.drafter, plan.policy, plan.k, batch_limit(st.target, max_batch))
    settled = settle_exact_mode(plan.backend, st.target, st.draft if plan.shared_body else None, files,
                                widest, threads=plan.threads, retune=retune, mode=modes.mode,
                                stack=st.stack, reopen=reopen, remember=modes.remember,
                                reach=plan.config.probe_context)
    st.target = settled.target
    if plan.shared_body and st.draft is not None:
        st.draft = settled.shared_draft
    if (settled.verdict.exact_width < 2 and st.drafter is not None
            and not inexact_drafting(plan.backend, settled.verdict, plan.config.allow_inexact)):
        st.drop_draft(DRAFTING_REFUSED)
    return settled.verdict


def _budget(bundle: Bundle, plan: EnginePlan):
    """The budgeted-load helper (edgespec.memory), or None when no budget is given."""
    if not plan.budgeted:
        return None
    from ..memory.loading import EngineBudget
    from ..runtimes import runtime_class

    m, fmt = bundle.manifest, plan.target.format
    dfmt = fmt if m.draft is not None and fmt in m.draft.formats else None
    k = plan.k if plan.drafter is not None else 0
    return EngineBudget(plan.config.budget_bytes, bundle, fmt, dfmt, runtime_class(plan.backend).kv_dtypes, k,
                        plan.pacing.max_k if k else 0, plan.drafting.needs_model, plan.config.max_context,
                        shared_body=plan.shared_body)
