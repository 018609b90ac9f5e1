"""llama.cpp's own `llama-server` and `rpc-server`, built once from the llama.cpp sources that the
pinned llama-cpp-python ships in its sdist, and cached like pip caches that package's wheel.

The bench's peer, `edgespec deploy` and the tests all call `find_or_build()`: the same llama.cpp
that edgespec's llama.cpp backend runs, as its own server. A build is keyed by the llama-cpp-python
version, the CMake options, the compiler and (for a native build, whose binaries use this CPU's
instructions) the CPU, so a cache folder shared between machines never hands one machine another's
binaries. The build runs at low priority on two jobs, shows its progress on stderr, holds a lock
so that concurrent callers build once, and publishes the finished folder by one rename.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DeployError

__all__ = ["LlamaCppBuild", "BuildOptions", "LLAMA_CPP_PYTHON_PIN", "DEFAULT_CMAKE_OPTIONS",
           "find_or_build", "find_build", "locate", "cache_root", "installed_version", "build_key", "BIN_ENV", "main"]

logger = logging.getLogger(__name__)

# the llama-cpp-python release pyproject.toml pins (tests/test_deploy_build.py checks they agree)
LLAMA_CPP_PYTHON_PIN = "0.3.36"
# a folder holding an existing build (llama-server, and rpc-server for --rpc): used as it is
BIN_ENV = "EDGESPEC_LLAMA_BIN"
MANIFEST = "build.json"
# bump when the layout of a cached build folder or the way it is built changes
LAYOUT = 1

# llama.cpp's defaults for a CPU build, with what differs said why. Unlike edgespec's own
# llama-cpp-python build (GGML_LLAMAFILE=OFF, for exactness against its reference), a peer is
# llama.cpp as its users build it, llamafile kernels and all.
DEFAULT_CMAKE_OPTIONS: dict[str, str] = {
    "CMAKE_BUILD_TYPE": "Release",
    # llama.cpp's default outside cross builds, said explicitly: SOURCE_DATE_EPOCH in the
    # environment would otherwise turn it off
    "GGML_NATIVE": "ON",
    "GGML_RPC": "ON",              # rpc-server, and llama-server's --rpc
    "BUILD_SHARED_LIBS": "OFF",    # self-contained binaries: the cached folder can be renamed
    "LLAMA_BUILD_TESTS": "OFF",    # not run here; they double the build time
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",  # its web UI would be downloaded from a model hub; the API needs none
    "LLAMA_OPENSSL": "OFF",        # HTTPS is only for downloading models, which edgespec never does
}
# CMake target -> the file name published in the cache (the RPC worker's target is ggml-rpc-server;
# llama.cpp's docs and users call it rpc-server, which is also published as a link)
TARGETS: dict[str, str] = {"llama-server": "llama-server", "ggml-rpc-server": "ggml-rpc-server"}
ALIASES: dict[str, str] = {"rpc-server": "ggml-rpc-server"}


@dataclass(frozen=True)
class BuildOptions:
    """What a build is made from: the llama-cpp-python release whose sdist carries llama.cpp, the
    CMake options, and the parallel jobs and niceness the compiler runs at (not part of the key)."""

    version: str = field(default_factory=lambda: installed_version() or LLAMA_CPP_PYTHON_PIN)
    cmake: tuple[tuple[str, str], ...] = tuple(DEFAULT_CMAKE_OPTIONS.items())
    jobs: int = 2
    nice: int = 15

    def __post_init__(self) -> None:
        if not re.fullmatch(r"\d+(\.\d+)*([a-z0-9.+-]*)", self.version):
            raise DeployError(f"not a llama-cpp-python version: {self.version!r}")
        if self.jobs < 1:
            raise DeployError(f"build jobs must be >= 1, got {self.jobs}")

    @property
    def native(self) -> bool:
        return dict(self.cmake).get("GGML_NATIVE", "ON").upper() in ("ON", "1", "TRUE", "YES")


@dataclass(frozen=True)
class LlamaCppBuild:
    """One llama.cpp build on this machine: where its binaries are and what they were built from."""

    folder: Path
    server: Path
    rpc_server: Path | None
    source: str          # e.g. "llama-cpp-python 0.3.36 sdist (vendor/llama.cpp)", or the env folder
    cmake: dict[str, str] = field(default_factory=dict)
    compiler: str = ""
    cpu: str = ""
    key: str = ""

    def record(self) -> dict[str, object]:
        """What a benchmark records about the build it ran (JSON-ready; no local paths): its source,
        CMake options, compiler, the CPU it was compiled on (model only) and its cache key."""
        return {"source": self.source, "cmake": dict(self.cmake), "compiler": self.compiler,
                "cpu": " | ".join(self.cpu.split(" | ")[:2]), "key": self.key}


def installed_version() -> str | None:
    """The installed llama-cpp-python's version: the peer is the llama.cpp that backend runs."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def cache_root() -> Path:
    """Where built llama.cpp binaries live: `llama.cpp/` under edgespec's cache folder."""
    from ..models.catalog import cache_dir

    return cache_dir() / "llama.cpp"


