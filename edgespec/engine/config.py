"""One engine configuration: every option of `edgespec.load`, validated once, when it is built.

    cfg = EngineConfig(backend="openvino", k=3)      # a ConfigError names the bad field
    engine = edgespec.load(bundle, cfg)               # or load(bundle, k=3): overrides of the default

The CLI's engine flags (`cli/common.py`), the server's and bench's engine settings are derived
from this one value: each field carries its flag and help text in `OPTIONS`, and the choice
lists come from the registries (BACKENDS, DRAFTERS, POLICIES, DRAFT_BODIES). Nothing downstream
checks these values again.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..checks import integer, one_of
from ..cpus import usable_cpu_count
from ..decoding import DEFAULT_K, DEFAULT_POLICY, DRAFTERS, POLICIES
from ..errors import ConfigError
from ..runtimes import BACKENDS, backend_info
from ..runtimes.exactness import MAX_PROBE_REACH
from .choices import DRAFT_BODIES, check_drafting

logger = logging.getLogger(__name__)

__all__ = ["EngineConfig", "Option", "OPTIONS", "DRAFTER_CHOICES", "POLICY_CHOICES", "DRAFT_BODY_CHOICES",
           "DEFAULT_PREFILL_CHUNK", "engine_config"]

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per forward without a memory budget (EngineConfig.prefill_chunk)

# the choices of the CLI flags, from the registries: "auto" picks from what the bundle has, "none"
# decodes plainly
DRAFTER_CHOICES = ("auto", *DRAFTERS, "none")
POLICY_CHOICES = tuple(POLICIES)
DRAFT_BODY_CHOICES = DRAFT_BODIES


@dataclass(frozen=True)
class Option:
    """How one EngineConfig field appears on the command line."""

    flags: tuple[str, ...]
    help: str
    kind: str = "value"  # "value" (typed by `type`), "true" (a switch), "false" (a switch that clears), "both"
    type: Any = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def _tune_default() -> bool:
    """Tuning is on unless EDGESPEC_TUNE=0: read when a config is built, not at import."""
    return os.environ.get("EDGESPEC_TUNE", "1").strip() not in ("0", "false", "no", "off")


def _opt(*flags: str, help: str, **kw) -> dict:
    return {"cli": Option(flags, help, **kw)}


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how a bundle is opened; frozen, and validated in __post_init__.

    backend: a name from edgespec.runtimes.BACKENDS (default: the first installed one that runs a
    format the bundle has); device: e.g. "CPU", "GPU", "NPU", "AUTO" where the backend has them;
    draft_backend / draft_device: run the draft elsewhere (default: as the target).
    drafter: "auto", "model", "ngram" (prompt lookup, no draft model needed), "recycle" (Token
    Recycling, no draft model), "lookup-recycle", "both", "both-recycle" or "none";
    policy: a draft-length policy from edgespec.decoding.POLICIES; k: the draft length (adaptive
    policies range up to 2k). See `resolve_drafting` for the defaults.
    memory_budget: bytes, or a size such as "1.5GB" or "900MiB" (kept in bytes), for the whole process: the KV
    capacity, draft length and whether the draft model loads are planned to fit it
    (edgespec.memory); below what plain decoding needs, a MemoryBudgetError names the bound.
    max_context: most tokens (prompt + reply) a sequence may hold (default: the backend's, 4096
    for onnxruntime, or what the budget allows); a chat drops its oldest turns to stay inside it.
    prefill_chunk: prompt tokens per forward without a budget (a budget's plan sizes its own; a
    verify forward is never split). onnxruntime's attention scratch grows with chunk x context:
    a long prompt in one forward takes several times the memory it takes in chunks, for a little
    more prefill time (docs/memory-budgets.md).
    static: OpenVINO's static-shape mode (as NPUs need; an NPU device turns it on by itself):
    fixed KV capacity and a fixed verify width k+1, so adaptive policies draft at most k.
    draft_body: "shared" runs the draft model on the target's body, the draft artifact giving
    only its (VocabTrim) head: one body's weights and KV cache, and no position goes through the
    body twice; "own" loads the draft's own body; "auto" (default) shares where the draft is a
    self-draft without a layer cut, the target is int8 or int4 and the backend can (OpenVINO,
    dynamic shapes, no memory budget). See shared_body_blocker.
    allow_inexact: by default the engine drafts only at the verify widths (and tree shapes) the
    exactness probe found bit-identical to plain decoding on this machine (run at the first load
    and cached; `Engine.exactness` holds its verdict), and decodes plainly where none is; True
    drafts there anyway, with a warning: greedy output may then differ from plain decoding.
    probe_context: how many keys the probe checks verifies at (default 4096, or the context if
    shorter); the engine drafts only within them and decodes plainly past them. A longer reach
    costs the first load a prefill of that many tokens and a few verifies there (cached).
    tune: where the config leaves the backend or the draft body open and more than one
    configuration can run the bundle, measure each on this machine at the first load (cached) and
    open the fastest, with its best verify width (tuning.py); default on, off where the environment
    sets EDGESPEC_TUNE=0 (the test suite does). retune: probe and measure again instead of reading
    the cache.
    """

    backend: str | None = field(default=None, metadata=_opt(
        "--backend", choices=tuple(BACKENDS),
        help="runtime backend (default: the first installed one that runs the bundle; see `edgespec info`)"))
    device: str | None = field(default=None, metadata=_opt(
        "--device", help="device for the target, e.g. CPU, GPU, NPU, AUTO (default: CPU)"))
    draft_backend: str | None = field(default=None, metadata=_opt(
        "--draft-backend", choices=tuple(BACKENDS), help="run the draft on another backend (default: as the target)"))
    draft_device: str | None = field(default=None, metadata=_opt(
        "--draft-device", help="device for the draft (default: as the target)"))
    use_draft: bool = field(default=True, metadata=_opt(
        "--no-draft", kind="false",
        help="do not load the draft model: plain decoding, or prompt lookup with --drafter ngram"))
    drafter: str = field(default="auto", metadata=_opt(
        "--drafter", choices=DRAFTER_CHOICES,
        help="who proposes drafts: the draft model, ngram (prompt lookup, no model needed), recycle (Token "
             "Recycling, no model), lookup-recycle, both, both-recycle, or none; "
             "auto = both when the bundle has a draft model, else ngram"))
    policy: str | None = field(default=None, metadata=_opt(
        "--draft-policy", choices=POLICY_CHOICES,
        help="draft length per step: fixed; heuristic (+2/-1); confidence (fixed, stops when the draft is "
             "unsure); cost (measures costs and acceptance online, falls back to plain decoding when drafting "
             f"does not pay). Default: {DEFAULT_POLICY}, or fixed when -k is given"))
    k: int | None = field(default=None, metadata=_opt(
        "-k", "--draft-tokens", type=int,
        help=f"draft length per step; adaptive policies range up to twice this (default: {DEFAULT_K})"))
    draft_body: str = field(default="auto", metadata=_opt(
        "--draft-body", choices=DRAFT_BODY_CHOICES,
        help="shared: run the draft model on the target's body, loading only the draft's head (one body's "
             "weights and KV cache); own: load the draft's own body; auto (default): shared for a self-draft "
             "without a layer cut on an int8/int4 target, where the backend can"))
    static: bool = field(default=False, metadata=_opt(
        "--static-shapes", kind="true",
        help="OpenVINO: fixed KV capacity and verify width k+1, as NPUs need (NPU turns it on)"))
    threads: int | None = field(default=None, metadata=_opt(
        "--threads", type=int, help="CPU threads per model (default: backend's choice)"))
    memory_budget: int | str | None = field(default=None, metadata=_opt(
        "--memory-budget", metavar="SIZE",
        help="memory for the whole process, e.g. 1.5GB or 900MiB: sizes the KV cache and draft length, drops "
             "the draft model if it does not fit (see `edgespec plan`)"))
    max_context: int | None = field(default=None, metadata=_opt(
        "--max-context", type=int, metavar="N",
        help="most tokens a conversation holds (default: 4096, or what --memory-budget allows); chat drops its "
             "oldest turns beyond it"))
    prefill_chunk: int = field(default=DEFAULT_PREFILL_CHUNK, metadata=_opt(
        "--prefill-chunk", type=int, metavar="N",
        help=f"prompt tokens per forward (default: {DEFAULT_PREFILL_CHUNK}; a memory budget picks its own): a "
             "long prompt in one forward takes scratch memory that grows with its length times the context"))
    allow_inexact: bool = field(default=False, metadata=_opt(
        "--allow-inexact", kind="true",
        help="draft even where no verify width rounds bit for bit like plain decoding on this machine (the "
             "probe at the first load finds out, cached; `edgespec info BUNDLE` shows it): greedy output may "
             "then differ from plain decoding. Default: such an engine decodes plainly"))
    probe_context: int | None = field(default=None, metadata=_opt(
        "--probe-context", type=int, metavar="N",
        help="keys up to which the exactness probe checks verifies (default: 4096, or the context if shorter); "
             "past them a sequence decodes plainly. A longer reach costs the first load one prefill of N tokens "
             "(cached)"))
    tune: bool = field(default_factory=_tune_default, metadata=_opt(
        "--tune", kind="both",
        help="where --backend or --draft-body is left open and several configurations run the bundle, measure "
             "each here at the first load (cached) and open the fastest exact one; `edgespec info BUNDLE` shows "
             "the figures. Default: on (EDGESPEC_TUNE=0 turns it off)"))
    overlap: bool = field(default=False, metadata=_opt(
        "--overlap", kind="true",
        help="draft the next step while the target verifies (PEARL): the verify runs in a thread of its own; "
             "needs a draft model on its own body (--draft-body own), and pays only where draft and target "
             "compute on separate units (a GPU target, a CPU draft), not on one CPU"))
    retune: bool = field(default=False, metadata=_opt(
        "--retune", kind="true",
        help="measure this machine again (the exactness probe and the tuning) instead of reading the cache"))

    def __post_init__(self) -> None:
        self._check_choices()
        if self.threads is not None:
            # capped once here, so every cache key sees the count that runs
            object.__setattr__(self, "threads", _usable_threads(integer(self.threads, "threads", least=1)))
        if self.max_context is not None:
            integer(self.max_context, "max_context", least=2)
        if self.probe_context is not None:
            integer(self.probe_context, "probe_context", least=64, most=MAX_PROBE_REACH)
        integer(self.prefill_chunk, "prefill_chunk", least=1)
        if self.memory_budget is not None:
            from ..memory.budget import parse_bytes

            # kept in bytes once parsed: "1.5GB" and 1500000000 are the same config
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        for name in _SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def _check_choices(self) -> None:
        """The names: backends from the registry, devices, the drafting, the draft's body."""
        for value in (self.backend, self.draft_backend):
            if value is not None:
                backend_info(value)  # the registry names the known ones
        for name in ("device", "draft_device"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{name} must be a device name such as CPU or GPU, got {value!r}")
        check_drafting(self.drafter, self.policy, self.k)
        one_of(self.draft_body, "draft_body", DRAFT_BODIES)

    @property
    def budget_bytes(self) -> int | None:
        """The memory budget in bytes (None: no budget); the field holds bytes once built."""
        return self.memory_budget

    def replace(self, **overrides) -> EngineConfig:
        """A copy with `overrides`, validated again; an unknown name is a ConfigError."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"unknown engine option{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                              f"known: {', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SWITCHES = ("use_draft", "static", "allow_inexact", "tune", "retune", "overlap")  # True or False, nothing else


def _usable_threads(threads: int) -> int:
    """`threads`, at most the CPUs this process may use: more spinning threads than cores only
    wait on each other (a 64-thread run on 2 cores never finished)."""
    usable = usable_cpu_count()
    if threads > usable:
        logger.warning("threads %d is more than the %d CPUs this process may use; using %d", threads, usable, usable)
        return usable
    return threads


# field name -> its command-line form; the CLI builds its engine flags from this table alone
OPTIONS: dict[str, Option] = {f.name: f.metadata["cli"] for f in dataclasses.fields(EngineConfig)}


def engine_config(config: EngineConfig | None = None, **overrides) -> EngineConfig:
    """`config` (default: EngineConfig()) with keyword overrides, as `edgespec.load` takes them."""
    base = config if config is not None else EngineConfig()
    if not isinstance(base, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig, got {type(base).__name__}")
    return base.replace(**overrides) if overrides else base
