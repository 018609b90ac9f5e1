"""The bench JSON document: built, written, read and validated.

Version 2 (`"kind": "edgespec-bench"`), one run on one device:

    schema_version, kind, label, created (UTC ISO 8601), duration_s
    machine     cpu, arch, isa (e.g. ["AVX", "AVX2", "FMA"] or ["NEON", "DOTPROD", "I8MM"]), cores_physical,
                cores_logical, cores_usable, core_kinds [{kind, cpus}] (fastest first), ram_bytes, os, python,
                load_avg_1min
    libraries   {distribution: version} (edgespec, onnxruntime, numpy, tokenizers, ...)
    backend     name, device, draft_backend, draft_device, threads, cores {cpus, threads, pinned, reason, layout}
                (the cores run on: the fast ones of a big.LITTLE CPU, engine/cores.py)
    bundle      name, model_type, family, base_model, chat_format, target {format, precision, n_layers,
                vocab_size, source}, draft (same, plus vocab_info) or null
    config      prompts, repeat, max_tokens, warmup, stop_at_eos, sampling ("greedy", or {temperature, top_p,
                top_k, min_p, seed}), drafter, policy, k, k_sweep,
                memory_budget (bytes, or null), draft_body ("shared": the draft on the target's body, "own", or null)
    memory      rss_before_load, rss_after_load, engine {target|draft: {weights, kv, ...}} (bytes),
                plan (the engine's memory plan under --memory-budget, when it has one)
    exactness   the engine's exactness probe, or null: summary (one line), exact widths, max_width,
                worst_diff, probe_ms, cached, reach (the most keys a probed verify attended to)
    verify_costs  the target's c(B), or null: one_token_ms, ms {B: ms}, c {B: B-token forward over a
                one-token forward}, prefix, repeats (bench/costs.py)
    roofline    per forward kind, or null: bandwidth_gb_s {threads: GB/s read}, rows [{role (plain, verify,
                draft), width, ms, weights_bytes, ops, gb_s, of_bandwidth}], draft_of_plain (bench/roofline.py)
    tuning      how the engine's configuration was chosen here (edgespec/engine/tuning.py), or null: choice
                {backend, draft_body, verify_width}, tune_ms, candidates [{backend, draft_body, free,
                one_token_ms, draft_ms, verify_ms {B: ms}, exact_width, measure_ms, cached, score}]
    peer        when llama.cpp was measured: name, library, version, gguf (file name), origin, threads, n_ctx
    thermal     the CPU around every measured run (bench/thermal.py): source {cpus, clocks, zones, vcgencmd},
                cooldown_s, configs {config: {runs, verdict ("steady", "throttled", "unknown"),
                runs_below_top_clock, firmware (Raspberry Pi throttling bits seen), clock_mhz, temp_c, temp_rise_c
                ({median, min, max}, clocks right after each run, i.e. under load), clock_share_min}}, warnings
                (configurations compared at different clocks, throttling); per prompt, each configuration's
                `heat` [{clock_mhz, clock_share, temp_c, temp_rise_c, throttled}] per repeat
    peers       every peer that ran, by configuration name: the same record; llama-server's adds build (source,
                cmake flags, compiler, cpu), flags (its command line, file names only), spec_type, draft_gguf
    configs     configuration names: "plain", "speculative", then "k=N" of a sweep, then "llama.cpp"
                (the peer: llama-cpp-python's own plain decode of the GGUF, same prompt token ids), then
                "llama-server" and "llama-server+TYPE" (llama.cpp's server, plain and speculative, timed by its
                own timings; bench/server_peer.py)
    skipped     ["class/id"]: prompts that did not fit the engine's context limit (optional)
    classes     {class: {config: metrics}}; overall: {config: metrics} over every prompt
    prompts     [{class, id, prompt_tokens, new_tokens, configs: {config: per-repeat figures}}]
    mismatches  [{class, prompt, config, repeat, first_difference}]: greedy speculative != plain
    identical   true when there are no mismatches

metrics: prompts, runs, new_tokens, prompt_tokens, tok_s (decode: every run's tokens after its first step
over every run's time after it),
tok_s_per_repeat, tok_s_spread {min, max, relative} (over the repeats), e2e_tok_s, ttft_ms, prefill_tok_s,
acceptance (null for plain),
mean_accepted_length (tokens per target forward), mean_draft_length, draft_ms_per_token,
verify_ms_per_token, draft_share, peak_rss_bytes, by_draft_length [{drafter, k, steps, accepted,
acceptance}], identical (null for sampled runs, which are not compared token for token); and for
every configuration but plain and the peer: speedup (measured decode tok/s over plain's),
e2e_speedup. With a peer, every edgespec configuration has x_llamacpp (the ratio of totals: its
decode tok/s over the peer's on the same prompts and repeats) and x_llamacpp_paired (the median
of paired per-prompt tok/s ratios), and the peer agree_tokens, agree_tokens_min, agree_prompts
(greedy tokens agreeing with edgespec plain before the first difference); per prompt, `prompts`
rows carry agree_tokens and each configuration's x_llamacpp_paired. Over llama-server peers the same
ratios are x_llama_server, x_llama_server_paired, x_llama_server_ngram_simple, ... (summary.peer_key).

Version 2 changed tok_s (the first step's tokens are no longer counted without its time),
x_llamacpp (a ratio of totals; version 1's median of paired ratios is now x_llamacpp_paired) and
identical (null when sampled).

`compare` may write `"kind": "edgespec-bench-compare"` with `runs`: a list of run documents of this version.
New fields may be added within a version; removing or changing one bumps the version.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigError
from .measure import PLAIN

__all__ = ["SCHEMA_VERSION", "KIND", "COMPARE_KIND", "validate", "save", "save_compare", "load_runs",
           "compare_document", "check_json_path"]

SCHEMA_VERSION = 2
KIND = "edgespec-bench"
COMPARE_KIND = "edgespec-bench-compare"


class _Part(BaseModel):
    """The fields a reader relies on, typed strictly (true is no count, "4" no number, NaN no
    figure); any other field is allowed, as new fields may be added within a version."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class _Machine(_Part):
    cpu: str
    arch: str
    cores_logical: int
    ram_bytes: int
    os: str
    python: str


