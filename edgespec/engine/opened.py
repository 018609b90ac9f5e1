"""What an Engine actually opened, as one frozen value: `engine.opened`.

The plan (assembly.py) says what to open; opening can still deviate from it for two reasons
decided only once the models are open: the draft model does not fit the memory budget, or the
exactness probe finds no exact verify width (without allow_inexact). Each deviation is recorded
here with its reason, so the plan stays what was asked for and this stays what runs.
`Engine.describe()`, `edgespec info`, the server and the bench document read this value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..decoding.limits import DecoderLimits
from ..runtimes import BACKENDS
from .assembly import EnginePlan

__all__ = ["Deviation", "Opened", "DRAFT_DOES_NOT_FIT", "DRAFTING_REFUSED"]

# why the executor dropped the draft model the plan asked for
DRAFT_DOES_NOT_FIT = "the draft model does not fit the memory budget"
DRAFTING_REFUSED = "no verify width is exact on this machine: decoding plainly (--allow-inexact drafts anyway)"


@dataclass(frozen=True)
class Deviation:
    """One way what was opened differs from the plan, and why."""

    what: str  # e.g. "drafter": the plan's drafter is not used
    planned: Any
    opened: Any
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "planned": self.planned, "opened": self.opened, "reason": self.reason}


@dataclass(frozen=True)
class Opened:
    """What runs: the backends, the drafter, the draft's body, the decoder's limits, the exactness
    verdict and the memory plan, with every deviation from `plan` and its reason."""

    plan: EnginePlan
    draft_backend: str | None  # the backend the draft model runs on (None: no draft model)
    drafter: str | None  # the drafter decoding uses (None: plain decoding)
    limits: DecoderLimits
    exactness: Any = None  # runtimes.exactness.Exactness: which verify widths round like plain decoding here
    memory_plan: Any = None  # memory.planner.Plan under a budget, else None
    deviations: tuple[Deviation, ...] = ()

    @property
    def backend(self) -> str:
        return self.plan.backend

    @property
    def policy(self) -> str:
        return self.plan.policy

    @property
    def k(self) -> int:
        return self.plan.k

    @property
    def draft_body(self) -> str | None:
        """"shared", "own", None: no draft model open (the plan's, unless the draft was dropped)."""
        return self.plan.draft_body if self.draft_backend is not None else None

    @property
    def shared_body(self) -> bool:
        return self.draft_body == "shared"

    @property
    def context_limit(self) -> int | None:
        """Most tokens a sequence may hold (prompt + reply); None: no fixed limit."""
        return self.limits.context_limit

    @property
    def tuning(self):
        """What the tuner measured (tuning.Tuning), where it ran."""
        return self.plan.tuning

    @property
    def inexact_refusal(self) -> str | None:
        """Why the engine decodes plainly though drafting was planned, where the reason is that no
        verify width rounds like plain decoding here (None: it drafts, or was asked not to)."""
        return next((d.reason for d in self.deviations if d.reason == DRAFTING_REFUSED), None)

    def speculation(self) -> dict[str, Any]:
        """{"speculative": drafting runs, "reason": why not (None where it runs)}: what `edgespec
        info`, chat's status line and the server's /health and usage blocks say."""
        if self.drafter is not None:
            return {"speculative": True, "reason": None}
        reason = next((d.reason for d in self.deviations if d.what == "drafter"), None)
        return {"speculative": False, "reason": reason or "plain decoding was asked for (no drafter)"}

    def to_dict(self, manifest=None) -> dict[str, Any]:
        """Plain values for reports; with the bundle's `manifest`, each model's format, precision
        and quantization."""
        def model(role: str, backend: str | None) -> dict | None:
            if backend is None:
                return None
            fmt = BACKENDS[backend].bundle_format
            entry = getattr(manifest, role, None) if manifest is not None else None
            art = entry.formats.get(fmt) if entry is not None else None
            return {"backend": backend, "format": fmt, "precision": art.precision if art else None,
                    "quantization": art.quantization if art else None}

        probe = self.exactness
        return {"target": model("target", self.backend), "draft": model("draft", self.draft_backend),
                "draft_body": self.draft_body, "drafter": self.drafter, "policy": self.policy, "k": self.k,
                "limits": self.limits.to_dict(),
                "exactness": None if probe is None else {"summary": probe.describe(), **probe.to_dict()},
                "speculation": self.speculation(), "deviations": [d.to_dict() for d in self.deviations],
                "cores": None if self.plan.cores is None else self.plan.cores.to_dict()}
