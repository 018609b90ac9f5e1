"""What an Engine opens, decided before anything is opened: a pure plan.

    plan = plan_engine(bundle.manifest, EngineConfig(k=3), installed_backends())

From the manifest, the validated EngineConfig and the backends installed on this machine, the
plan says, in small frozen parts each built by a short function: what runs the target (its
backend, bundle format and runtime options: `ModelPlan`), what drafts, on which body and why
(`DraftPlan`), and how drafting is paced (`PacingPlan`). `Engine` (engine.py) only executes it
(opening.py): open what the plan lists, plan memory under a budget, probe exactness
(exact_mode.py), build the decoder with `decoder_limits`. Each rule is testable with a fake
manifest and no model.
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

__all__ = ["ModelPlan", "DraftPlan", "PacingPlan", "EnginePlan", "Tuned", "plan_engine", "MAX_PROBE_WIDTH",
           "probe_width", "decoder_limits"]

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
class DraftPlan:
    """What drafts, on which body, and why: decided here, and only here."""

    drafter: str | None  # a name from DRAFTERS, None: plain decoding
    body: str | None  # "shared" (the target's body), "own", None: no draft model
    reason: str  # why the draft's body is the target's, its own, or absent
    # the draft model on its own body, or the draft's head on the target's body; None: no draft
    # model (plain decoding, or drafters that need none)
    model: ModelPlan | None = None

    @property
    def needs_model(self) -> bool:
        return self.drafter is not None and DRAFTERS[self.drafter].needs_model


@dataclass(frozen=True)
class PacingPlan:
    """How drafting is paced: the draft-length policy, its k and what the verify may span."""

    policy: str
    k: int
    max_k: int  # the longest draft a policy may ask for (adaptive policies go up to 2k)
    verify_limit: int | None = None  # the tuner's widest verify (None: the exact widths alone decide)


@dataclass(frozen=True)
class EnginePlan:
    """Everything `Engine` opens and the limits it builds its decoder with, in parts: the target
    (what runs it), the drafting (what drafts and why) and the pacing (how long the drafts)."""

    config: EngineConfig
    target: ModelPlan
    drafting: DraftPlan
    pacing: PacingPlan
    tuned: bool = False  # the tuner chose what the config left open
    tuning: Tuning | None = None  # what the tuner measured (its candidates' figures), where it ran
    cores: CoreChoice | None = None  # the cores run on and the threads per model (cores.py); None: not chosen

    # -- read-only views of the parts and the config ---------------------------------------
    @property
    def threads(self) -> int | None:
        """Threads per model as the runtimes are opened with them (None: the backend's choice)."""
        return self.target.options.get("threads")

    @property
    def backend(self) -> str:
        return self.target.backend

    @property
    def budgeted(self) -> bool:
        """A memory budget plans capacities when the models open."""
        return self.config.memory_budget is not None

    @property
    def switchable(self) -> bool:
        """The target may reopen in one of its backend's exact modes (exact_mode.py): a budget
        plans the target as opened, and static shapes have one width, so neither switches."""
        return not self.budgeted and not self.config.static and bool(BACKENDS[self.backend].exact_modes)

    @property
    def draft(self) -> ModelPlan | None:
        return self.drafting.model

    @property
    def drafter(self) -> str | None:
        return self.drafting.drafter

    @property
    def draft_body(self) -> str | None:
        return self.drafting.body

    @property
    def shared_body(self) -> bool:
        """The draft runs on the target's body (its artifact gives only the head)."""
        return self.drafting.body == "shared"

    @property
    def policy(self) -> str:
        return self.pacing.policy

    @property
    def k(self) -> int:
        return self.pacing.k

    def describe(self) -> dict[str, Any]:
        """The plan as plain values, for reports (and the tuner's cache key: keep it stable)."""
        def model(p: ModelPlan | None) -> dict | None:
            return None if p is None else {"backend": p.backend, "format": p.format, "precision": p.precision,
                                           "options": dict(p.options)}

        d, pace = self.drafting, self.pacing
        return {"target": model(self.target), "draft": model(d.model), "drafter": d.drafter,
                "policy": pace.policy, "k": pace.k, "draft_body": d.body, "draft_body_reason": d.reason,
                "budgeted": self.budgeted, "max_context": self.config.max_context,
                "verify_limit": pace.verify_limit, "tuned": self.tuned,
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
    c, m = config, manifest
    check_max_context(c.max_context, getattr(m.target, "context_length", None))  # None: an older bundle
    backend = _backend(m, c, installed, tuned)
    drafter, policy, k = resolve_drafting(c.drafter, c.policy, c.k, has_draft=m.draft is not None,
                                          use_draft=c.use_draft)
    _check_format(m, backend)
    body, reason = _draft_body(m, c, backend, drafter, tuned)
    # every model's options: its threads, device and KV capacity
    common = {"threads": _threads(c, cores), "device": c.device, **_kv_option(m, c, backend)}
    return EnginePlan(
        config=c, target=_target_model(m, c, backend, common, body, k),
        drafting=DraftPlan(drafter=drafter, body=body, reason=reason,
                           model=_draft_model(m, c, backend, common, body, installed)),
        pacing=PacingPlan(policy=policy, k=k, max_k=k if policy == "fixed" else 2 * k,
                          verify_limit=tuned.verify_width if tuned and c.k is None else None),
        tuned=tuned is not None, cores=cores)


def _backend(m, c: EngineConfig, installed: list[str], tuned: Tuned | None) -> str:
    """The target's backend: the config's, else the tuner's, else the first installed one that
    drives the config's device and runs a format the bundle has; static shapes need a backend
    that has them (the draft's may be the one)."""
    named = c.backend or (tuned.backend if tuned else None) or backend_for_device(c.device, m.target.formats, installed)
    backend = pick_backend(m.target.formats, named, installed)
    if c.static and not (BACKENDS[backend].static_shapes
                         or (c.draft_backend is not None and BACKENDS[c.draft_backend].static_shapes)):
        need = next((n for n, b in BACKENDS.items() if b.static_shapes), "openvino")
        raise ConfigError(f"static shapes need the {need} backend, not {backend} (add --backend {need})")
    return backend


def _check_format(m, backend: str) -> None:
    fmt = BACKENDS[backend].bundle_format
    if fmt not in m.target.formats:
        raise ConfigError(f"bundle has no {fmt} artifacts for backend {backend} "
                          f"(it has: {', '.join(sorted(m.target.formats))})")


def _draft_body(m, c: EngineConfig, backend: str, drafter: str | None, tuned: Tuned | None) -> tuple[str | None, str]:
    """(the draft model's body, why): None without a draft model; "own" where it was asked for or
    measured fastest, or where the target's body cannot run it (auto); else "shared". A body
    asked for by --draft-body shared that cannot be is a ConfigError naming why."""
    if drafter is None or not DRAFTERS[drafter].needs_model:
        return None, "no draft model"
    # the tuner's choice fills an auto body; `measured`: the body is the tuner's, not the config's
    body = tuned.draft_body if tuned and tuned.draft_body and c.draft_body == "auto" else c.draft_body
    measured = body != c.draft_body
    if body == "own":
        return "own", "own body: measured fastest here" if measured else "--draft-body own"
    why = shared_body_blocker(m, BACKENDS[backend].bundle_format, backend, draft_backend=c.draft_backend,
                              device=c.device, draft_device=c.draft_device, static=c.static, auto=body == "auto")
    if why is None:
        return "shared", "the target's body: measured fastest here" if measured else \
            "a self-draft on a quantized target: one body"
    if body == "shared":
        raise ConfigError(f"--draft-body shared: {why}")
    return "own", why


def _kv_option(m, c: EngineConfig, backend: str) -> dict:
    """{"kv_capacity": n} where the models open with a capacity of n, else {}: a budget sizes it
    when they open; static shapes (asked for, or an NPU's) hold their whole capacity from the
    start, so they keep their own default; else the trained context where memory allows."""
    if c.memory_budget is not None:
        return {}
    fixed = c.static or (c.device or "").upper().startswith("NPU")
    ctx = c.max_context if c.max_context is not None or fixed else _default_context(m, backend)
    return {} if ctx is None else {"kv_capacity": ctx}


def _target_model(m, c: EngineConfig, backend: str, common: dict, body: str | None, k: int) -> ModelPlan:
    """The target's artifact and options: with a draft on its body, the common ones; else also
    the static width (k drafts and its own token) and, where a draft model takes turns with it on
    the cores, the backend's options for alternating models."""
    info = BACKENDS[backend]
    fmt = info.bundle_format
    art = m.target.formats[fmt]
    options = common if body == "shared" else {**common, **info.static_options(c.static, k + 1),
                                               **(info.alternating if body == "own" else {})}
    return ModelPlan(backend=backend, format=fmt, file=art.file, precision=art.precision, options=_frozen(options))


def _draft_model(m, c: EngineConfig, backend: str, common: dict, body: str | None,
                 installed: list[str]) -> ModelPlan | None:
    """The draft's artifact: its head on the target's body (the target's backend and options),
    the model on its own body (_own_draft), or None without a draft model."""
    if body is None:
        return None
    if body == "own":
        return _own_draft(m, c, backend, BACKENDS[backend].bundle_format, common, installed)
    fmt = BACKENDS[backend].bundle_format
    art = m.draft.formats[fmt]
    return ModelPlan(backend=backend, format=fmt, file=art.file, precision=art.precision, options=_frozen(common))


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
    return ModelPlan(backend=dback, format=dfmt, file=art.file, precision=art.precision, options=_frozen(options))
