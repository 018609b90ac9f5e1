"""The engine's fastest exact configuration on this machine, chosen by measurement.

Which backend and draft body decode fastest is a property of the machine's kernels, not of the
bundle: on one machine llama.cpp may have the cheapest one-token forward and the dearest wide
one, onnxruntime's int4 the opposite (BENCHMARKS.md). So, where a load leaves a choice open (no
--backend, --draft-body auto) and more than one configuration can run the bundle, each candidate is
opened as the engine would open it (its exact mode settled by the exactness probe), and a few
forwards measure what a speculative step costs on it:

- `one_token_ms`: a plain step, one token through the target;
- `draft_ms`: one drafted token (the draft's own body, or the target's body and the draft's head);
- `verify_ms[B]`: the target's verify of B tokens after B-1 drafts (on a shared body the drafts'
  rows are computed already, so it runs the body on one row and the head on B),

for verify widths B within the probe's exact widths only. A step drafting k tokens then costs
`k * draft_ms + verify_ms[k+1]` and commits `(1 - a^(k+1)) / (1 - a)` tokens on average when each
draft is accepted with probability a (decoding/policy.py). The acceptance depends on the text
more than on the configuration, so rather than a short measured run on one prompt, candidates are
ranked by their best expected tokens/s averaged over ACCEPTANCES: the cost policy's prior 0.5 to
the 0.9 a self-draft reaches on input-grounded prompts. The width limit is the best verify width
at the highest acceptance: wider than that a verify does not pay even when nearly every draft is
accepted (a draft-length policy still adapts below it).

Each candidate's figures are cached per machine, backend build, model files and plan (next to the
exactness verdicts, in edgespec's cache), so only the first load pays; `retune` measures again.
The choice itself is a pure function of the figures (`choose`), tested on fake ones.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from ..errors import ConfigError, EdgespecError
from ..progress import task
from ..runtimes import BACKENDS, backend_version
from .assembly import EnginePlan, plan_engine
from .config import EngineConfig
from .cores import CoreChoice
from .measured import ACCEPTANCES, DRAFT_LENGTHS, Measurement, Tuned, Tuning
from .step_costs import WIDTHS, verify_costs

__all__ = ["ACCEPTANCES", "DRAFT_LENGTHS", "Measurement", "Tuning", "candidate_plans", "candidates", "choose",
           "contenders",
           "measure_engine", "merged", "skip_reason", "tune", "verify_costs", "WIDTHS"]

logger = logging.getLogger(__name__)

TUNE_VERSION = 2  # bump when the measurement changes: cached figures are then measured again
# drafters whose every token costs a forward; each other one also drafts for free (prompt lookup,
# Token Recycling), and its tails may run wide verifies
COSTED_ONLY = ("model", "head")
MARGIN = 0.05  # a candidate listed later must be this much faster to be chosen
CLOSE = 0.15  # the two best this close: both are measured once more, in the other order
TUNE_PREFIX, TUNE_REPEATS = 32, 3  # the tuner's: a few forwards per width, seconds per candidate


# ---------------------------------------------------------------- measuring one configuration


def measure_engine(engine, prefix: int = TUNE_PREFIX, repeats: int = TUNE_REPEATS) -> Measurement | None:
    """The step costs of an open engine (its target, its draft model where it drafts with one)
    at the verify widths its exactness probe found exact; None where they cannot be measured."""
    t0 = time.perf_counter()
    opened = engine.opened
    exact = opened.exactness.exact_width if opened.exactness is not None and opened.drafter is not None else 1
    top = min(exact, engine.target.capabilities.max_batch_tokens or exact)
    widths = [k + 1 for k in DRAFT_LENGTHS if k + 1 <= top]
    draft = engine.draft if opened.draft_body is not None else None
    # the fastest of the repeats: a busy neighbour only ever adds time
    costs = verify_costs(engine.target, widths, prefix, repeats, draft=draft, shared_body=opened.shared_body,
                         stat=min)
    if costs is None:
        return None
    ms = {int(b): v for b, v in costs["ms"].items()}
    free = opened.drafter not in (None, *COSTED_ONLY)
    return Measurement(opened.backend, opened.draft_body, free, ms[1], costs.get("draft_ms", 0.0),
                       {b: v for b, v in ms.items() if b > 1}, exact, round((time.perf_counter() - t0) * 1e3, 1))


# ---------------------------------------------------------------- the choice (pure)


def choose(measured: Sequence[Measurement]) -> Tuned:
    """The first listed candidate (the registry's preference) whose expected tokens/s is within
    MARGIN of the best, with its width limit (Measurement.width): a difference a busy neighbour
    can make does not switch backends."""
    if not measured:
        raise ValueError("nothing measured to choose from")
    top = max(m.score() for m in measured)
    best = next(m for m in measured if m.score() * (1 + MARGIN) >= top)
    return Tuned(best.backend, best.draft_body, best.width())


def contenders(measured: Sequence[Measurement]) -> list[int]:
    """Indices of the two best candidates where they are within CLOSE of each other (a second
    measurement then decides), else []."""
    if len(measured) < 2:
        return []
    a, b = sorted(range(len(measured)), key=lambda i: -measured[i].score())[:2]
    return sorted((a, b)) if measured[b].score() * (1 + CLOSE) >= measured[a].score() else []


def merged(a: Measurement, b: Measurement) -> Measurement:
    """Two measurements of one configuration as one: the fastest figure of each."""
    widths = set(a.verify_ms) & set(b.verify_ms)
    return replace(a, one_token_ms=min(a.one_token_ms, b.one_token_ms), draft_ms=min(a.draft_ms, b.draft_ms),
                   verify_ms={w: min(a.verify_ms[w], b.verify_ms[w]) for w in sorted(widths)},
                   measure_ms=a.measure_ms + b.measure_ms)


# ---------------------------------------------------------------- candidates, cache, orchestration


def skip_reason(config: EngineConfig) -> str | None:
    """Why a load under `config` is not tuned (None: it may be)."""
    if not config.tune:
        return "tuning is off (tune=False)"
    if config.static:
        return "static shapes have one verify width"
    if config.memory_budget is not None:
        return "a memory budget plans the runtimes it opens"
    if (config.device or "CPU").upper() != "CPU":
        return "the tuner measures CPU configurations"
    return None


def candidates(manifest, config: EngineConfig, installed: list[str]) -> list[tuple[str, str | None]]:
    """(backend, draft body) pairs that can open the bundle under `config`, what it fixes kept:
    an explicit backend or draft body is the only one tried. Draft body None: no draft model.
    Left to choose, a backend's draft runs on the target's body where it can: a body of its own
    holds the model twice (the draft's share of memory is meant to stay small), so "own" is a
    candidate only where "shared" cannot open (llama.cpp)."""
    return list(candidate_plans(manifest, config, installed))


def candidate_plans(manifest, config: EngineConfig, installed: list[str],
                    cores: CoreChoice | None = None) -> dict[tuple[str, str | None], EnginePlan]:
    """candidates(), each with the plan that opens it (untuned): planned once per candidate."""
    backends = [config.backend] if config.backend else [
        n for n in installed if BACKENDS[n].bundle_format in manifest.target.formats]
    bodies = [config.draft_body] if config.draft_body != "auto" else ["shared", "own"]
    out: dict[tuple[str, str | None], EnginePlan] = {}
    for backend in backends:
        for body in bodies:
            try:
                plan = plan_engine(manifest, config.replace(backend=backend, draft_body=body, tune=False), installed,
                                   cores=cores)
            except ConfigError:
                continue  # this backend or body cannot open the bundle under the config
            out.setdefault((backend, plan.draft_body), plan)
            if config.draft_body == "auto":
                break
    return out


def _cache_path(bundle, plan) -> Path:
    from ..models.catalog import cache_dir
    from ..runtimes.exactness import machine_fingerprint

    files = [bundle.file(p.file) for p in (plan.target, plan.draft) if p is not None]
    key = {"tune": TUNE_VERSION, "machine": machine_fingerprint(),
           "versions": sorted({backend_version(p.backend) for p in (plan.target, plan.draft) if p is not None}),
           "files": [f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files],
           "plan": plan.describe()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / "tuning" / f"{digest}.json"


def _read(path: Path) -> Measurement | None:
    """The cached record, or None: not measured here yet, or an entry that fails validation (an
    edited or damaged one is measured again, with a log line, never trusted)."""
    from ..models.catalog import read_cache_entry

    data = read_cache_entry(path, "tuning record")
    if data is None:
        return None
    try:
        return Measurement.from_dict({**data, "cached": True})
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("discarding the cached tuning record %s (%s); measuring again", path.name, e)
        return None


def _write(path: Path, m: Measurement) -> None:
    from ..models.catalog import write_cache_entry

    write_cache_entry(path, m.to_dict(), "tuning record")


def _measured(plans: list, measure: Callable[[EnginePlan], Measurement | None], progress) -> list:
    """(plan, cache path, figures) of each candidate that opens: its cached figures, else measured
    now (`progress` counts those); the closest contenders, both measured now, once more."""
    found = []
    for plan, path, m in plans:
        if m is None:
            m = measure(plan)
            progress.update()
        if m is not None:
            found.append((plan, path, m))
    close = contenders([m for *_, m in found])
    for i in reversed(close) if all(not found[i][2].cached for i in close) else ():
        # measured minutes apart, the two best may have met different neighbours: once more, in
        # the other order, keeping each one's fastest figures
        again = measure(found[i][0])
        if again is not None:
            found[i] = (*found[i][:2], merged(found[i][2], again))
    return found


def tune(bundle, config: EngineConfig, installed: list[str], open_engine: Callable[[EnginePlan], object],
         cores: CoreChoice | None = None) -> Tuning | None:
    """Measure each candidate configuration of `bundle` under `config` (or read its figures from
    the cache) and choose; None where there is nothing to choose (one candidate) or the load is
    not tuned (skip_reason). `open_engine(plan)` opens an engine on the bundle executing `plan`
    (engine.resolve passes Engine); each is closed before the next opens."""
    why = skip_reason(config)
    if why is not None:
        logger.debug("not tuning: %s", why)
        return None
    cands = candidate_plans(bundle.manifest, config, installed, cores)  # measured on the cores the engine runs on
    if len(cands) < 2:
        return None
    plans = []
    for plan in cands.values():
        path = _cache_path(bundle, plan)
        plans.append((plan, path, None if config.retune else _read(path)))
    missing = sum(m is None for *_, m in plans)
    spent = 0.0

    def measure(plan: EnginePlan, progress) -> Measurement | None:
        nonlocal spent
        t0 = time.perf_counter()
        progress.set_postfix_str(f"{plan.backend}, draft body {plan.draft_body}")
        try:
            with open_engine(plan) as engine:
                return measure_engine(engine)
        except EdgespecError as e:  # a candidate that fails to open is no candidate
            logger.warning("tuning: %s (draft body %s) cannot open: %s", plan.backend, plan.draft_body, e)
            return None
        finally:
            spent += time.perf_counter() - t0  # opening (the exactness probe, first time) and measuring

    # each candidate opened (probed the first time) and timed: minutes, once, then cached
    with task("tuning: timing this bundle's configurations on this machine (once, then cached; --no-tune "
              "skips it)", total=missing, unit="configuration", announce=bool(missing)) as progress:
        found = _measured(plans, lambda plan: measure(plan, progress), progress)
    if not found:
        return None
    for _, path, m in found:
        if not m.cached:
            _write(path, m)
            logger.info("tuning: %s: plain %.1f ms, draft %.1f ms, %.1f tok/s expected", m.name, m.one_token_ms,
                        m.draft_ms, m.score())
    measured = [m for *_, m in found]
    tuning = Tuning(choose(measured), tuple(measured), round(spent * 1e3, 1))
    logger.info("tuning chose %s (%s)", tuning.choice, "cached" if not tuning.tune_ms else f"{tuning.tune_ms:.0f} ms")
    return tuning
