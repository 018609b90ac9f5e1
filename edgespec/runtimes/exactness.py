"""Is a verify forward bit-identical to one-token forwards on this machine? Measured, not assumed.

Speculative greedy output equals plain greedy output only if a W-token forward (a verify of W-1
drafts) gives every row the same bits as W one-token forwards (plain decoding). That is a
property of the kernels, and kernels differ with the CPU's ISA: on an AVX-512 Xeon OpenVINO's
padded mode is row-exact at every width, on an AVX2-only CPU its int8/int4 matmuls are not at
any width, and llama.cpp's quantized matmuls switch kernels at 8 rows or more. So the engine
probes the runtime it opened, on the real model, and verifies only at widths the probe found
exact.

The probe: from a fixed prefix, W+1 one-token forwards give reference rows; then, for each width
w in 2..W, one w-token forward from the same prefix must give the same bits in every row, and a
one-token forward after it the same bits as the reference row that follows (so the K/V rows the
wide forward wrote are exact too). Four prefixes: two so that block boundaries of padded keys
fall inside some of the widths, two whose widths cross 64 and 128 keys, where a matmul over the
key axis may split it among threads differently (onnxruntime's SGEMM summed a 256-deep score
product in one pass or in two halves as the key count went past 128). The verdict is cached per
machine, backend version, model file and runtime options (a JSON file in edgespec's cache), so
only the first load pays.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .base import Runtime

__all__ = ["Exactness", "PROBE_STARTS", "PROBE_VERSION", "machine_fingerprint", "probe", "probe_cached",
           "remember_mode", "remembered_mode"]

logger = logging.getLogger(__name__)

PROBE_VERSION = 3  # bump when the procedure changes: old verdicts are then probed again
# prefix lengths: keys padded to blocks of 16 cross a bound inside some widths (5, 14); and widths
# from 60 and 124 cross 64 and 128 keys, where kernels change how they split the key axis
PROBE_STARTS = (5, 14, 60, 124)
_SEED = 20_251_124


@dataclass(frozen=True)
class Exactness:
    """What the probe found for one runtime on this machine."""

    max_width: int  # widths 2..max_width were probed
    exact: tuple[int, ...]  # the probed widths whose every row matched one-token forwards bit for bit
    worst_diff: float  # the largest |logit difference| seen at any width (0.0: all exact)
    probe_ms: float  # what the probe cost when it ran (a cached verdict keeps the first run's figure)
    cached: bool = False  # read from the cache, not measured in this process
    # a tree forward's path rows matched one-token forwards (None: the runtime verifies chains only)
    trees: bool | None = None

    @property
    def exact_width(self) -> int:
        """The widest verify that is exact together with every narrower one (1: none is)."""
        width = 1
        while width + 1 in self.exact:
            width += 1
        return width

    @property
    def fully_exact(self) -> bool:
        return self.exact_width >= self.max_width

    def describe(self) -> str:
        """One line for `edgespec info` and bench reports."""
        where = "on this machine"
        if self.exact_width >= 2:
            tail = "" if self.fully_exact else f" (not {self.exact_width + 1}+: up to {self.worst_diff:.2g} off)"
            trees = {None: "", True: "; tree verify exact", False: "; tree verify NOT exact (chains only)"}[self.trees]
            return f"exact verify widths {where}: 2-{self.exact_width}{tail}{trees}"
        return (f"not exact {where}: a verify of 2+ tokens differs from one-token forwards "
                f"by up to {self.worst_diff:.2g}")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["exact"] = list(self.exact)
        out["exact_width"] = self.exact_width
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Exactness:
        """A verdict from its JSON form, validated as a manifest is: known fields only, widths
        within 2..max_width, finite figures; anything else is a ValueError (the caller probes again)."""
        if not isinstance(data, dict):
            raise ValueError("not an object")
        unknown = set(data) - _VERDICT_FIELDS
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        max_width = _int(data["max_width"], "max_width", 2, MAX_PROBE_WIDTH)
        exact = data["exact"]
        if not isinstance(exact, list):
            raise ValueError("exact is not a list")
        exact = tuple(_int(w, "exact width", 2, max_width) for w in exact)
        if list(exact) != sorted(set(exact)):
            raise ValueError("exact widths are not sorted and distinct")
        trees = data.get("trees")
        if trees is not None and not isinstance(trees, bool):
            raise ValueError("trees is not true, false or null")
        verdict = cls(max_width=max_width, exact=exact, worst_diff=_float(data["worst_diff"], "worst_diff"),
                      probe_ms=_float(data["probe_ms"], "probe_ms"), cached=bool(data.get("cached", False)),
                      trees=trees)
        if "exact_width" in data and data["exact_width"] != verdict.exact_width:
            raise ValueError("exact_width disagrees with exact")
        return verdict


# widest verify any policy asks the probe about: a bound on what a cache entry may claim
MAX_PROBE_WIDTH = 1024
_VERDICT_FIELDS = {"max_width", "exact", "worst_diff", "probe_ms", "cached", "trees", "exact_width"}


def _int(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} {value!r} is not an integer in {low}..{high}")
    return value


def _float(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} {value!r} is not a finite number >= 0")
    return float(value)


def _ids(rt: Runtime, n: int) -> list[int]:
    """Deterministic ids spread over the vocabulary (skipping the first ids, often specials)."""
    rng = np.random.default_rng(_SEED)
    low = min(16, max(rt.vocab_size - 1, 0))
    return [int(t) for t in rng.integers(low, rt.vocab_size, size=n)]


def _row_diff(a: np.ndarray, b: np.ndarray) -> float:
    """0.0 when bit-identical, else the largest absolute difference (inf where one is not finite)."""
    if np.array_equal(a.view(np.uint32), b.view(np.uint32)):
        return 0.0
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(np.nanmax(d)) if np.isfinite(d).any() else float("inf")


def _forward(rt: Runtime, ids: Sequence[int], n_logits: int) -> np.ndarray:
    # a runtime may return a view valid until its next forward
    return np.array(rt.forward(list(ids), n_logits=n_logits), dtype=np.float32)


def _prefill(rt: Runtime, ids: list[int]) -> None:
    """Feed `ids` from an empty cache in forwards the runtime accepts (static shapes take a few)."""
    rt.reset()
    step = rt.capabilities.max_batch_tokens or len(ids)
    for i in range(0, len(ids), step):
        rt.forward(ids[i:i + step], n_logits=1)


def _probe_start(rt: Runtime, ids: list[int], start: int, max_width: int) -> tuple[dict[int, float], float | None]:
    """({width: worst difference} for widths 2..max_width, the tree forward's worst difference or
    None where the runtime verifies chains only), from a prefix of `start` ids."""
    from .shared_body import SharedBodyRuntime

    # a shared body keeps rows by token ids, so after a trim the wide forward would reuse the
    # reference rows: another token fed at `start` first makes the body run from there again
    diverge = isinstance(rt, SharedBodyRuntime)
    other = ids[start] + 1 if ids[start] + 1 < rt.vocab_size else ids[start] - 1
    _prefill(rt, ids[:start])
    ref = [_forward(rt, [t], 1)[0] for t in ids[start:start + max_width + 1]]
    out = {}
    for w in range(2, max_width + 1):
        rt.trim(start)  # the prefix's rows are the same bits either way: keep them
        if diverge:
            rt.forward([other], n_logits=1)
            rt.trim(start)
        wide = _forward(rt, ids[start:start + w], w)
        after = _forward(rt, [ids[start + w]], 1)[0]  # reads the K/V rows the wide forward wrote
        out[w] = max(max(_row_diff(wide[i], ref[i]) for i in range(w)), _row_diff(after, ref[w]))
    tree = _probe_tree(rt, ids, start, max_width, ref) if rt.capabilities.trees else None
    rt.reset()
    return out, tree


def _probe_tree(rt: Runtime, ids: list[int], start: int, max_width: int, ref: list[np.ndarray]) -> float:
    """The worst difference of a tree forward's path rows (and of the forward after keeping that
    path) from one-token forwards: every path node comes after a sibling, so no path key sits
    where a chain would put it until the runtime moves it there (Runtime.keep_rows)."""
    depth = (max_width - 1) // 2
    if depth < 1:
        return 0.0
    tokens, parents, path = [ids[start]], [-1], [0]
    for j in range(1, depth + 1):
        sibling = ids[start + j] + 1 if ids[start + j] + 1 < rt.vocab_size else ids[start + j] - 1
        tokens += [sibling, ids[start + j]]
        parents += [path[-1], path[-1]]
        path.append(len(tokens) - 1)
    rt.trim(start)
    rows = np.array(rt.forward_tree(tokens, parents), dtype=np.float32)
    worst = max(_row_diff(rows[r], ref[i]) for i, r in enumerate(path))
    rt.keep_rows(start, path)
    return max(worst, _row_diff(_forward(rt, [ids[start + depth + 1]], 1)[0], ref[depth + 1]))


def probe(rt: Runtime, max_width: int, starts: Sequence[int] = PROBE_STARTS) -> Exactness:
    """Measure which verify widths 2..max_width of `rt` are bit-identical to one-token forwards.

    Leaves `rt`'s cache empty. A runtime whose cache holds fewer positions than the probe needs
    is probed from shorter prefixes."""
    t0 = time.perf_counter()
    cap = rt.kv_capacity
    if cap is not None:
        max_width = min(max_width, cap - 2)
        starts = tuple(s for s in starts if s + max_width + 1 <= cap) or (1,)
    max_width = max(max_width, 1)
    ids = _ids(rt, max(starts) + max_width + 1)
    worst: dict[int, float] = {w: 0.0 for w in range(2, max_width + 1)}
    trees: bool | None = None  # None: the runtime verifies chains only
    for s in starts:
        widths, tree = _probe_start(rt, ids, s, max_width)
        for w, d in widths.items():
            worst[w] = max(worst[w], d)
        if tree is not None:
            trees = tree == 0.0 and trees is not False
    ms = (time.perf_counter() - t0) * 1e3
    exact = tuple(w for w, d in sorted(worst.items()) if d == 0.0)
    return Exactness(max_width, exact, max(worst.values(), default=0.0), round(ms, 1), trees=trees)


def machine_fingerprint() -> str:
    """The CPU models and feature flags of every core this process may use, and how many there
    are: what decides which kernels a backend picks and where they split their sums (a
    big.LITTLE phone lists its core types apart; a 2-vCPU VM and a 4-vCPU one of the same CPU
    differ)."""
    parts = [platform.machine(), platform.system(), platform.processor()]
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for key in ("model name", "flags", "Features", "CPU implementer", "CPU part"):
        values = {ln.split(":", 1)[-1].strip() for ln in text.splitlines()
                  if ln.split(":")[0].strip() == key}
        parts.append(";".join(sorted(values)))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    parts.append(f"cpus={','.join(map(str, cpus))}")
    return "|".join(parts)


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _cache_file(key: dict) -> Path:
    from ..models.catalog import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / "exactness" / f"{digest}.json"


def probe_cached(rt: Runtime, max_width: int, *, backend: str, version: str, model_files: Sequence[Path],
                 options: dict, retune: bool = False) -> Exactness:
    """`probe`, or the verdict an earlier probe of the same runtime on this machine left in the
    cache. `options` are the runtime's settings that choose kernels (threads, precision, modes)."""
    key = {"probe": PROBE_VERSION, "machine": machine_fingerprint(), "backend": backend, "version": version,
           "files": [_file_key(Path(p)) for p in model_files], "options": options, "max_width": max_width}
    path = _cache_file(key)
    if not retune:
        cached = _read_verdict(path, key, max_width)
        if cached is not None:
            return cached
    verdict = probe(rt, max_width)
    from ..models.catalog import write_cache_entry

    entry = {"verdict": verdict.to_dict(), "key": key}
    write_cache_entry(path, {**entry, "checksum": _checksum(entry)}, "exactness verdict")
    logger.info("exactness probe (%s, %.0f ms): %s", backend, verdict.probe_ms, verdict.describe())
    return verdict


