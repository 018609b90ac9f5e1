"""What an Engine opens, decided before anything is opened: a pure plan.

    plan = plan_engine(bundle.manifest, EngineConfig(k=3), installed_backends())

From the manifest, the validated EngineConfig and the backends installed on this machine, the
plan says which backend runs each model and from which bundle format, whether the draft runs on
the target's body (and why not, where it does not), the runtime options of each model, and the
limits the decoder gets. `Engine` (api.py) only executes it: open what the plan lists, plan memory
under a budget, probe exactness (exact_mode.py), build the decoder. Each rule is testable with a
fake manifest and no model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..decoding import DEFAULT_K, DRAFTERS
from ..decoding.limits import DecoderLimits
from ..errors import ConfigError
from ..runtimes import BACKENDS, pick_backend
from .choices import STATIC_DRAFT_WIDTH, backend_for_device, resolve_drafting, shared_body_blocker
from .config import EngineConfig
from .context import check_max_context
from .cores import CoreChoice
from .measured import Tuned, Tuning

__all__ = ["ModelPlan", "EnginePlan", "Tuned", "plan_engine", "MAX_PROBE_WIDTH", "probe_width", "decoder_limits"]

MAX_PROBE_WIDTH = 33  # the widest verify the exactness probe tries (and so the widest one allowed)


@dataclass(frozen=True)
class ModelPlan:
    """One model to open: on which backend, from which artifact, with which runtime options."""

    backend: str
    format: str
    file: str  # the artifact's file, relative to the bundle
    precision: str | None
    options: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class EnginePlan:
    """Everything `Engine` opens and the limits it builds its decoder with."""

    config: EngineConfig
    target: ModelPlan
    # the draft model on its own body, or the draft's head on the target's body (shared_body);
    # None: no draft model (plain decoding, or prompt lookup only)
    draft: ModelPlan | None
    drafter: str | None  # a name from DRAFTERS, None: plain decoding
    policy: str
    k: int
    draft_body: str | None  # "shared" (the target's body), "own", None: no draft model
    draft_body_reason: str  # why the draft's body is the target's, its own, or absent
    budgeted: bool  # a memory budget plans capacities when the models open
    switchable: bool  # the target may reopen in one of its backend's exact modes (exact_mode.py)
    max_context: int | None
    max_k: int  # the longest draft a policy may ask for (adaptive policies go up to 2k)
    verify_limit: int | None = None  # the tuner's widest verify (None: the exact widths alone decide)
    tuned: bool = False  # the tuner chose what the config left open
    tuning: Tuning | None = None  # what the tuner measured (its candidates' figures), where it ran
    cores: CoreChoice | None = None  # the cores run on and the threads per model (cores.py); None: not chosen

    @property
    def threads(self) -> int | None:
        """Threads per model as the runtimes are opened with them (None: the backend's choice)."""
        return self.target.options.get("threads")

    @property
    def backend(self) -> str:
        return self.target.backend

    @property
    def shared_body(self) -> bool:
        """The draft runs on the target's body (its artifact gives only the head)."""
        return self.draft_body == "shared"

    @property
    def wants_draft_model(self) -> bool:
        return self.drafter is not None and DRAFTERS[self.drafter].needs_model

    def describe(self) -> dict[str, Any]:
        """The plan as plain values, for reports."""
        def model(p: ModelPlan | None) -> dict | None:
            return None if p is None else {"backend": p.backend, "format": p.format, "precision": p.precision,
                                           "options": dict(p.options)}

        return {"target": model(self.target), "draft": model(self.draft), "drafter": self.drafter,
                "policy": self.policy, "k": self.k,
                "draft_body": self.draft_body,
                "draft_body_reason": self.draft_body_reason, "budgeted": self.budgeted,
                "max_context": self.max_context, "verify_limit": self.verify_limit, "tuned": self.tuned,
                "cores": None if self.cores is None else self.cores.to_dict()}


def probe_width(drafter: str | None, policy: str, k: int, max_batch: int | None) -> int:
    """The widest verify the exactness probe checks: what the drafting may ask for (a plain engine
    probes what the default speculative one does), within the target's widest forward."""
    k = k if drafter is not None else DEFAULT_K
    # adaptive policies draft up to 2k and lookup tails as many again
    widest = k + 1 if policy == "fixed" and drafter is not None else 4 * k + 1
    if max_batch is not None:
        widest = min(widest, max_batch)
    return max(2, min(widest, MAX_PROBE_WIDTH))


def decoder_limits(max_context: int | None, kv_capacities: list[int | None], memory_plan, exactness,
                   shared_body: bool, verify_limit: int | None = None,
                   prefill_chunk: int | None = None) -> DecoderLimits:
    """What every decoder on an engine's runtimes is built with: the context the caches and the
    config allow, a memory plan's draft length and prefill chunk (without a plan, `prefill_chunk`),
    and the verify widths the exactness probe found exact, within the tuner's `verify_limit` (a
    draft on the target's body keeps to them too), up to the keys it probed them at. None: no limit."""
    mp = memory_plan
    caps = [n for n in kv_capacities if n] + ([max_context] if max_context is not None else [])
    caps += [mp.kv_capacity] if mp is not None else []
    exact, reach = _exact_bounds(exactness, verify_limit)
    return DecoderLimits(
        context_limit=min(caps) if caps else None, max_draft=mp.max_draft if mp is not None else None,
        verify_width=exact, draft_width=exact if shared_body else None, exact_reach=reach,
        # draft trees where the target verifies them and the probe did not find their rows off
        trees=exactness is None or exactness.trees is not False,
        # prompts prefill in the chunks the memory plan sized the scratch memory for, else in
        # `prefill_chunk`s; a verify forward is never split
        max_batch=(max(mp.prefill_chunk, mp.max_draft + 1, 2) if mp is not None
                   else None if prefill_chunk is None else max(prefill_chunk, MAX_PROBE_WIDTH)))


def _threads(config: EngineConfig, cores: CoreChoice | None) -> int | None:
    """Threads per model: the core choice's (made for config.threads), else the config's."""
    return config.threads if cores is None else cores.threads
def _exact_bounds(exactness, verify_limit: int | None) -> tuple[int | None, int | None]:
    """(widest verify, most keys a verify may reach): the widths the probe found exact, within the
    tuner's `verify_limit`, and the keys it checked them at; None where it found no width exact."""
    exact = exactness.exact_width if exactness is not None and exactness.exact_width >= 2 else None
    reach = exactness.reach if exact is not None else None
    if verify_limit is not None:
        exact = verify_limit if exact is None else min(exact, verify_limit)
    return exact, reach


def _frozen(options: dict) -> MappingProxyType:
    return MappingProxyType(dict(options))


def _default_context(m, backend: str) -> int | None:
    """The trained context where memory allows (memory/planner.default_context), on a backend
    whose KV buffers commit memory as they fill (its Runtime's `lazy_kv`); else None, its own default."""
    from ..memory.planner import available_memory, default_context
    from ..runtimes import runtime_class

    trained = getattr(m.target, "context_length", None)  # None: an older bundle
    try:
        if trained is None or not getattr(runtime_class(backend), "lazy_kv", False):
            return None
    except ImportError:  # not importable here: planned without opening
        return None
    entries = [e for e in (m.target, getattr(m, "draft", None)) if e is not None]
    per_token = sum(2 * 4 * e.n_layers * e.n_kv_heads * e.head_dim for e in entries)
    return default_context(trained, per_token, available_memory())


def plan_engine(manifest, config: EngineConfig, installed: list[str], tuned: Tuned | None = None,
                cores: CoreChoice | None = None) -> EnginePlan:
    """The plan for opening a bundle with `manifest` under `config` where `installed` backends are;
    `tuned` (tuning.py) fills what the config leaves open: the backend, an auto draft body, and
    the verify width where no k is given; `cores` (cores.choose_cores, made for config.threads)
    gives the threads per model and the cores the engine pins itself to."""
    c = config
    m = manifest
    check_max_context(c.max_context, getattr(m.target, "context_length", None))  # None: an older bundle
    backend = pick_backend(m.target.formats, c.backend or (tuned.backend if tuned else None)
                           or backend_for_device(c.device, m.target.formats, installed), installed)
    body = tuned.draft_body if tuned and tuned.draft_body and c.draft_body == "auto" else c.draft_body
    if c.static and not (BACKENDS[backend].static_shapes
                         or (c.draft_backend is not None and BACKENDS[c.draft_backend].static_shapes)):
        need = next((n for n, b in BACKENDS.items() if b.static_shapes), "openvino")
        raise ConfigError(f"static shapes need the {need} backend, not {backend} (add --backend {need})")
    fmt = BACKENDS[backend].bundle_format
    drafter, policy, k = resolve_drafting(c.drafter, c.policy, c.k, has_draft=m.draft is not None,
                                          use_draft=c.use_draft)
    if fmt not in m.target.formats:
        raise ConfigError(f"bundle has no {fmt} artifacts for backend {backend} "
                          f"(it has: {', '.join(sorted(m.target.formats))})")
    wants_draft = drafter is not None and DRAFTERS[drafter].needs_model
    budgeted = c.memory_budget is not None
    # static shapes (asked for, or an NPU's) hold their whole capacity from the start: their own default
    fixed = c.static or (c.device or "").upper().startswith("NPU")
    ctx = c.max_context if c.max_context is not None or budgeted or fixed else _default_context(m, backend)
    common = {"threads": _threads(c, cores), "device": c.device,
              **({"kv_capacity": ctx} if ctx is not None and not budgeted else {})}
    shared, reason = False, "no draft model"  # the draft's body is decided here, and only here
    if wants_draft:
        reason = "--draft-body own" if body == c.draft_body else "own body: measured fastest here"
        if body != "own":
            why = shared_body_blocker(m, fmt, backend, draft_backend=c.draft_backend, device=c.device,
                                      draft_device=c.draft_device, static=c.static, auto=body == "auto")
            if why is not None and body == "shared":
                raise ConfigError(f"--draft-body shared: {why}")
            shared, reason = why is None, why or ("a self-draft on a quantized target: one body" if body == c.draft_body
                                                  else "the target's body: measured fastest here")
    info = BACKENDS[backend]
    alternating = wants_draft and not shared  # two models take turns on the cores
    target_art = m.target.formats[fmt]
    if shared:
        target_opts = common
    else:
        target_opts = {**common, **info.static_options(c.static, k + 1), **(info.alternating if alternating else {})}
    target = ModelPlan(backend, fmt, target_art.file, target_art.precision, _frozen(target_opts))
    draft = None
    if shared:
        art = m.draft.formats[fmt]
        draft = ModelPlan(backend, fmt, art.file, art.precision, _frozen(common))
    elif wants_draft:
        draft = _own_draft(m, c, backend, fmt, common, installed)
    # a budget plans the target as opened, and static shapes have one width: neither switches
    switchable = not budgeted and not c.static and bool(info.exact_modes)
    draft_body = "shared" if shared else "own" if draft is not None else None
    return EnginePlan(c, target, draft, drafter, policy, k, draft_body, reason, budgeted, switchable, c.max_context,
                      k if policy == "fixed" else 2 * k, tuned.verify_width if tuned and c.k is None else None,
                      tuned is not None, cores=cores)


def _own_draft(m, c: EngineConfig, backend: str, fmt: str, common: dict, installed: list[str]) -> ModelPlan:
    """The draft model on its own body: on --draft-backend, else the target's backend where the
    draft has its format, else the first installed one that runs a format it has. Its id map is
    one per bundle, so any format agrees."""
    dback = c.draft_backend or (backend if fmt in m.draft.formats else pick_backend(m.draft.formats, None, installed))
    info = BACKENDS[dback]
    dfmt = info.bundle_format
    if dfmt not in m.draft.formats:
        raise ConfigError(f"the bundle's draft has no {dfmt} artifact for backend {dback} (it has: "
                          f"{', '.join(m.draft.formats)}); use --drafter ngram or --no-draft")
    options = {**common, "device": c.draft_device or (c.device if dback == backend else None),
               **info.static_options(c.static, STATIC_DRAFT_WIDTH), **info.alternating}
    art = m.draft.formats[dfmt]
    return ModelPlan(dback, dfmt, art.file, art.precision, _frozen(options))
