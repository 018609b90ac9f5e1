"""How an Engine is put together from the user's choices: the drafter, policy and draft length,
where the draft model's body comes from, and which backend and shape mode each model runs on.
Pure functions of the manifest and the choices, so each rule is testable without loading a model.
"""
from __future__ import annotations

from ..decoding import DEFAULT_K, DEFAULT_POLICY, DRAFTERS, make_policy
from ..errors import ConfigError
from ..runtimes import BACKENDS, installed_backends

__all__ = ["DRAFT_BODIES", "QUANTIZED", "STATIC_DRAFT_WIDTH", "backend_for_device", "check_drafting",
           "resolve_drafting", "shared_body_blocker"]


def resolve_drafting(drafter: str, policy: str | None, k: int | None, *, has_draft: bool,
                     use_draft: bool) -> tuple[str | None, str, int]:
    """(drafter name or None for plain decoding, policy name, k) from the user's choices.

    drafter "auto" drafts with prompt lookup and the draft model when the bundle has one, with
    prompt lookup alone otherwise, and not at all under use_draft=False (--no-draft). A k given
    without a policy asks for exactly that draft length, so it selects the fixed policy. The
    names and k are EngineConfig's, checked once when it was built (check_drafting).
    """
    policy = policy or ("fixed" if k is not None else DEFAULT_POLICY)
    k = DEFAULT_K if k is None else k
    if drafter == "auto":
        drafter = "none" if not use_draft else "both" if has_draft else "ngram"
    elif drafter != "none" and DRAFTERS[drafter].needs_model and not (has_draft and use_draft):
        why = "--no-draft was given" if has_draft else "the bundle has no draft model"
        raise ConfigError(f"drafter {drafter!r} needs the draft model, but {why}; use drafter 'ngram'")
    return (None if drafter == "none" or k == 0 else drafter), policy, k


def check_drafting(drafter: str, policy: str | None, k: int | None) -> None:
    """Check the drafter's and the policy's names and k (an unknown name fails even when nothing
    will be drafted); EngineConfig calls it once, and nothing downstream checks them again."""
    choices = ("auto", "none", *DRAFTERS)
    if drafter not in choices:
        raise ConfigError(f"unknown drafter {drafter!r}; choose one of: {', '.join(choices)}")
    make_policy(policy or ("fixed" if k is not None else DEFAULT_POLICY), DEFAULT_K if k is None else k)


# where the draft model's body comes from: the target's (one body, the draft adds only its head),
# its own artifact, or auto: the target's where that is the same computation (see shared_body_blocker)
DRAFT_BODIES = ("auto", "shared", "own")
QUANTIZED = ("int8", "int4")


def shared_body_blocker(manifest, fmt: str, backend: str, *, draft_backend: str | None, device: str | None,
                        draft_device: str | None, static: bool, auto: bool) -> str | None:
    """Why the draft cannot run on the target's body here (None: it can). With `auto`, also an
    unquantized (fp32/fp16) target: its body costs several times a quantized draft's, while an
    int8 or int4 body costs about what the draft's own does (on Gemma 3 270M with OpenVINO a one-
    token int8 and int4 forward cost alike) and drafts from the target's own hidden states."""
    d, t = manifest.draft, manifest.target
    if BACKENDS[backend].shared_body is None:
        return f"the {backend} backend cannot run a draft on the target's body"
    if draft_backend not in (None, backend) or (draft_device or device or "CPU").upper() != (device or "CPU").upper():
        return "the draft runs on another backend or device"
    if static:
        return "static shapes run each model at its own fixed width"
    if d is None or fmt not in d.formats:
        return f"the bundle's draft has no {fmt} artifact"
    if not manifest.self_draft:
        return "the draft is not the target's own model (a self-draft without a layer cut)"
    if auto and t.formats[fmt].precision not in QUANTIZED:
        return (f"the target's body is {t.formats[fmt].precision}, dearer than the draft's own "
                f"{d.formats[fmt].precision} body (--draft-body shared drafts on it all the same)")
    return None


# static shapes: the target verifies k drafts plus its own token in one fixed-width forward; the
# draft mostly feeds one token, two when it catches up after a fully accepted draft
STATIC_DRAFT_WIDTH = 2


def backend_for_device(device: str | None, formats, installed: list[str] | None = None) -> str | None:
    """A device besides the CPU (GPU, NPU, AUTO) picks the first installed backend that drives such
    devices (BackendInfo.accelerators) and runs a format the bundle has, when no backend is named
    (`installed`: the backends installed here, default: looked up)."""
    if device is None or device.upper() == "CPU":
        return None
    return next((n for n in (installed_backends() if installed is None else installed)
                 if BACKENDS[n].accelerators and BACKENDS[n].bundle_format in formats), None)
