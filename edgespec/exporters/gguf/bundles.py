"""Bundles for GGUF files run directly (`edgespec chat model.gguf`, `edgespec.load("model.gguf")`).

A GGUF named where a bundle is expected is exported once into the user cache, with the defaults
the embedded default bundle is built with, and reused from then on. The bundle is keyed by the
file's content (sha256), not its name or mtime, so an edited or replaced file never runs a stale
bundle; and by the bundle schema and exporter revision, so an edgespec upgrade that writes
bundles differently rebuilds it. Hashing a multi-GB file takes seconds, so each file's digest is
remembered against its (size, mtime, ctime, inode) in a small JSON index in the cache (hashes.py)."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from ...bundle import MANIFEST, SCHEMA_VERSION
from ...errors import ConfigError, ExportError
from ...files import path_problem
from ...models.catalog import BUNDLE_REVISION, format_suffix, gguf_bundles_dir
from ...progress import task
from ...staging import built_once
from .hashes import content_digest

__all__ = ["GGUF_MAGIC", "bundle_for_gguf", "gguf_bundle_path", "is_gguf", "resolve_bundle"]

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
DIGEST_CHARS = 16  # 64 bits of sha256 in the folder name: no collision among one user's files
STEM_CHARS = 48


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    try:
        with path.open("rb") as fh:
            return fh.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def resolve_bundle(arg: str | os.PathLike, fmt: str = "onnx", memory_budget: int | None = None) -> Path:
    """The bundle folder a BUNDLE argument names: a GGUF file becomes its cached bundle in format
    `fmt` (built on first use, within `memory_budget` bytes where given); anything else is taken
    as a bundle folder, which load_bundle checks."""
    path = Path(arg).expanduser()
    if path.is_dir():
        return path
    if path.is_file() or path.suffix.lower() == ".gguf":
        return bundle_for_gguf(path, fmt, memory_budget)
    return path


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


def bundle_for_gguf(path: str | os.PathLike, fmt: str = "onnx", memory_budget: int | None = None) -> Path:
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
            bundle = export_bundle(ExportConfig(output=out, target=gguf.resolve(), formats=(fmt,), force=out.exists(),
                                                share_source=True, memory_budget=memory_budget))
    from ...runtimes.heap import trim_heap

    trim_heap()  # the build's freed pages back to the OS before an engine measures what it holds
    return bundle