def _checksum(entry: dict) -> str:
    """sha256 of an entry's canonical JSON: a verdict edited by hand (or half-written) no longer matches."""
    return hashlib.sha256(json.dumps(entry, sort_keys=True, default=str).encode()).hexdigest()


def _read_verdict(path: Path, key: dict, max_width: int) -> Exactness | None:
    """The cached verdict for `key`, or None (with a log line saying why) when there is none or it
    fails validation: a foreign, stale, edited or damaged entry is probed again, never believed."""
    from ..models.catalog import read_cache_entry

    data = read_cache_entry(path, "exactness verdict")
    if data is None:
        return None
    try:
        if not isinstance(data, dict) or set(data) != {"verdict", "key", "checksum"}:
            raise ValueError("not an edgespec verdict entry")
        if data["checksum"] != _checksum({"verdict": data["verdict"], "key": data["key"]}):
            raise ValueError("its checksum does not match its contents")
        if json.loads(json.dumps(key, default=str)) != data["key"]:
            raise ValueError("it was measured for another machine, thread count, backend or model")
        verdict = Exactness.from_dict({**data["verdict"], "cached": True})
        if verdict.max_width != max_width:
            raise ValueError("it probed other widths")
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("discarding the cached exactness verdict %s (%s); probing again", path.name, e)
        return None
    return verdict


