"""File-system steps the bundle code needs and the standard library lacks.

- `path_problem`: what a path is when it is not a regular file or a folder ("a symlink loop",
  "a named pipe (FIFO)", "a character device"), so an error can say so instead of "not found"
  or "not a model folder";
- `rename_noreplace`: publish a finished folder under its name only if nothing holds that name
  yet, atomically (Linux's renameat2 with RENAME_NOREPLACE), so two builds of one bundle cannot
  both succeed, the second silently replacing the first;
- `clone_file`: a copy-on-write clone (FICLONE on Linux: Btrfs, XFS, bcachefs; clonefile on
  macOS: APFS), which costs no disk and which later writes to either file leave apart;
- `build_lock`: a lock across processes whose file is removed when it is released, so a build
  (failed or not) leaves nothing behind.
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["build_lock", "clone_file", "path_problem", "rename_noreplace"]

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_FICLONE = 0x40049409  # _IOW(0x94, 9, int), the same on every Linux architecture
# renameat2 refuses the flag here: an old kernel, a file system without it (some network ones)
_NO_RENAMEAT2 = {errno.EINVAL, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EINVAL), errno.EOPNOTSUPP}


def path_problem(path: str | os.PathLike) -> str | None:
    """None when `path` is a regular file or a folder (after symlinks); else what it is, in words
    that follow "PATH is": "missing", "a symlink loop", "a broken symlink", "a named pipe (FIFO)",
    "a character device", "a block device", "a socket", or the system's reason it cannot be read."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "a broken symlink (what it points to is missing)" if os.path.islink(path) else "missing"
        return f"not readable ({e.strerror or e})"
    except ValueError:  # a NUL byte in the name
        return "not a valid path"
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return None
    return next((what for test, what in _KINDS if test(st.st_mode)), "not a regular file")


def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc 2.28+, musl 1.2.2+, bionic
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src` to `dst` unless `dst` exists (FileExistsError, `dst` untouched; an empty
    folder counts as existing, where os.rename would replace it). Atomic on Linux and Windows;
    elsewhere, or where the file system lacks the flag, `dst` is claimed first (a folder made, or
    a hard link) and then replaced, so two callers still cannot both succeed."""
    if os.name == "nt":  # Windows' rename never replaces what is there
        os.rename(src, dst)
        return
    fn = _renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in _NO_RENAMEAT2:
            raise OSError(err, os.strerror(err), os.fspath(dst))  # EEXIST becomes FileExistsError
    if os.path.isdir(src):
        os.mkdir(dst)  # claims the name, or FileExistsError
        try:
            os.rename(src, dst)  # replaces the empty folder just made
        except BaseException:
            os.rmdir(dst)
            raise
    else:
        os.link(src, dst)
        os.unlink(src)


def _clone_linux(src: Path, dst: Path) -> bool:
    with open(src, "rb") as s, open(dst, "xb") as d:
        try:
            fcntl.ioctl(d.fileno(), _FICLONE, s.fileno())
            return True
        except OSError:  # EOPNOTSUPP (ext4, tmpfs), EXDEV (another file system), ...
            pass
    dst.unlink()
    return False


def _clone_macos(src: Path, dst: Path) -> bool:
    fn = getattr(ctypes.CDLL(None, use_errno=True), "clonefile", None)
    return fn is not None and fn(os.fsencode(src), os.fsencode(dst), 0) == 0


def clone_file(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """Make `dst` (which must not exist) a copy-on-write clone of `src`; False, and no `dst`,
    where the file system (or the OS) has no such clones."""
    src, dst = Path(src), Path(dst)
    if sys.platform.startswith("linux") and fcntl is not None:
        return _clone_linux(src, dst)
    if sys.platform == "darwin":
        return _clone_macos(src, dst)
    return False


def _holds(fd: int, path: Path) -> bool:
    """Whether the file open as `fd` is still the one named `path` (the last holder removes it)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


@contextmanager
def build_lock(path: str | os.PathLike, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the lock named `path` (a file created for it) across processes; `on_wait` is called
    once if another process holds it. The holder removes the file before it lets go, and a waiter
    that then gets the lock of a removed file opens the name again, so no file is ever left."""
    path = Path(path)
    if fcntl is None:  # Windows: filelock removes its lock file on release there
        from filelock import FileLock

        lock = FileLock(path)
        with lock:
            yield
        return
    waited = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None and not waited:
                    on_wait()
                waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        if _holds(fd, path):
            break
        os.close(fd)
    try:
        yield
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        os.close(fd)  # releases the lock
