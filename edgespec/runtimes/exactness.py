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
wide forward wrote are exact too). Every width is probed from four short prefixes (DENSE_STARTS):
two so that block boundaries of padded keys fall inside some widths, two whose widths cross 64
and 128 keys. Then a few widths (sampled_widths) are probed from one key before each place a
kernel may change how it splits the key axis among threads, or a sliding window ends
(probe_starts: powers of two, and the thread count's own split points), and near the end of the
context the runtime holds, so that a verify of any width there crosses it. One prefix is
prefilled once and extended from start to start. The verdict is cached per machine, backend
version, model file and runtime options (a JSON file in edgespec's cache), so only the first load
pays.
"""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..checks import integer, number
from ..cpus import usable_cpu_count, usable_cpu_ids
from ..progress import task
from .base import Runtime

__all__ = ["Exactness", "PROBE_STARTS", "DENSE_STARTS", "PROBE_VERSION", "PROBE_REACH", "MAX_PROBE_REACH",
           "machine_fingerprint",
           "probe", "probe_cached", "probe_starts", "sampled_widths", "remember_mode", "remembered_mode"]

logger = logging.getLogger(__name__)

PROBE_VERSION = 4  # bump when the procedure changes: old verdicts are then probed again
# prefix lengths probed at every width: keys padded to blocks of 16 cross a bound inside some
# widths (5, 14); and widths from 60 and 124 cross 64 and 128 keys, where kernels change how they
# split the key axis
DENSE_STARTS = (5, 14, 60, 124)
PROBE_STARTS = DENSE_STARTS  # the name earlier releases used
# the farthest key count the probe reaches by default: a context beyond it is probed up to here
# (the probe then prefills this many tokens once, the bulk of its cost on a long context), and the
# engine drafts only within it (Exactness.reach); a longer reach is asked for (probe_context)
PROBE_REACH = 4096
_SPLIT_UNIT = 64  # SGEMM hands each thread columns in multiples of this many keys
_SPLIT_STEP = 16  # ... and a second split follows 16 keys after (onnxruntime at 2 and 4 threads)
_PREFILL_CHUNK = 128
_SEED = 20_251_124


def probe_starts(max_width: int, threads: int | None, capacity: int | None,
                 window: tuple[int, int] | None = None, reach: int = PROBE_REACH) -> tuple[int, ...]:
    """The prefixes probed at a few widths (sampled_widths): one key before every key count where
    a kernel may change how it splits a sum, so that every width's rows cross it. Those are the
    powers of two from 64 up to the context (a sliding window's edge is one: Gemma 3's 512), and
    the thread count's split points: 64t and 64t+16 keys for t threads, and twice that (the
    split points measured moved with the thread count: 64 at 1 thread, 128/144 at 2, 256/272 at
    4). And one prefix near the end of the context, within `reach` keys. With `window` (the
    sliding layers' (window, alignment) of a graph that binds their keys from an aligned start,
    runtimes/onnxruntime/kv.window_start): where the window first leaves position 0, and where a
    verify's first rows start their windows one aligned block before its last rows. Each start
    leaves room for the widest verify and the forward after it."""
    reach = min(capacity or reach, reach)
    # a backend left to choose runs at most a thread per usable CPU
    t = threads or usable_cpu_count()
    bounds = {_SPLIT_UNIT * t * j + extra for j in (1, 2) for extra in (0, _SPLIT_STEP)}
    p = _SPLIT_UNIT
    while p <= reach:
        bounds.add(p)
        p *= 2
    starts = {b - 1 for b in bounds} | {reach - max_width - 2}
    if window is not None:
        size, align = window
        starts |= {size - 2, size + align - 3}
    return tuple(sorted(s for s in starts if s not in DENSE_STARTS and 0 < s and s + max_width + 1 <= reach))


def _window(rt: Runtime) -> tuple[int, int] | None:
    """(window, alignment) where `rt`'s sliding layers read their keys from an aligned start (an
    onnxruntime append graph's KV plan; a shared body's own runtime), else None."""
    inner = getattr(getattr(rt, "shared", None), "body", rt)
    win = getattr(getattr(getattr(inner, "kv", None), "plan", None), "window", None)
    return None if win is None else (int(win.size), int(win.align))


def sampled_widths(max_width: int) -> tuple[int, ...]:
    """The widths probed from probe_starts: every one there crosses the split it sits before, so
    the narrowest (two rows), three, the middle and the widest stand for the rest, which the
    dense starts probe one by one. A full sweep at each start would cost W wide forwards per
    start, at long contexts the most expensive forwards there are."""
    return tuple(sorted({w for w in (2, 3, max_width // 2 + 1, max_width) if 2 <= w <= max_width}))


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
    # the most keys a probed forward attended to: verifies reaching past it were not probed (a
    # verdict cached before the field existed probed up to PROBE_REACH, or its runtime's capacity)
    reach: int = PROBE_REACH

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
            return f"exact verify widths {where}: 2-{self.exact_width}{tail}{trees}; probed up to {self.reach} keys"
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
        max_width = integer(data["max_width"], "max_width", least=2, most=MAX_PROBE_WIDTH, error=ValueError)
        exact = data["exact"]
        if not isinstance(exact, list):
            raise ValueError("exact is not a list")
        exact = tuple(integer(w, "exact width", least=2, most=max_width, error=ValueError) for w in exact)
        if list(exact) != sorted(set(exact)):
            raise ValueError("exact widths are not sorted and distinct")
        trees = data.get("trees")
        if trees is not None and not isinstance(trees, bool):
            raise ValueError("trees is not true, false or null")
        verdict = cls(max_width=max_width, exact=exact,
                      worst_diff=number(data["worst_diff"], "worst_diff", least=0, error=ValueError),
                      probe_ms=number(data["probe_ms"], "probe_ms", least=0, error=ValueError),
                      cached=bool(data.get("cached", False)), trees=trees,
                      reach=integer(data.get("reach", PROBE_REACH), "reach", least=2, most=MAX_PROBE_REACH,
                                    error=ValueError))
        if "exact_width" in data and data["exact_width"] != verdict.exact_width:
            raise ValueError("exact_width disagrees with exact")
        return verdict


# widest verify any policy asks the probe about, and the farthest reach: bounds on what a cache entry may claim
MAX_PROBE_WIDTH = 1024
MAX_PROBE_REACH = 1 << 24
_VERDICT_FIELDS = {"max_width", "exact", "worst_diff", "probe_ms", "cached", "trees", "exact_width", "reach"}


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


def _extend(rt: Runtime, ids: list[int], n: int) -> None:
    """Make `rt`'s cache hold ids[:n]: it holds a prefix of `ids` already (the probe only trims and
    extends it), so only the rest is fed, in forwards the runtime accepts, chunked at absolute
    positions as the decoder chunks a prompt."""
    if rt.n_past > n:
        rt.trim(n)
    step = min(rt.capabilities.max_batch_tokens or _PREFILL_CHUNK, _PREFILL_CHUNK)
    while rt.n_past < n:
        end = min(n, (rt.n_past // step + 1) * step)
        rt.forward(ids[rt.n_past:end], n_logits=1)


def _probe_start(rt: Runtime, ids: list[int], start: int, widths: Sequence[int], max_width: int
                 ) -> tuple[dict[int, float], float | None]:
    """({width: worst difference} for `widths`, the tree forward's worst difference or None where
    the runtime verifies chains only), from a prefix of `start` ids. Leaves the prefix cached."""
    from .shared_body import SharedBodyRuntime

    # a shared body keeps rows by token ids, so after a trim the wide forward would reuse the
    # reference rows: another token fed at `start` first makes the body run from there again
    diverge = isinstance(rt, SharedBodyRuntime)
    other = ids[start] + 1 if ids[start] + 1 < rt.vocab_size else ids[start] - 1
    _extend(rt, ids, start)
    ref = [_forward(rt, [t], 1)[0] for t in ids[start:start + max_width + 1]]
    out = {}
    for w in widths:
        rt.trim(start)  # the prefix's rows are the same bits either way: keep them
        if diverge:
            rt.forward([other], n_logits=1)
            rt.trim(start)
        wide = _forward(rt, ids[start:start + w], w)
        after = _forward(rt, [ids[start + w]], 1)[0]  # reads the K/V rows the wide forward wrote
        out[w] = max(max(_row_diff(wide[i], ref[i]) for i in range(w)), _row_diff(after, ref[w]))
    tree = _probe_tree(rt, ids, start, max_width, ref) if rt.capabilities.trees else None
    rt.trim(start)
    if diverge:  # the next start's reference rows must not be these wide forwards' rows, reused by id
        rt.forward([other], n_logits=1)
        rt.trim(start)
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


def _probe_plan(rt: Runtime, ids: list[int], plan: list, max_width: int, worst: dict[int, float],
                progress) -> bool | None:
    """Probe every (start, widths) of `plan`, raising `worst` in place to the largest difference
    seen at each width; whether tree verifies were exact too (None: the runtime verifies chains
    only). Leaves `rt`'s cache empty."""
    trees: bool | None = None
    try:
        for s, widths in plan:  # ascending: one prefix, extended from start to start
            found, tree = _probe_start(rt, ids, s, widths, max_width)
            for w in worst:
                # a width not probed from this start counts as off as the widest probed below it:
                # a verify that rounds apart at some width is not trusted wider
                d = found.get(w, max((found[v] for v in found if v <= w), default=0.0))
                worst[w] = max(worst[w], d)
            if tree is not None:
                trees = tree == 0.0 and trees is not False
            progress.update()
    finally:
        rt.reset()
    return trees