def _mode_file(backend: str, version: str, model_files: Sequence[Path], options: dict) -> Path:
    key = {"probe": PROBE_VERSION, "machine": machine_fingerprint(), "backend": backend, "version": version,
           "files": [_file_key(Path(p)) for p in model_files], "options": options, "kind": "mode"}
    return _cache_file(key)


def remembered_mode(backend: str, version: str, model_files: Sequence[Path], options: dict) -> dict | None:
    """The runtime options an engine settled on for these models here last time (an exact mode
    such as padded rows; {} for the default), so a later load opens that mode straight away;
    None where no engine has settled one here yet."""
    from ..models.catalog import read_cache_entry

    path = _mode_file(backend, version, model_files, options)
    mode = read_cache_entry(path, "exact mode")
    if mode is None:
        return None
    if not isinstance(mode, dict) or not all(isinstance(k, str) and isinstance(v, (bool, int, str))
                                             for k, v in mode.items()):
        logger.warning("discarding the remembered exact mode %s (not a flat object of options)", path.name)
        return None
    return mode


def remember_mode(backend: str, version: str, model_files: Sequence[Path], options: dict, mode: dict) -> None:
    from ..models.catalog import write_cache_entry

    write_cache_entry(_mode_file(backend, version, model_files, options), mode, "exact mode")