def _compiler() -> str:
    """The C++ compiler's first `--version` line: a different compiler is a different build."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return ""
    return out.splitlines()[0].strip() if out else ""


def _cpu() -> str:
    """This CPU's model and instruction-set flags (what a native build compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".strip()
    model = re.search(r"^(model name|Hardware|CPU part)\s*:\s*(.+)$", text, flags=re.M)
    flags = re.search(r"^(flags|Features)\s*:\s*(.+)$", text, flags=re.M)
    parts = [platform.machine(), model.group(2).strip() if model else "",
             " ".join(sorted(set(flags.group(2).split()))) if flags else ""]
    return " | ".join(p for p in parts if p)


def build_key(options: BuildOptions, compiler: str, cpu: str) -> str:
    """The cache folder's name: version, then a digest of everything that changes the binaries."""
    what = {"layout": LAYOUT, "version": options.version, "cmake": sorted(options.cmake),
            "compiler": compiler, "cpu": cpu if options.native else platform.machine()}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return f"{options.version}-{digest}"


def _manifest(folder: Path) -> dict:
    try:
        meta = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _from_folder(folder: Path, how: str, server: Path | None = None) -> LlamaCppBuild:
    """The binaries in `folder` (`server`: the llama-server, if not named so), with what built them
    when it holds edgespec's build.json, else `how` they were found: "given", "PATH",
    "$EDGESPEC_LLAMA_BIN" (no local path: it goes into benchmark JSON)."""
    server = server or folder / "llama-server"
    if not (server.is_file() and os.access(server, os.X_OK)):
        raise DeployError(f"{folder} holds no executable llama-server" if server == folder / "llama-server"
                          else f"not an executable llama-server: {server}")
    rpc = next((folder / n for n in ("rpc-server", "ggml-rpc-server")
                if (folder / n).is_file() and os.access(folder / n, os.X_OK)), None)
    meta = _manifest(folder)
    return LlamaCppBuild(folder=folder, server=server, rpc_server=rpc, source=str(meta.get("source") or how),
                         cmake={str(k): str(v) for k, v in (meta.get("cmake") or {}).items()},
                         compiler=str(meta.get("compiler", "")), cpu=str(meta.get("cpu", "")),
                         key=folder.name if meta else "")


def _read_cached(folder: Path) -> LlamaCppBuild | None:
    """The cached build in `folder`, or None: not built, or left incomplete."""
    if not _manifest(folder):
        return None
    try:
        return _from_folder(folder, "cache")
    except DeployError:
        return None


def find_build(options: BuildOptions | None = None) -> LlamaCppBuild | None:
    """An existing build, without building: the folder in $EDGESPEC_LLAMA_BIN if set, else the cached
    build for `options` on this machine, else None."""
    env = os.environ.get(BIN_ENV)
    if env:
        return _from_folder(Path(env).expanduser(), f"${BIN_ENV}")
    options = options or BuildOptions()
    return _read_cached(cache_root() / build_key(options, _compiler(), _cpu()))


