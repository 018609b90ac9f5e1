"""A bounded on-disk cache of compiled models (what OpenVINO's CACHE_DIR holds).

OpenVINO writes one blob per distinct model and configuration and never deletes one. Across
re-exports, precisions and devices that grows without end: a day of exports and tests filled
the disk with blobs (docs/LOG.md). So each model file gets its own
folder, keyed by its path, size and modification time (a re-export gets a fresh one), and the
most recently used folders are kept under a size cap; older ones are deleted. A hit saves most
of a load's time, the compiling (docs/backend-openvino.md).

EDGESPEC_COMPILE_CACHE_MB sets the cap (0 turns the cache off). Several processes share the
cache, so the touch-and-evict step runs under a file lock (`.lock` in the cache root): two
loads at once must not each delete what the other just marked as used. A cache folder that
cannot be written turns caching off with a warning instead of failing the load.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from ...models.catalog import cache_dir

__all__ = ["DEFAULT_MAX_MB", "compile_cache_dir", "evictions"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MB = 4096  # a few models at a few precisions, an f32 blob of a small model included
LOCK_NAME = ".lock"
LOCK_TIMEOUT_S = 30.0  # a process holds the lock for a directory scan; longer means it is stuck


def _max_bytes() -> int:
    raw = os.environ.get("EDGESPEC_COMPILE_CACHE_MB", "")
    try:
        return max(int(raw), 0) << 20 if raw.strip() else DEFAULT_MAX_MB << 20
    except ValueError:
        logger.warning("EDGESPEC_COMPILE_CACHE_MB=%r is not a whole number of MB; using %d", raw, DEFAULT_MAX_MB)
        return DEFAULT_MAX_MB << 20


def evictions(entries: Sequence[tuple[str, float, int]], max_bytes: int, keep: str) -> list[str]:
    """Names to delete from (name, last used, bytes) entries so the rest fit in max_bytes:
    the least recently used first; `keep` (the entry in use) is never deleted."""
    total = sum(size for _, _, size in entries)
    out: list[str] = []
    for name, _, size in sorted(entries, key=lambda e: e[1]):
        if total <= max_bytes:
            break
        if name != keep:
            out.append(name)
            total -= size
    return out


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def compile_cache_dir(model_path: Path, device: str, kind: str = "openvino") -> str | None:
    """The cache folder for this model file on this device (None: caching is off), after
    evicting the least recently used folders beyond the cap."""
    from filelock import FileLock, Timeout

    max_bytes = _max_bytes()
    if max_bytes == 0:
        return None
    stats = [p.stat() for p in (model_path, model_path.with_suffix(".bin")) if p.is_file()]
    ident = "|".join([str(model_path.resolve()), device, *(f"{st.st_size}:{st.st_mtime_ns}" for st in stats)])
    root = cache_dir() / kind
    folder = root / hashlib.sha256(ident.encode()).hexdigest()[:16]
    try:
        root.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(root / LOCK_NAME, timeout=LOCK_TIMEOUT_S):
                _use(folder)
                _evict(root, max_bytes, keep=folder.name)
        except Timeout:
            logger.warning("compile cache %s: another process holds its lock; not pruning it this time", root)
            _use(folder)
    except OSError as e:
        logger.warning("compile cache off: cannot write %s (%s)", root, e.strerror or e)
        return None
    return str(folder)


def _use(folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    os.utime(folder)  # last used: now


def _evict(root: Path, max_bytes: int, keep: str) -> None:
    """Delete the least recently used folders of `root` beyond `max_bytes` (under the lock)."""
    try:
        entries = [(p.name, p.stat().st_mtime, _size(p)) for p in root.iterdir() if p.name != LOCK_NAME]
    except OSError:  # a folder deleted under us by a process that does not lock (an old edgespec)
        return
    for name in evictions(entries, max_bytes, keep=keep):
        logger.info("compile cache over %d MB: deleting %s", max_bytes >> 20, name)
        target = root / name
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
