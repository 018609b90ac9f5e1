"""From a memory budget to a plan: KV capacity, maximum draft length, KV dtype, draft or not.

Two lower bounds (SpecMemo): the least memory that runs speculative decoding with a useful
context (both models, k drafts, MIN_CONTEXT positions), and the least that runs the target
alone. Between them the draft model is dropped; below the plain bound nothing runs.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

from ..errors import MemoryBudgetError
from .budget import format_bytes
from .footprint import ModelMemory, candidate_bytes

__all__ = ["BOUND_HEADROOM", "DEFAULT_CONTEXT_SHARE", "PLAN_HEADROOM", "MIN_CONTEXT", "MAX_CONTEXT", "PREFILL_CHUNK",
           "WANT_CONTEXT", "Plan", "Bounds", "available_memory", "default_context", "lower_bounds", "plan_memory",
           "describe_plan"]

logger = logging.getLogger(__name__)

MIN_CONTEXT = 512  # a useful context: a system prompt and a few chat turns
WANT_CONTEXT = 4096  # the most exact KV dtype is kept while it still gives this much context
MAX_CONTEXT = 32768  # capacity is capped here unless the caller allows more
PREFILL_CHUNK = 256  # prompt tokens per forward under a budget: bounds the attention scratch
MIN_CHUNK = 32  # the planner halves the chunk down to this; the lower bounds assume it


# Measured overheads differ slightly from one process to the next, so a bound printed by one run
# carries this headroom: a budget set to it in the next run still holds what it promised.
BOUND_HEADROOM = 0.03
# ...and a plan leaves part of its budget unplanned, so that a process whose measured parts come
# out above the ones it planned from still peaks under the budget: a tiny model filled to its plan
# peaked from a little over its planned total to well under, in processes with glibc's moving mmap
# threshold; with it fixed (memory.loading), a little under every time (docs/memory-budgets.md)
PLAN_HEADROOM = 0.02  # of the budget (the printed bounds carry more, BOUND_HEADROOM)


# without a budget, the default context's KV cache (counted whole on every layer: an upper bound)
# may take at most this share of the memory available when the engine opens
DEFAULT_CONTEXT_SHARE = 0.5


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation now (psutil), None where it cannot tell."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (ImportError, OSError, AttributeError):
        return None


def default_context(trained: int | None, kv_per_token: int, available: int | None) -> int | None:
    """The context an engine holds when neither --max-context nor a memory budget sets one, on a
    backend whose KV buffers commit memory only as they fill: the model's `trained` context (at
    most MAX_CONTEXT), lowered where `kv_per_token` (both models, every layer) times it would
    take more than DEFAULT_CONTEXT_SHARE of the `available` memory, never below MIN_CONTEXT.
    None where the bundle records no trained context (the backend's own default then)."""
    if not trained:
        return None
    n = min(trained, MAX_CONTEXT)
    if available is not None and kv_per_token > 0:
        n = min(n, max(MIN_CONTEXT, int(available * DEFAULT_CONTEXT_SHARE) // kv_per_token))
    return n


def _unplanned(budget: int) -> int:
    return int(budget * PLAN_HEADROOM)


@dataclass(frozen=True)
class Bounds:
    """Budgets that run speculative / plain decoding (with headroom; what users are told), and the
    least this process needs (what the planner decides by)."""

    speculative: int | None  # None: nothing to draft with
    plain: int
    min_context: int
    least_speculative: int | None = None
    least_plain: int = 0

    @classmethod
    def from_needs(cls, speculative: int | None, plain: int, min_context: int) -> Bounds:
        def up(n: int) -> int:  # headroom, rounded up to a MiB
            return -(-int(n * (1 + BOUND_HEADROOM)) // 2**20) * 2**20

        return cls(None if speculative is None else up(speculative), up(plain), min_context, speculative, plain)


@dataclass(frozen=True)
class Plan:
    """What fits in `budget`, and where the bytes go."""

    budget: int
    use_draft: bool
    kv_capacity: int
    max_draft: int  # most tokens drafted per step (0: plain decoding)
    kv_dtype: str
    prefill_chunk: int
    bounds: Bounds
    parts: tuple[tuple[str, int], ...]  # (label, bytes), in order; they sum to `total`
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)


def _scratch(models: list[ModelMemory], chunk: int, ctx: int, reused: bool) -> int:
    """Scratch of the models' forwards of `chunk` tokens over `ctx` positions: the largest one's
    where a forward's scratch is given back before the next one runs (`reused`: the allocator
    maps such blocks and unmaps them when freed, runtimes/heap.py), else all of them together."""
    each = [m.workspace(min(chunk, max(ctx, 1)), ctx) for m in models]
    return max(each, default=0) if reused else sum(each)


def _need(base: int, models: list[ModelMemory], dtypes: list[str], k: int, draft_vocab: int | None,
          target_vocab: int, ctx: int, chunk: int, sampling: bool, reused: bool) -> int:
    """Bytes the process needs with `ctx` positions of context and prompts fed `chunk` at a time."""
    kv = sum(m.kv(d, ctx) for m, d in zip(models, dtypes))
    ws = _scratch(models, chunk, ctx, reused)
    return base + sum(m.fixed for m in models) + kv + ws + candidate_bytes(k, target_vocab, draft_vocab, sampling)


def _dtypes(models: list[ModelMemory], dtype: str) -> list[str]:
    return [dtype if dtype in m.kv_per_token else m.kv_dtypes[0] for m in models]


def _smallest_dtype(m: ModelMemory) -> str:
    return min(m.kv_per_token, key=m.kv_per_token.get)


def lower_bounds(base: int, target: ModelMemory, draft: ModelMemory | None, k: int,
                 min_context: int = MIN_CONTEXT, chunk: int = MIN_CHUNK, sampling: bool = True,
                 reused_scratch: bool = False) -> Bounds:
    """Least memory for speculative decoding (draft model, k drafts) and for plain decoding.

    Scratch is what a probe at the bounds' own shape measured (`bound_scratch`; a runtime can
    take far more than the estimate), else the estimate: so a budget at the bound really
    holds the draft model with a min_context context, whatever budget printed it."""
    target = replace(target, scratch=target.bound_scratch)
    draft = None if draft is None else replace(draft, scratch=draft.bound_scratch)
    small = _smallest_dtype(target)
    plain = _need(base, [target], [small], 0, None, target.vocab, min_context, chunk, sampling, reused_scratch)
    spec = None
    if draft is not None and k > 0:
        models = [target, draft]
        spec = _need(base, models, _dtypes(models, small), k, draft.vocab, target.vocab, min_context, chunk, sampling,
                     reused_scratch)
    return Bounds.from_needs(_with_headroom(spec), _with_headroom(plain), min_context)


def _with_headroom(need: int | None) -> int | None:
    """The least budget whose planned part (all but `_unplanned`) holds `need`."""
    return None if need is None else math.ceil(need / (1 - PLAN_HEADROOM))


@dataclass(frozen=True)
class _Room:
    """What every fit within one budget shares: the budget and the process's base, the target, the
    contexts asked for, and how prompts' sampling rows and forwards' scratch are counted."""

    budget: int
    base: int
    target: ModelMemory
    min_context: int
    max_context: int
    sampling: bool
    reused: bool  # forwards give their scratch back before the next one runs (see _scratch)


@dataclass(frozen=True)
class _Fit:
    """The target (and a draft, second) in a room, prompts fed `chunk` tokens at a time."""

    room: _Room
    models: tuple[ModelMemory, ...]
    chunk: int

    @property
    def draft_vocab(self) -> int | None:
        return self.models[1].vocab if len(self.models) > 1 else None

    def capacity(self, dtypes: list[str], k: int) -> int:
        """The most positions that fit with KV in `dtypes` (one per model) and `k` drafts a step
        (need grows with the context, so bisect)."""
        r, models = self.room, list(self.models)
        usable = r.budget - _unplanned(r.budget)

        def fits(n: int) -> bool:
            return _need(r.base, models, dtypes, k, self.draft_vocab, r.target.vocab, n, self.chunk, r.sampling,
                         r.reused) <= usable

        if not fits(1):
            return 0
        lo, hi = 1, r.max_context
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def capacity_in(self, dtype: str, k: int) -> int:
        """`capacity` with every model's KV in `dtype` where it offers it (else its first)."""
        return self.capacity(_dtypes(list(self.models), dtype), k)


def _pick_chunk(room: _Room, models: tuple[ModelMemory, ...], chunk: int) -> _Fit:
    """The largest prefill chunk (halving from `chunk`, down to MIN_CHUNK) whose attention scratch at the
    resulting capacity stays within what the KV cache itself takes: long contexts get small
    chunks, so the budget goes to context rather than to scratch."""
    dtypes = [m.kv_dtypes[0] for m in models]
    while chunk > MIN_CHUNK:
        n = _Fit(room, models, chunk).capacity(dtypes, 0)
        if _scratch(list(models), chunk, n, room.reused) <= sum(m.kv(d, n) for m, d in zip(models, dtypes)):
            break
        chunk //= 2
    return _Fit(room, models, chunk)


def plan_memory(budget: int, base: int, target: ModelMemory, draft: ModelMemory | None = None, *, k: int = 4,
                max_k: int | None = None, min_context: int = MIN_CONTEXT, max_context: int = MAX_CONTEXT,
                chunk: int = PREFILL_CHUNK, sampling: bool = True, reused_scratch: bool = False) -> Plan:
    """The plan for `budget` bytes: the draft stays if speculative decoding fits, the draft length
    goes up to max_k (the adaptive policies' range) while min_context still fits, and the rest of
    the budget becomes KV capacity, in the most exact KV dtype that still gives WANT_CONTEXT.

    `k` drafts per step (prompt lookup drafts too when `draft` is None; 0 = plain decoding).
    `reused_scratch`: the target's and the draft's forwards share one scratch (see _scratch).
    Raises MemoryBudgetError, naming both bounds, when even plain decoding does not fit."""
    if k < 0 or min_context < 1 or max_context < 1:
        raise ValueError("need k >= 0, min_context >= 1 and max_context >= 1")
    min_context = min(min_context, max_context)  # a context capped on purpose is still useful
    max_k = max(k, max_k or k)
    bounds = lower_bounds(base, target, draft, k, min_context, min(chunk, MIN_CHUNK), sampling, reused_scratch)
    room = _Room(budget, base, target, min_context, max_context, sampling, reused_scratch)
    _require_plain(room, bounds)
    speculative = draft is not None and bounds.least_speculative is not None and budget >= bounds.least_speculative
    if speculative:
        plan, scratch_bound = _with_draft(room, draft, k, max_k, chunk, bounds)
    else:  # prompt lookup still drafts without a draft model; a dropped draft model takes k with it
        plan, scratch_bound = _plan(room, None, k if draft is None else 0, max_k, chunk, bounds), False
    _require_context(room, plan, chunk)
    if draft is not None and k > 0 and not plan.use_draft:
        plan = replace(plan, notes=(_dropped(room, bounds, scratch_bound), *plan.notes))
    return plan


def _require_plain(room: _Room, bounds: Bounds) -> None:
    """Refuse a budget below the least plain decoding needs, naming both bounds."""
    if room.budget < bounds.least_plain:
        spec = f", {format_bytes(bounds.speculative)} with the draft model" if bounds.speculative else ""
        raise MemoryBudgetError(
            f"memory budget {format_bytes(room.budget)} is below the least this bundle needs: "
            f"{format_bytes(bounds.plain)} for plain decoding{spec} ({room.min_context}-token context)")


def _with_draft(room: _Room, draft: ModelMemory, k: int, max_k: int, chunk: int, bounds: Bounds
                ) -> tuple[Plan, bool]:
    """The plan with the draft model, and whether it was dropped after all: above the speculative
    bound the draft still goes where its measured scratch leaves less than min_context."""
    plan = _plan(room, draft, k, max_k, chunk, bounds)
    if plan.kv_capacity < room.min_context:  # the bound assumes the smallest prompt chunk
        plan = _plan(room, draft, k, max_k, MIN_CHUNK, bounds)
    if plan.kv_capacity >= room.min_context:
        return plan, False
    return _plan(room, None, 0, 0, chunk, bounds), True  # measured scratch exceeds the estimate


def _require_context(room: _Room, plan: Plan, chunk: int) -> None:
    """Refuse a plan with less than min_context positions, naming what plain decoding needs here."""
    if plan.kv_capacity < room.min_context:
        target = room.target
        need = _need(room.base, [target], [_smallest_dtype(target)], 0, None, target.vocab, room.min_context,
                     min(chunk, MIN_CHUNK), room.sampling, room.reused)
        raise MemoryBudgetError(
            f"memory budget {format_bytes(room.budget)} leaves room for only {plan.kv_capacity} tokens of context "
            f"once loaded; plain decoding with a {room.min_context}-token context needs {format_bytes(need)} here")


def _dropped(room: _Room, bounds: Bounds, scratch_bound: bool) -> str:
    """The note saying why the draft model was dropped."""
    why = (f"leaves the draft model less than a {room.min_context}-token context once its measured scratch "
           "is counted" if scratch_bound else f"is below the speculative bound {format_bytes(bounds.speculative)}")
    return f"memory budget {format_bytes(room.budget)} {why}: the draft model is dropped, decoding plainly"


def _plan(room: _Room, draft: ModelMemory | None, k: int, max_k: int, chunk: int, bounds: Bounds) -> Plan:
    """The plan with these models: draft length, then KV dtype, then the capacity they leave."""
    fit = _pick_chunk(room, (room.target,) if draft is None else (room.target, draft),
                      min(chunk, room.max_context))
    target = room.target
    max_k = max_k if k else 0
    kk = _draft_length(fit, k, max_k)
    dtype = _kv_dtype(fit, kk)
    capacity = fit.capacity_in(dtype, kk)
    notes: list[str] = []
    if kk < max_k:
        notes.append(f"draft length capped at {kk} (of {max_k}) to keep a {room.min_context}-token context")
    if dtype != target.kv_dtypes[0]:
        notes.append(f"KV cache in {dtype} (not {target.kv_dtypes[0]}) to fit a longer context")
    return Plan(room.budget, draft is not None, capacity, kk, dtype, min(fit.chunk, capacity), bounds,
                _parts(fit, dtype, capacity, kk), tuple(notes))


def _draft_length(fit: _Fit, k: int, max_k: int) -> int:
    """The longest draft, from max_k down, that still leaves min_context in the smallest KV dtype
    (k when none does: the bounds counted k)."""
    smallest = _smallest_dtype(fit.room.target)
    return next((c for c in range(max_k, k, -1) if fit.capacity_in(smallest, c) >= fit.room.min_context), k)


def _kv_dtype(fit: _Fit, k: int) -> str:
    """The most exact KV dtype that still gives WANT_CONTEXT (or max_context, if smaller); where
    none reaches it, the one that holds the most."""
    want = min(WANT_CONTEXT, fit.room.max_context)
    dtypes = fit.room.target.kv_dtypes
    reaching = next((d for d in dtypes if fit.capacity_in(d, k) >= want), None)
    return reaching if reaching is not None else max(dtypes, key=lambda d: fit.capacity_in(d, k))


def _parts(fit: _Fit, dtype: str, capacity: int, k: int) -> tuple[tuple[str, int], ...]:
    """Where the planned bytes go, labelled for describe_plan."""
    room, models = fit.room, list(fit.models)
    parts = [("runtime + tokenizer (measured)", room.base)]
    for m, d in zip(models, _dtypes(models, dtype)):
        parts += _model_parts(m, d, capacity)
    parts.append((f"candidates and logits (k <= {k})",
                  candidate_bytes(k, room.target.vocab, fit.draft_vocab, room.sampling)))
    probed = all(m.scratch is not None for m in models if not m.shares_body)
    whose = "the larger forward" if room.reused and len(models) > 1 else "a forward"
    parts.append((f"scratch of {whose} of {min(fit.chunk, capacity)} tokens over the context "
                  f"({'measured' if probed else 'estimated'})", _scratch(models, fit.chunk, capacity, room.reused)))
    return tuple(parts)


def _model_parts(m: ModelMemory, dtype: str, capacity: int) -> list[tuple[str, int]]:
    """One model's bytes: its weights and runtime, and its KV cache (a head on the target's body has none)."""
    how = "measured" if m.measured else "estimated"
    if m.shares_body:
        return [(f"{m.role} head on the target's body ({how})", m.fixed)]
    return [(f"{m.role} weights + runtime ({how})", m.fixed),
            (f"{m.role} KV cache ({_kv_label(m, dtype, capacity)})", m.kv(dtype, capacity))]


def _kv_label(m: ModelMemory, dtype: str, capacity: int) -> str:
    """How a model's KV bytes are counted: positions x bytes each, and the window-sized part."""
    share, rows = m.sliding
    per = m.kv_per_token[dtype]
    if not share:
        return f"{capacity} positions x {format_bytes(per)}, {dtype}"
    full = format_bytes(per * (1 - share))
    return (f"{capacity} positions x {full} + {min(capacity, rows)} x {format_bytes(per * share)} "
            f"on {share:.0%} of layers windowed, {dtype}")


def describe_plan(plan: Plan) -> str:
    """The plan as a small table, for `edgespec plan` and `-v`."""
    width = max(len(label) for label, _ in plan.parts)
    lines = [f"memory budget {format_bytes(plan.budget)}"]
    lines += [f"  {label:<{width}}  {format_bytes(n):>10}" for label, n in plan.parts]
    lines.append(f"  {'total':<{width}}  {format_bytes(plan.total):>10}")
    b = plan.bounds
    spec = f"speculative {format_bytes(b.speculative)}, " if b.speculative else ""
    lines.append(f"lower bounds ({b.min_context}-token context): {spec}plain {format_bytes(b.plain)}")
    mode = f"speculative, up to {plan.max_draft} drafts per step" if plan.max_draft else "plain decoding"
    if plan.max_draft and not plan.use_draft:
        mode = f"prompt lookup, up to {plan.max_draft} drafts per step"
    lines.append(f"plan: {mode}; context {plan.kv_capacity} tokens ({plan.kv_dtype} KV); "
                 f"prompts prefilled {plan.prefill_chunk} tokens at a time")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