class _Config(_Part):
    repeat: int
    max_tokens: int
    prompts: str


class _Run(_Part):
    schema_version: int
    kind: str
    label: str
    created: str
    duration_s: float
    machine: _Machine
    libraries: dict
    backend: dict
    bundle: dict
    config: _Config
    memory: dict
    configs: list
    classes: dict
    overall: dict
    prompts: list
    mismatches: list
    identical: bool


class _Metrics(_Part):
    """One configuration's figures over a class of prompts (or over all of them)."""

    prompts: int
    runs: int
    new_tokens: int
    tok_s: float
    e2e_tok_s: float
    ttft_ms: float
    prefill_tok_s: float
    mean_accepted_length: float
    draft_share: float
    peak_rss_bytes: int
    by_draft_length: list
    identical: bool | None
    acceptance: float | None = Field(default=None, ge=0, le=1)  # null for plain and the peers


class _Compared(_Metrics):
    """A configuration measured against plain."""

    speedup: float | None = None


def _one_line(error: dict, where: str) -> str:
    """A pydantic error as one line naming the field and the part of the document it is in."""
    if not error["loc"]:
        return f"{where}: expected an object"
    *parts, key = error["loc"]
    at = ": ".join([where, *map(str, parts)])
    kind = error["type"]
    if kind == "missing":
        return f"{at}: missing field '{key}'"
    if kind == "finite_number":
        return f"{at}: field '{key}' is not a finite number"
    if kind.endswith("_type"):
        return f"{at}: field '{key}' has the wrong type ({type(error['input']).__name__})"
    return f"{at}: field '{key}' {error['msg'].replace('Input should be', 'must be')}"  # a bound it missed


def _parse(model: type[_Part], value: object, where: str) -> None:
    try:
        model.model_validate(value)
    except ValidationError as e:
        raise ConfigError(_one_line(e.errors()[0], where)) from None


