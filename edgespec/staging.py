"""Building a bundle where nobody sees it half-written: a staging folder beside the output, renamed
into place when complete (never over a neighbour's bundle without `--force`, and over an old one
only by moving it aside first), the leftovers of killed runs swept, and a lock so that two
processes building one bundle build it once."""
from __future__ import annotations

import glob
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .bundle import read_manifest
from .errors import BundleError
from .files import build_lock, rename_noreplace

__all__ = ["sweep_stale", "staged_bundle_dir", "built_once"]

logger = logging.getLogger(__name__)


# staging folders are `.<name>.<pid>.stage-<random>` beside the output; the pid is the owner's,
# so a later export can tell a crashed run's leftovers from a run still going
_STAGE = re.compile(r"\.(?P<pid>\d+)\.(?:stage|old)-[A-Za-z0-9_]+")


def _alive(pid: int) -> bool:
    import psutil  # os.kill(pid, 0) would terminate the process on Windows

    return pid == os.getpid() or psutil.pid_exists(pid)


def sweep_stale(out: Path) -> list[Path]:
    """Remove the staging folders beside `out` whose export process is gone (a SIGKILL or a
    power cut leaves them, up to GBs each); return them. An old bundle moved aside by a
    replace that died half-way is moved back to `out` instead when `out` is missing."""
    swept = []
    try:
        leftovers = sorted(out.parent.glob(f".{glob.escape(out.name)}.*"))
    except OSError:
        return swept
    for p in leftovers:
        m = _STAGE.fullmatch(p.name[len(out.name) + 1:])
        if m is None or not p.is_dir() or _alive(int(m["pid"])):
            continue
        if ".old-" in p.name and not out.exists():
            logger.warning("restoring %s, moved aside by an export that did not finish", out)
            p.rename(out)
            continue
        logger.info("removing %s, left by an export that did not finish", p)
        shutil.rmtree(p, ignore_errors=True)
        swept.append(p)
    return swept


def _replaceable(out: Path) -> None:
    """Refuse to replace anything but an edgespec bundle (or an empty folder): `--force` on a
    folder of the user's files must not delete them."""
    if not out.is_dir():
        raise BundleError(f"output path exists and is not a folder: {out}; choose another --output")
    if not any(out.iterdir()):
        return
    try:
        read_manifest(out)
    except BundleError as e:
        raise BundleError(f"--force replaces only an edgespec bundle, and {out} is not one ({e}); "
                          "choose another --output") from None


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished `tmp` to `out`. Without `force` only where nothing holds the name (one
    atomic step: a neighbour's bundle published meanwhile is never replaced, FileExistsError);
    with it, an old bundle there is moved aside, the new one moved in, and the old one moved back
    if that fails."""
    if not force or not out.exists():
        rename_noreplace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.old-", dir=out.parent))
    old.rmdir()  # only its unique name is wanted
    out.rename(old)
    try:
        rename_noreplace(tmp, out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_bundle_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside `out`; on success rename it into place, else remove it.

    A crash or error leaves no half-written bundle at `out`, and the old bundle stays until the
    new one is complete: the replace moves it aside, moves the new one in, and moves it back if
    that fails. Without `force` the new bundle only takes a free name, so of two exports to one
    folder the second fails rather than replace the first. Leftovers of runs killed outright are
    swept by the next export (sweep_stale)."""
    try:
        out = out.expanduser().resolve()
    except RuntimeError as e:  # a symlink loop (Python before 3.13)
        raise BundleError(f"cannot write the bundle at {out}: {e}") from None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(out)
        if out.exists() and not force:
            raise BundleError(f"output path exists: {out}; pass --force to replace it")
        if out.exists():
            _replaceable(out)
    except OSError as e:
        raise BundleError(f"cannot write the bundle at {out}: {e.strerror or e}") from None
    # named before it is made, inside the block that removes it: a signal arriving the moment it
    # exists (SIGTERM unwinds as Ctrl-C) finds its name known
    tmp = out.parent / f".{out.name}.{os.getpid()}.stage-{secrets.token_hex(6)}"
    try:
        try:
            tmp.mkdir()
        except OSError as e:
            raise BundleError(f"cannot write the bundle at {out}: {e.strerror or e}") from None
        yield tmp
        try:
            _publish(tmp, out, force)
        except FileExistsError:  # another export finished first; without --force its bundle stays
            raise BundleError(f"output path exists: {out} (another export wrote it meanwhile); pass --force "
                              "to replace it") from None
    except OSError as e:  # a full disk, a folder made read-only meanwhile
        where = f" {e.filename}" if e.filename else ""
        raise BundleError(f"cannot write the bundle at {out}:{where} {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def built_once(out: Path) -> Iterator[None]:
    """Held while `out` is built, so a second process building the same bundle waits and reuses it
    instead of building it again beside the first; its lock file goes when it is released, built
    or not (files.build_lock)."""
    def waiting() -> None:
        logger.warning("waiting for another edgespec process building %s", out)

    with ExitStack() as stack:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(build_lock(out.parent / f".{out.name}.lock", on_wait=waiting))
        except OSError as e:  # an unwritable cache, said before the build is announced
            where = f" {e.filename}" if e.filename else ""
            raise BundleError(f"cannot write the bundle at {out}:{where} {e.strerror or e}") from None
        yield
