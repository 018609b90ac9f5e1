"""The `.gguf` content-hash index: each file's sha256, remembered against its (size, mtime,
ctime, inode) in a small JSON file in the cache, so a multi-GB GGUF run directly is hashed once,
not on every run (bundles.py keys its bundles by it; passthrough.py records it for a linked
target)."""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from ...models.catalog import cache_dir, file_sha256
from ...progress import task

__all__ = ["INDEX_FILE", "content_digest", "link_hashed"]

logger = logging.getLogger(__name__)

INDEX_FILE = "gguf-hashes.json"
INDEX_VERSION = 1


def _stat_key(st: os.stat_result) -> list[int]:
    # ctime too: a tool that keeps the mtime while rewriting (cp -p, rsync -t) still changes it
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _read_index(index: Path) -> dict:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing or damaged: it is only a shortcut, start afresh
        return {}
    if not isinstance(data, dict) or data.get("version") != INDEX_VERSION or not isinstance(data.get("files"), dict):
        return {}
    return data["files"]


def _write_index(index: Path, files: dict) -> None:
    """Replace the index atomically; entries of files that are gone are dropped so it stays small."""
    files = {p: v for p, v in files.items() if os.path.exists(p)}
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{index.name}.", dir=index.parent)
    except OSError as e:  # an unwritable cache: the bundle's own write reports it
        logger.debug("cannot update %s: %s", index, e.strerror or e)
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"version": INDEX_VERSION, "files": files}, fh)
        os.replace(tmp, index)  # readers see the old index or the new one, never a half-written file
    except OSError as e:  # a full disk
        logger.debug("cannot update %s: %s", index, e.strerror or e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def content_digest(path: Path) -> str:
    """The file's sha256, from the index when its size, times and inode are unchanged."""
    path = path.resolve()
    st = path.stat()
    index = cache_dir() / INDEX_FILE
    files = _read_index(index)
    entry = files.get(str(path))
    if isinstance(entry, dict) and entry.get("stat") == _stat_key(st) and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    logger.info("hashing %s (%.0f MiB)", path, st.st_size / 2**20)
    with task(f"hashing {path.name} ({st.st_size / 2**30:.1f} GiB) to find its bundle"):
        digest = file_sha256(path)
    # the stat from before the read: a file changed while it was hashed no longer matches it
    files[str(path)] = {"stat": _stat_key(st), "sha256": digest}
    _write_index(index, files)
    return digest


def link_hashed(src: Path, dst: Path) -> str:
    """Hard-link `dst` to `src` and return their sha256, keeping the index's entry of `src`
    current: a new link changes the file's ctime, which would otherwise cost a second hash."""
    digest = content_digest(src)  # the index's, as the cache lookup just left it
    os.link(src, dst)
    index = cache_dir() / INDEX_FILE
    files = _read_index(index)
    files[str(src.resolve())] = {"stat": _stat_key(src.stat()), "sha256": digest}
    _write_index(index, files)
    return digest