def find_or_build(options: BuildOptions | None = None, *, progress: bool | None = None) -> LlamaCppBuild:
    """`llama-server` and `rpc-server` for `options` (llama.cpp's CPU defaults from the pinned
    llama-cpp-python's sdist): found in $EDGESPEC_LLAMA_BIN or the cache, else built now (minutes;
    progress on stderr; `progress=False` silences it, None shows it on a terminal or in CI logs)."""
    found = find_build(options)
    if found is not None:
        return found
    options = options or BuildOptions()
    compiler, cpu = _compiler(), _cpu()
    final = cache_root() / build_key(options, compiler, cpu)
    with _lock(final):
        cached = _read_cached(final)  # built by another process while this one waited
        if cached is not None:
            return cached
        for dead in final.parent.glob(f".{final.name}.*"):  # staging left by a killed build
            if dead.is_dir():
                shutil.rmtree(dead, ignore_errors=True)
        _build(options, final, compiler=compiler, cpu=cpu, progress=progress)
    built = _read_cached(final)
    if built is None:
        raise DeployError(f"the llama.cpp build in {final} is incomplete")
    return built


@contextmanager
def _lock(final: Path) -> Iterator[None]:
    from filelock import FileLock, Timeout

    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(final.parent / f".{final.name}.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.warning("waiting for another process building llama.cpp in %s", final)
            lock.acquire()
    except OSError as e:
        raise DeployError(f"cannot write the llama.cpp build cache {final.parent}: {e.strerror or e}") from None
    try:
        yield
    finally:
        lock.release()


def _check_tools() -> None:
    missing = [tool for tool, names in (("cmake", ("cmake",)), ("a C++ compiler", ("c++", "g++", "clang++")))
               if not any(shutil.which(n) for n in names)]
    if missing:
        raise DeployError(f"building llama.cpp's server needs {' and '.join(missing)} on PATH "
                          "(Debian: apt-get install cmake g++)")


def _build(options: BuildOptions, final: Path, *, compiler: str, cpu: str, progress: bool | None) -> None:
    _check_tools()
    # the staging folder sits beside the final one, so publishing is one rename on one file system
    with tempfile.TemporaryDirectory(prefix=f".{final.name}.", dir=final.parent) as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        source = _fetch_source(options.version, work)
        logger.warning("building llama.cpp's llama-server and rpc-server from llama-cpp-python %s "
                       "(one time, a few minutes; cached in %s)", options.version, final)
        log = work / "build.log"
        try:
            _compile(source, work / "build", options, log, progress)
        except DeployError:
            kept = final.parent / f"{final.name}.failed.log"  # the staging folder goes; its log stays
            shutil.copyfile(log, kept)
            raise DeployError(f"{_last_error(log)} (the whole log: {kept})") from None
        out = work / "bin"
        out.mkdir()
        for target, name in TARGETS.items():
            shutil.copy2(_built_binary(work / "build", target), out / name)
        for alias, name in ALIASES.items():
            (out / alias).symlink_to(name)
        meta = {"source": f"llama-cpp-python {options.version} sdist (vendor/llama.cpp)",
                "cmake": dict(options.cmake), "compiler": compiler, "cpu": cpu,
                "build_seconds": round(time.monotonic() - t0, 1), "layout": LAYOUT}
        (out / MANIFEST).write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # a folder without a readable manifest: a dead build
        os.replace(out, final)
    logger.warning("llama.cpp built in %.0f s: %s", meta["build_seconds"], final)


def _fetch_source(version: str, work: Path) -> Path:
    """llama.cpp's source tree from the llama-cpp-python sdist, downloaded through pip (its index
    settings and HTTP cache apply)."""
    dl = work / "sdist"
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--quiet",
           "-d", str(dl), f"llama-cpp-python=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    sdists = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or not sdists:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise DeployError(f"cannot download llama-cpp-python {version}'s sdist: {' / '.join(tail) or 'no file'}")
    with tarfile.open(sdists[0]) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        # the "data" filter refuses links and paths out of the folder (Pythons that have it)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(work / "src", members=members, **safe)
    roots = list((work / "src").glob("*/vendor/llama.cpp"))
    if not roots or not (roots[0] / "CMakeLists.txt").is_file():
        raise DeployError(f"llama-cpp-python {version}'s sdist carries no vendor/llama.cpp")
    return roots[0]


def _compile(source: Path, build: Path, options: BuildOptions, log: Path, progress: bool | None) -> None:
    # niceness `options.nice` in all, not on top of the caller's own (a niced caller would starve it)
    extra_nice = max(0, options.nice - os.nice(0))
    prefix = ["nice", "-n", str(extra_nice)] if extra_nice and shutil.which("nice") else []
    # line-buffered output all the way down (cmake, ninja), so the progress bar moves as it builds
    prefix += ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [*prefix, "cmake", "-S", str(source), "-B", str(build), *generator,
                 *(f"-D{k}={v}" for k, v in options.cmake)]
    compile_ = [*prefix, "cmake", "--build", str(build), "-j", str(options.jobs),
                "--target", *TARGETS]
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(source.parent)}  # no parent repo's commit
    with log.open("w") as sink:
        _run_logged(configure, sink, env, progress=False, label="configure")
        _run_logged(compile_, sink, env, progress=progress, label="compile")


