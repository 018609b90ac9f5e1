"""Open a bundle's runtimes inside a memory budget, measuring each one as it loads.

The process's RSS is read before the models load (interpreter, libraries, tokenizer) and
around each runtime's opening plus one warm-up forward (weights as the backend really holds
them: mapped pages touched, packed copies made, allocator primed). A first plan from file
sizes decides whether the draft is worth loading and sizes the KV buffers; the final plan,
from the measured numbers, sets the context limit (never above the buffers).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from ..runtimes.base import Runtime
from .footprint import KV_DTYPE_BYTES, ModelMemory, Shapes, estimate_fixed, kv_bytes_per_token
from .measure import anon_bytes, fixed_mmap_threshold, peak_during, rss_bytes, trim_heap
from .planner import MIN_CHUNK, MIN_CONTEXT, Plan, plan_memory

__all__ = ["estimated_memory", "head_estimate", "measured_memory", "mapped_bytes", "BudgetedLoad", "EngineBudget",
           "warm_up"]

logger = logging.getLogger(__name__)


def _kv_table(per_token_default: int, dtypes: tuple[str, ...]) -> dict[str, int]:
    first = KV_DTYPE_BYTES.get(dtypes[0], 4.0)
    return {d: int(round(per_token_default * KV_DTYPE_BYTES.get(d, first) / first)) for d in dtypes}


def estimated_memory(role: str, entry, file_bytes: int, kv_dtypes: tuple[str, ...]) -> ModelMemory:
    """Before loading: fixed bytes from the artifact's files, KV from the manifest's sizes."""
    per_tok = kv_bytes_per_token(entry.n_layers, entry.n_kv_heads, entry.head_dim, "float32")
    per_tok = int(per_tok * KV_DTYPE_BYTES.get(kv_dtypes[0], 4.0) / 4.0)
    return ModelMemory(role, estimate_fixed(file_bytes), _kv_table(per_tok, kv_dtypes), entry.vocab_size)


def head_estimate(entry, file_bytes: int, target_vocab: int, kv_dtypes: tuple[str, ...]) -> ModelMemory:
    """Before loading a draft on the target's body: its head, as the share of its file its
    vocabulary's rows take (at most: the file also holds a body), no KV cache."""
    head = int(file_bytes * min(1.0, entry.vocab_size / max(target_vocab, 1)))
    return ModelMemory("draft", head, {d: 0 for d in kv_dtypes}, entry.vocab_size, shares_body=True)


def measured_memory(role: str, rt: Runtime, fixed: int, estimate: ModelMemory | None = None) -> ModelMemory:
    """After loading: `fixed` as measured, KV and sizes as the runtime reports them (the
    manifest-based `estimate` stands in for what a backend does not report)."""
    sizes = rt.model_sizes()
    shapes = Shapes(**sizes) if sizes else (estimate.shapes if estimate else None)
    per_tok = rt.kv_bytes_per_token
    if per_tok > 0:
        table = _kv_table(per_tok, rt.kv_dtypes)
    elif estimate is not None:
        table = dict(estimate.kv_per_token)
    else:
        raise ValueError(f"the {role} runtime does not report kv_bytes_per_token")
    return ModelMemory(role, max(0, fixed), table, rt.vocab_size, shapes, measured=True,
                       sliding=getattr(rt, "kv_sliding", (0.0, 0)))


def mapped_bytes(rt: Runtime) -> int:
    """Bytes of weight files `rt` maps that may become resident after the load: the runtime's
    `mapped_weight_bytes()` where it tells (onnxruntime reads its weights into memory, and maps
    only Gather tables, read a row per token), else every byte of its weights."""
    tell = getattr(rt, "mapped_weight_bytes", None)
    return int(tell()) if callable(tell) else int(rt.memory_bytes().get("weights", 0))


def held_bytes(rt: Runtime, rss_delta: int, anon_before: int | None) -> int:
    """What a loaded model will hold: backends map weight files, and pages not read at load (an
    embedding row is read when its token first appears) become resident later. So: the private
    memory the load allocated plus the mapped weight files' bytes, or the RSS growth if larger."""
    anon_after = anon_bytes()
    if anon_before is None or anon_after is None:
        return max(rss_delta, mapped_bytes(rt))
    return max(rss_delta, anon_after - anon_before + mapped_bytes(rt))


def warm_up(*rts: Runtime) -> None:
    """One forward of a prompt chunk each, then empty caches: pages of the weights and what a
    runtime keeps after its first multi-token forward (onnxruntime: some heap) count in its
    fixed part now, not in the scratch a probe then measures and scales with the context.
    (A draft on the target's body is warmed after its target: the target's reset empties the body.)"""
    for rt in rts:
        rt.forward([0] * MIN_CHUNK, n_logits=1)
    for rt in rts:
        rt.reset()


