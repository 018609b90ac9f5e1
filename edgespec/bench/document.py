"""Assemble one run's JSON document (schema.py) from the engine, the settings and the runs."""
from __future__ import annotations

from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from pathlib import Path

from .. import __version__
from ..engine.session import chat_format_for
from .machine import library_versions, machine_info, run_label
from .measure import BenchConfig, RunRecord
from .schema import KIND, SCHEMA_VERSION
from .suites import prompt_format
from .summary import summarise

__all__ = ["bundle_summary", "build_document", "exactness_summary"]


def _entry(e, fmt: str | None) -> dict | None:
    if e is None:
        return None
    art = e.formats.get(fmt) if fmt else None
    out = {"format": fmt if art else ", ".join(e.formats), "precision": art.precision if art else None,
           "quantization": art.quantization if art else None, "n_layers": e.n_layers, "vocab_size": e.vocab_size,
           "source": e.source.get("name")}
    if e.vocab_info:
        out["vocab_info"] = e.vocab_info
    if e.layers:
        out["layers"] = e.layers
    return out


def _jsonable(obj):
    """A memory plan (or any dataclass) as plain JSON values."""
    if is_dataclass(obj) and not isinstance(obj, type):
        obj = asdict(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def bundle_summary(engine) -> dict:
    """The manifest in short: what model and draft were measured (no local paths)."""
    from ..runtimes import BACKENDS

    m, opened = engine.bundle.manifest, engine.opened
    fmt = BACKENDS[opened.backend].bundle_format
    dfmt = BACKENDS[opened.draft_backend].bundle_format if opened.draft_backend else None
    return {"name": engine.bundle.path.name, "model_type": m.model_type, "family": m.family,
            "base_model": m.base_model, "chat_format": prompt_format(chat_format_for(m, engine.tokenizer)),
            "target": _entry(m.target, fmt), "draft": _entry(m.draft, dfmt)}


def _prompts_name(spec: str) -> str:
    """A prompt file by its name only: results travel between machines, local paths do not."""
    if spec.endswith(".jsonl") or "/" in spec:
        return Path(spec).name
    return spec


def exactness_summary(opened) -> dict | None:
    """The exactness probe of what an engine opened (engine.opened: which verify widths are
    bit-exact on this machine), when it ran one: {"summary": its one-line description, **its figures}."""
    probe = opened.exactness
    if probe is None:
        return None
    return {"summary": probe.describe(), **_jsonable(probe.to_dict())}


def build_document(engine, runs: list[RunRecord], cfg: BenchConfig, *, prompts_spec: str, configs: list[str],
                   backend: dict, memory: dict, machine: dict | None = None, label: str | None = None,
                   memory_budget: int | None = None, started: datetime | None = None,
                   duration_s: float = 0.0, prompts: list | None = None, peer: dict | None = None,
                   verify_costs: dict | None = None, peers: dict[str, dict] | None = None,
                   roofline: dict | None = None, thermal: dict | None = None) -> dict:
    """The run's JSON document (schema.py). `peer`: what the llama.cpp peer ran (peer.py's
    describe()), when it ran; `peers`: every peer that ran by configuration name (llama-server's
    record its build and flags); `verify_costs`: the target's c(B) curve (costs.py); `roofline`:
    roofline.py's figures; `thermal`: clocks, temperatures and verdicts per configuration
    (thermal.summarise_heat)."""
    machine = machine or machine_info()
    ran = {(r.cls, r.prompt) for r in runs}
    skipped = [f"{p.cls}/{p.id}" for p in prompts or [] if (p.cls, p.id) not in ran]
    opened = engine.opened  # what the engine runs (engine/opened.py)
    if opened.memory_plan is not None:
        memory = {**memory, "plan": _jsonable(opened.memory_plan)}
    summary = summarise(runs, configs, greedy=cfg.sampling.greedy)
    started = started or datetime.now(timezone.utc)
    tuning = opened.tuning
    extra = {"exactness": exactness_summary(opened), "verify_costs": verify_costs, "roofline": roofline,
             "tuning": None if tuning is None else _jsonable(tuning.to_dict()), "thermal": thermal}
    if peer is not None:
        extra["peer"] = peer
    if peers:
        extra["peers"] = peers
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "label": label or run_label(machine, opened.backend),
        "created": started.isoformat(timespec="seconds"),
        "duration_s": round(duration_s, 2),
        "machine": machine,
        "libraries": {**library_versions(), "edgespec": __version__},
        "backend": backend,
        "bundle": bundle_summary(engine),
        "config": {"prompts": _prompts_name(prompts_spec), **asdict(cfg), "k_sweep": list(cfg.k_sweep),
                   "sampling": "greedy" if cfg.sampling.greedy else asdict(cfg.sampling),
                   "drafter": opened.drafter, "policy": opened.policy, "k": opened.k,
                   "memory_budget": memory_budget, "draft_body": opened.draft_body,
                   # every engine option as given (edgespec.engine.config.EngineConfig), whole
                   "engine": asdict(engine.config)},
        "memory": memory,
        **extra,
        "configs": configs,
        "skipped": skipped,  # prompts that do not fit the context limit
        **summary,
        "identical": not summary["mismatches"],
    }