def probe(rt: Runtime, max_width: int, starts: Sequence[int] = DENSE_STARTS, *, threads: int | None = None,
          sampled: Sequence[int] | None = None, reach: int = PROBE_REACH) -> Exactness:
    """Measure which verify widths 2..max_width of `rt` are bit-identical to one-token forwards:
    every width from `starts`, sampled_widths from `sampled` (None: probe_starts for `threads`,
    the runtime's capacity and `reach`; () for none). The verdict's `reach` is the most keys a
    probed forward attended to.

    Leaves `rt`'s cache empty. A runtime whose cache holds fewer positions than the probe needs
    is probed from shorter prefixes."""
    t0 = time.perf_counter()
    cap = rt.kv_capacity
    if cap is not None:
        max_width = min(max_width, cap - 2)
        starts = tuple(s for s in starts if s + max_width + 1 <= cap) or (1,)
    max_width = max(max_width, 1)
    if sampled is None:
        sampled = probe_starts(max_width, threads, cap, _window(rt), reach)
    sampled = tuple(s for s in sampled if cap is None or s + max_width + 1 <= cap)
    plan = sorted({**{s: sampled_widths(max_width) for s in sampled},
                   **{s: tuple(range(2, max_width + 1)) for s in starts}}.items())
    ids = _ids(rt, max(s for s, _ in plan) + max_width + 1)
    worst: dict[int, float] = {w: 0.0 for w in range(2, max_width + 1)}
    rt.reset()
    # once per machine, model and setting, then cached; minutes on a slow backend or a busy machine
    with task("probing verify exactness on this machine (once, then cached)", total=len(plan),
              unit="prefix") as progress:
        trees = _probe_plan(rt, ids, plan, max_width, worst, progress)
    ms = (time.perf_counter() - t0) * 1e3
    exact = tuple(w for w, d in sorted(worst.items()) if d == 0.0)
    return Exactness(max_width, exact, max(worst.values(), default=0.0), round(ms, 1), trees=trees,
                     reach=plan[-1][0] + max_width + 1)


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
    parts.append(f"cpus={','.join(map(str, usable_cpu_ids()))}")
    return "|".join(parts)


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _cache_file(key: dict) -> Path:
    from ..models.catalog import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / "exactness" / f"{digest}.json"


def probe_cached(rt: Runtime, max_width: int, *, backend: str, version: str, model_files: Sequence[Path],
                 options: dict, retune: bool = False, reach: int = PROBE_REACH) -> Exactness:
    """`probe`, or the verdict an earlier probe of the same runtime on this machine left in the
    cache. `options` are the runtime's settings that choose kernels (threads, precision, modes);
    `reach`: the most keys to probe at (within the runtime's capacity)."""
    key = {"probe": PROBE_VERSION, "machine": machine_fingerprint(), "backend": backend, "version": version,
           "files": [_file_key(Path(p)) for p in model_files], "options": options, "max_width": max_width,
           # the default reach keeps the key verdicts were cached under before it could be chosen
           **({} if reach == PROBE_REACH else {"reach": reach})}
    path = _cache_file(key)
    if not retune:
        cached = _read_verdict(path, key, max_width)
        if cached is not None:
            return cached
    threads = options.get("threads")
    verdict = probe(rt, max_width, threads=threads if isinstance(threads, int) else None, reach=reach)
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