# ninja prints [done/total], make prints [ pct%]
_NINJA = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE = re.compile(r"^\[\s*(\d+)%\]")


def _fraction(line: str) -> float | None:
    m = _NINJA.match(line)
    if m:
        return int(m.group(1)) / max(1, int(m.group(2)))
    m = _MAKE.match(line)
    return int(m.group(1)) / 100 if m else None


def _run_logged(cmd: list[str], sink, env: dict[str, str], *, progress: bool | None, label: str) -> None:
    """Run `cmd`, its output into the log; a bar of its progress on stderr; on failure, the log's
    last lines in the error."""
    from tqdm.auto import tqdm

    disable = (not progress) if progress is not None else (None if sys.stderr.isatty() else False)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc, \
            tqdm(total=100, desc=f"llama.cpp {label}", unit="%", file=sys.stderr, disable=disable,
                 mininterval=5, bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}") as bar:
        for line in proc.stdout:
            sink.write(line)
            frac = _fraction(line)
            if frac is not None:
                bar.update(round(100 * frac) - bar.n)
        rc = proc.wait()
    if rc != 0:
        raise DeployError(f"llama.cpp {label} failed (exit {rc})")


def _last_error(log: Path) -> str:
    """The first compiler or CMake error line of a failed build's log, or its last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"\berror\b|CMake Error", ln)]
    return "building llama.cpp failed: " + ((errors or lines or ["no output"])[0])[:300]


def _built_binary(build: Path, target: str) -> Path:
    for candidate in (build / "bin" / target, build / target):
        if candidate.is_file():
            return candidate
    raise DeployError(f"the llama.cpp build produced no {target} under {build}")


def locate(given: str | os.PathLike | None = None, *, build: bool = True,
           progress: bool | None = None) -> LlamaCppBuild:
    """The llama-server to use: `given` (the binary or its folder), else $EDGESPEC_LLAMA_BIN, else
    the project's cached build, else `llama-server` on PATH, else a build now (`build=False`: a
    DeployError saying how to get one instead)."""
    if given is not None:
        path = Path(given).expanduser()
        return _from_folder(path, "given") if path.is_dir() else _from_folder(path.parent, "given", path)
    found = find_build()
    if found is not None:
        return found
    on_path = shutil.which("llama-server")
    if on_path:
        return _from_folder(Path(on_path).parent, "PATH", Path(on_path))
    if not build:
        raise DeployError("no llama-server found: build the project's with `python -m edgespec.deploy`, "
                          f"or pass its path (or set ${BIN_ENV})")
    return find_or_build(progress=progress)


def main(argv: list[str] | None = None) -> int:
    """`python -m edgespec.deploy`: find or build the project's llama.cpp, then print its folder
    (CI scripts build it before the tests; the build is cached)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        found = find_or_build()
    except DeployError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return 1
    print(found.folder)
    return 0
