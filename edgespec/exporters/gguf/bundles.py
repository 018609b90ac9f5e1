"""Bundles for GGUF files run directly (`edgespec chat model.gguf`, `edgespec.load("model.gguf")`).

A GGUF named where a bundle is expected is exported once into the user cache, with the defaults
the embedded default bundle is built with, and reused from then on. The bundle is keyed by the
file's content (sha256), not its name or mtime, so an edited or replaced file never runs a stale
bundle; and by the bundle schema and exporter revision, so an edgespec upgrade that writes
bundles differently rebuilds it. Hashing a multi-GB file takes seconds, so each file's digest is
remembered against its (size, mtime, ctime, inode) in a small JSON index in the cache."""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path

from ...bundle import MANIFEST, SCHEMA_VERSION, built_once
from ...errors import ConfigError, ExportError
from ...files import path_problem
from ...models.catalog import BUNDLE_REVISION, cache_dir, file_sha256, format_suffix, gguf_bundles_dir
from ...progress import task

__all__ = ["GGUF_MAGIC", "bundle_for_gguf", "content_digest", "gguf_bundle_path", "is_gguf", "link_hashed",
           "resolve_bundle"]

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
INDEX_FILE = "gguf-hashes.json"
INDEX_VERSION = 1
DIGEST_CHARS = 16  # 64 bits of sha256 in the folder name: no collision among one user's files
STEM_CHARS = 48


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    try:
        with path.open("rb") as fh:
            return fh.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def resolve_bundle(arg: str | os.PathLike, fmt: str = "onnx") -> Path:
    """The bundle folder a BUNDLE argument names: a GGUF file becomes its cached bundle in format
    `fmt` (built on first use); anything else is taken as a bundle folder, which load_bundle checks."""
    path = Path(arg).expanduser()
    if path.is_dir():
        return path
    if path.is_file() or path.suffix.lower() == ".gguf":
        return bundle_for_gguf(path, fmt)
    return path


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


def gguf_bundle_path(gguf: Path, digest: str, fmt: str = "onnx") -> Path:
    """The cache folder of the `fmt` bundle of a GGUF with this content digest (the name is for
    people; an ONNX bundle, the default, carries no format in it)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf.name.removesuffix(gguf.suffix)).lstrip(".")[:STEM_CHARS] or "model"
    kind = format_suffix(fmt)
    return gguf_bundles_dir() / f"{stem}-{digest[:DIGEST_CHARS]}{kind}-s{SCHEMA_VERSION}r{BUNDLE_REVISION}"


def _check_gguf(path: Path) -> None:
    problem = path_problem(path)
    if problem == "missing":
        raise ConfigError(f"no such file: {path}")
    if problem is not None:
        raise ConfigError(f"{path} is {problem}, not a bundle folder or a GGUF file")
    if not path.is_file() or not is_gguf(path):
        raise ConfigError(f"{path} is neither a bundle folder nor a GGUF file (no GGUF magic bytes)")


def _check_architecture(path: Path) -> None:
    """Refuse a damaged GGUF or one of an architecture edgespec cannot run before the build is
    announced, so that this bad input is one line on stderr, not a progress line and an error."""
    from .reader import field, open_gguf
    from .source import ARCHS

    arch = str(field(open_gguf(path), "general.architecture", ""))
    if arch not in ARCHS:
        raise ExportError(f"{path.name}: GGUF architecture {arch[:40]!r} is not supported "
                          f"(supported: {', '.join(sorted(ARCHS))})")


def bundle_for_gguf(path: str | os.PathLike, fmt: str = "onnx") -> Path:
    """The `fmt` bundle of the GGUF file `path` in the user cache: reused when one was built from
    the same content by this bundle revision, else exported now (atomically: a run killed half-way
    leaves only a staging folder, which the next export sweeps). A backend that runs GGUF gets a
    bundle whose target is the file itself (linked) and whose draft is cut from it."""
    gguf = Path(path).expanduser()
    _check_gguf(gguf)
    out = gguf_bundle_path(gguf, content_digest(gguf), fmt)
    if (out / MANIFEST).is_file():
        logger.info("reusing the bundle %s for %s", out, gguf)
        return out
    _check_architecture(gguf)
    with built_once(out):
        if (out / MANIFEST).is_file():  # built by another process while this one waited
            return out
        from ..export import ExportConfig, export_bundle

        logger.info("building a bundle for %s in %s", gguf, out)
        with task(f"building a bundle for {gguf.name} (one time; `edgespec export --target` makes one with "
                  "other options)", announce=True):
            # ExportConfig's other defaults are the embedded default bundle's: a self-draft, the GGUF's own
            # blocks; the target shares the user's file (a hard link, checked at load) rather than doubling it
            return export_bundle(ExportConfig(output=out, target=gguf.resolve(), formats=(fmt,), force=out.exists(),
                                              share_source=True))