@dataclass
class BudgetedLoad:
    """The steps of a budgeted load; the Engine and `edgespec plan` drive it the same way."""

    budget: int
    k: int  # drafts per step the engine will use (0: plain)
    max_k: int  # the adaptive policies' range
    max_context: int | None = None

    def __post_init__(self) -> None:
        # a forward's scratch is then what it uses while it runs, given back before the next one
        # (heap.py): the target's and the draft's forwards share it
        self.reused_scratch = fixed_mmap_threshold()
        trim_heap()  # what the tokenizer's load freed is not part of the base
        self.base = rss_bytes()
        self.target: ModelMemory | None = None
        self.draft: ModelMemory | None = None

    def _kw(self) -> dict:
        return {} if self.max_context is None else {"max_context": self.max_context}

    def plan(self, target: ModelMemory, draft: ModelMemory | None) -> Plan:
        return plan_memory(self.budget, self.base, target, draft, k=self.k, max_k=self.max_k,
                           reused_scratch=self.reused_scratch, **self._kw())

    def open(self, role: str, opener: Callable[[], Runtime], estimate: ModelMemory | None = None) -> Runtime:
        """Open one runtime, warm it up, and record its measured fixed bytes."""
        before, anon_before = rss_bytes(), anon_bytes()
        rt = opener()
        try:
            warm_up(rt)
        except Exception:
            rt.close()
            raise
        trim_heap()  # what the load freed is not held
        mem = measured_memory(role, rt, held_bytes(rt, rss_bytes() - before, anon_before), estimate)
        logger.info("%s loaded: %d MiB resident (weights and runtime)", role, mem.fixed >> 20)
        setattr(self, role, mem)
        return rt

    def open_pair(self, opener: Callable[[], tuple[Runtime, Runtime]], estimate: ModelMemory | None = None
                  ) -> tuple[Runtime, Runtime]:
        """Open a target and a draft on its body, warm them up, and record their measured bytes:
        the draft holds its head (what it reports of its weights), the target the rest."""
        before, anon_before = rss_bytes(), anon_bytes()
        target, draft = opener()
        try:
            warm_up(target, draft)
        except Exception:
            draft.close()
            target.close()
            raise
        trim_heap()  # what the load freed is not held
        total = held_bytes(target, rss_bytes() - before, anon_before) + mapped_bytes(draft)
        head = min(int(draft.memory_bytes().get("weights", 0)), total)
        self.target = measured_memory("target", target, total - head, estimate)
        kv = {d: 0 for d in self.target.kv_dtypes}
        self.draft = ModelMemory("draft", head, kv, draft.vocab_size, measured=True, shares_body=True)
        logger.info("target and a draft on its body loaded: %d MiB resident (the draft's head %d MiB)",
                    total >> 20, head >> 20)
        return target, draft

    def final(self, draft_estimate: ModelMemory | None, runtimes: dict[str, Runtime] | None = None) -> Plan:
        """The plan from measured numbers (the draft's estimate stands in if it was not loaded).

        With `runtimes`, each one kept runs one probe forward at the planned prompt chunk and
        context, and the scratch it really took replaces the estimate in the final plan."""
        if self.target is None:
            raise RuntimeError("open the target first")
        draft = self._draft_or(draft_estimate)
        kept = {role: rt for role, rt in (runtimes or {}).items() if rt is not None}  # a draft not loaded
        self._cap_context(kept.values())
        plan = self.plan(self.target, draft)
        probed = [self._probe(role, rt, plan) for role, rt in kept.items() if self._runs_probes(role, plan)]
        if any(probed):
            plan = self.plan(self.target, self.draft if plan.use_draft else draft)
        return plan

    def _draft_or(self, estimate: ModelMemory | None) -> ModelMemory | None:
        """The measured draft, else its estimate (marked so: the plan's parts say "estimated")."""
        if self.draft is not None:
            return self.draft
        return None if estimate is None else replace(estimate, measured=False)

    def _cap_context(self, runtimes: Iterable[Runtime]) -> None:
        """Never plan past the KV buffers the runtimes hold."""
        caps = [rt.kv_capacity for rt in runtimes if rt.kv_capacity]
        if caps:
            self.max_context = min([*caps, *([self.max_context] if self.max_context else [])])

    def _runs_probes(self, role: str, plan: Plan) -> bool:
        """Whether `role`'s runtime runs probe forwards: a model measured at load, with forwards of
        its own (not a head on the target's body), that the plan keeps."""
        mem = getattr(self, role)
        return mem is not None and not mem.shares_body and (role != "draft" or plan.use_draft)

    def _probe(self, role: str, rt: Runtime, plan: Plan) -> bool:
        """Measure `rt`'s scratch, record it in `role`'s memory; whether a probe ran.

        First at the lower bounds' own shape, which they then count; each probe's peak is taken
        from before the first, so what the first left held counts in the second."""
        mem: ModelMemory = getattr(self, role)
        before = rss_bytes()
        bctx = min(MIN_CONTEXT, rt.kv_capacity or MIN_CONTEXT, self.max_context or MIN_CONTEXT)
        bound = _scratch_probe(rt, min(MIN_CHUNK, bctx), bctx, before)
        if bound is not None:
            mem = replace(mem, bound_scratch=bound)
            setattr(self, role, mem)
        if mem.bound_scratch and plan.kv_capacity < 2 * MIN_CONTEXT:
            # a budget near the bound: a larger probe could itself take the room the bound
            # counted on (an allocator may keep it), so the bounds' probe is the measurement
            setattr(self, role, replace(mem, scratch=mem.bound_scratch))
            return bound is not None
        # then below the planned context (the estimate is scaled to it): a probe at the full
        # context could leave held what the plan then has no room for
        ctx = min(plan.kv_capacity, max(MIN_CONTEXT, plan.kv_capacity // 4))
        planned = _scratch_probe(rt, min(plan.prefill_chunk, ctx), ctx, before)
        if planned is None:
            return bound is not None
        setattr(self, role, replace(mem, scratch=planned))
        chunk, ctx, took = planned
        logger.info("%s scratch of a %d-token forward over %d positions: %d MiB", role, chunk, ctx, took >> 20)
        return True


def _scratch_probe(rt: Runtime, chunk: int, ctx: int, before: int) -> tuple[int, int, int] | None:
    """(chunk, ctx, bytes) the process's RSS peaked above `before` during `rt`'s probe forward of
    `chunk` tokens over `ctx` positions; None where the runtime cannot probe."""
    ran, peak = peak_during(lambda: ctx > 0 and rt.probe_scratch(chunk, ctx))
    return (chunk, ctx, max(0, peak - before)) if ran else None


def _windowed(mem: ModelMemory, path, fmt: str) -> ModelMemory:
    """`mem` with the window-sized KV onnxruntime and OpenVINO hold for the model at `path` (read
    from its metadata, runtimes/onnxruntime/kv.sliding_kv_of, runtimes/openvino/runtime.sliding_kv_of);
    other formats' holders keep every layer whole."""
    if fmt == "onnx":
        from ..runtimes.onnxruntime.kv import sliding_kv_of
    elif fmt == "openvino":
        from ..runtimes.openvino.runtime import sliding_kv_of
    else:
        return mem
    return replace(mem, sliding=sliding_kv_of(path))


def _files_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


class EngineBudget:
    """What an Engine does under a memory budget, step by step:

        eb = EngineBudget(budget, bundle, fmt, draft_fmt, kv_dtypes, k, max_k, wants_draft)
        target = eb.open_target(lambda **kw: open_runtime(..., **kw))
        if eb.load_draft: draft = eb.open_draft(lambda **kw: open_runtime(..., **kw))
    or, with a draft on the target's body (EngineBudget(..., shared_body=True)):
        target, draft = eb.open_pair(lambda **kw: open_shared_pair(..., **kw))
        plan = eb.finish()      # plan.use_draft False: close the draft, decode plainly
    """

    def __init__(self, budget: int, bundle, fmt: str, draft_fmt: str | None, kv_dtypes: tuple[str, ...], k: int,
                 max_k: int, wants_draft: bool, max_context: int | None = None, shared_body: bool = False) -> None:
        """shared_body: the draft runs on the target's body (open_pair), so it costs its head only."""
        m = bundle.manifest
        self.load = BudgetedLoad(budget, k, max_k, max_context)
        self._kv_dtypes = kv_dtypes
        self._t_est = _windowed(estimated_memory("target", m.target,
                                                 _files_bytes(bundle.file(m.target.formats[fmt].file)), kv_dtypes),
                                bundle.file(m.target.formats[fmt].file), fmt)
        self._d_est = None
        if wants_draft and m.draft is not None and draft_fmt is not None:
            draft_bytes = _files_bytes(bundle.file(m.draft.formats[draft_fmt].file))
            self._d_est = (head_estimate(m.draft, draft_bytes, m.target.vocab_size, kv_dtypes) if shared_body
                           else _windowed(estimated_memory("draft", m.draft, draft_bytes, kv_dtypes),
                                          bundle.file(m.draft.formats[draft_fmt].file), draft_fmt))
        # file sizes under-count what a backend holds, so this plan's capacity is an upper bound
        self.first = self.load.plan(self._t_est, self._d_est)
        self.load_draft = self.first.use_draft
        self.plan: Plan | None = None

    def _kwargs(self) -> dict:
        kw = {"kv_capacity": self.first.kv_capacity}
        if self.first.kv_dtype != self._kv_dtypes[0]:
            kw["kv_dtype"] = self.first.kv_dtype
        return kw

    def open_target(self, opener: Callable[..., Runtime]) -> Runtime:
        return self.load.open("target", lambda: opener(**self._kwargs()), self._t_est)

    def open_draft(self, opener: Callable[..., Runtime]) -> Runtime:
        return self.load.open("draft", lambda: opener(**self._kwargs()), self._d_est)

    def open_pair(self, opener: Callable[..., tuple[Runtime, Runtime]]) -> tuple[Runtime, Runtime]:
        """(target, draft) on one body: opener(**kw) -> the pair (runtimes.open_shared_pair)."""
        return self.load.open_pair(lambda: opener(**self._kwargs()), self._t_est)

    def finish(self, runtimes: dict[str, Runtime] | None = None) -> Plan:
        self.plan = self.load.final(self._d_est, runtimes)
        for n in self.plan.notes:
            logger.warning(n)
        return self.plan