def _check_identity(doc: object, where: str) -> None:
    """A foreign file or another version is named as such before any of its fields is read."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: not a JSON object")
    if doc.get("kind") != KIND:
        raise ConfigError(f"{where}: not an edgespec bench result (kind {doc.get('kind')!r})")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ConfigError(f"{where}: schema version {doc.get('schema_version')!r} is not supported "
                          f"(this edgespec reads version {SCHEMA_VERSION})")


def _check_classes(doc: dict, configs: list, where: str) -> None:
    """Every class (and the overall block) has plain's figures, and figures only of listed configurations."""
    if not doc["classes"]:
        raise ConfigError(f"{where}: no prompt classes")
    for cls, block in [*doc["classes"].items(), ("overall", doc["overall"])]:
        if not isinstance(block, dict) or PLAIN not in block:
            raise ConfigError(f"{where}: class '{cls}' has no plain results")
        for c, m in block.items():
            if c not in configs:
                raise ConfigError(f"{where}: class '{cls}' has results for an unlisted configuration '{c}'")
            _parse(_Metrics if c == PLAIN else _Compared, m, f"{where}: {cls}/{c}")


def validate(doc: object, where: str = "bench result") -> dict:
    """`doc` if it is a valid version-2 run document, else a one-line ConfigError saying what is wrong."""
    _check_identity(doc, where)
    _parse(_Run, doc, where)
    configs = doc["configs"]
    if not configs or configs[0] != PLAIN or not all(isinstance(c, str) for c in configs):
        raise ConfigError(f"{where}: 'configs' must list 'plain' first")
    _check_classes(doc, configs, where)
    _check_peer_records(doc, configs, where)
    if doc["identical"] != (not doc["mismatches"]):
        raise ConfigError(f"{where}: 'identical' disagrees with 'mismatches'")
    return doc


def _check_peer_records(doc: dict, configs: list[str], where: str) -> None:
    """Every peer's results come with a record of what was measured (its library, build, flags)."""
    if "llama.cpp" in configs and not isinstance(doc.get("peer"), dict):
        raise ConfigError(f"{where}: 'llama.cpp' results without a 'peer' record (what was measured)")
    unrecorded = [c for c in configs if c.startswith("llama-server") and c not in (doc.get("peers") or {})]
    if unrecorded:
        raise ConfigError(f"{where}: {', '.join(unrecorded)} results without a 'peers' record (what was measured)")


def save(doc: dict, path: str | Path) -> Path:
    """Validate and write one run's document."""
    return _write(validate(doc), path)


def save_compare(doc: dict, path: str | Path) -> Path:
    """Validate and write a compare document (runs merged by `edgespec bench compare`)."""
    if doc.get("kind") != COMPARE_KIND or not doc.get("runs"):
        raise ConfigError("not a compare document")
    for i, r in enumerate(doc["runs"]):
        validate(r, f"run {i + 1}")
    return _write(doc, path)


def check_json_path(path: str | Path, flag: str = "--json") -> Path:
    """`path` if a result can be written there, else a one-line ConfigError: called before
    measuring, so minutes of results are not lost to a typo. The folder must exist; writing is
    tried (a read-only file system or a folder of another user fails here, root or not)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{flag} needs a file name, but {p} is a folder")
    if p.exists() and not p.is_file():
        raise ConfigError(f"{flag}: {p} exists and is not a regular file")
    folder = p.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"{flag}: cannot write {p.name} into {folder}: it {what}")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{p.name}.", suffix=".check"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag}: cannot write into {folder}: {e.strerror or e}") from None
    return p


def _write(doc: dict, path: str | Path) -> Path:
    """Write JSON atomically (a temporary file in the same folder, then os.replace): a crash or a
    full disk leaves the old file or the new one, never half of one."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"--json needs a file name, but {path} is a folder")
    text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide results from other users of a shared box
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def load_runs(path: str | Path) -> list[dict]:
    """The validated run documents in a result file (one run, or a compare file's runs)."""
    path = Path(path).expanduser()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"bench result not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read bench result {path}: {e}") from None
    if isinstance(doc, dict) and doc.get("kind") == COMPARE_KIND:
        runs = doc.get("runs")
        if not isinstance(runs, list) or not runs:
            raise ConfigError(f"{path.name}: a compare file with no runs")
        return [validate(r, f"{path.name} run {i + 1}") for i, r in enumerate(runs)]
    return [validate(doc, path.name)]


def compare_document(runs: list[dict]) -> dict:
    return {"schema_version": SCHEMA_VERSION, "kind": COMPARE_KIND, "runs": runs}
