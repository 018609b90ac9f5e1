"""A Vulkan build of llama.cpp, loaded beside llama-cpp-python's CPU build in one process.

Where it comes from: the `inferna-vulkan` wheel on PyPI ships llama.cpp built with GGML_VULKAN as
plain C shared libraries in `inferna_vulkan.libs/`, renamed by auditwheel with a content hash.
Those hashed names are what let them live in the same process as llama-cpp-python's own
libllama/libggml (the dynamic linker keys loaded libraries by soname: two builds under the same
soname would resolve to whichever came first). Only the C libraries are used, never inferna's
Python extension, so any CPython can load them; the wheel itself installs on Python 3.12+, and
elsewhere `.ci/gpu` unpacks it into a folder that EDGESPEC_VULKAN_LIBS names.

The bindings are llama-cpp-python's ctypes declarations (argument and result types) re-bound to
this library's symbols: the two builds export the same llama_* functions, and the one struct
whose layout differs, `llama_context_params`, holds one pointer more before its booleans in the
Vulkan build (measured from the bytes both builds' defaults write). A build whose libllama file
is not one of KNOWN_BUILDS is refused rather than called with a layout it may not have: the file
name carries the content hash, so it names one binary.

Its ggml is built with dynamically loaded backends (GGML_BACKEND_DL): the CPU and Vulkan backends
are registered here with `ggml_backend_load`. ggml's Vulkan backend skips CPU-type devices (such
as Mesa's lavapipe, `llvmpipe`) unless GGML_VK_VISIBLE_DEVICES lists them.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from ...errors import BackendError
from ..llamacpp.runtime import route_native_log

__all__ = ["VulkanLlama", "GpuDevice", "load_vulkan_library", "find_library_dir", "LIBS_ENV", "VISIBLE_ENV",
           "KNOWN_BUILDS", "WHEEL_LIB_DIRS"]

logger = logging.getLogger(__name__)
native_logger = logging.getLogger(__name__ + ".native")

LIBS_ENV = "EDGESPEC_VULKAN_LIBS"  # a folder holding the wheel's libllama-*.so and libggml-*.so
VISIBLE_ENV = "GGML_VK_VISIBLE_DEVICES"  # ggml's own: Vulkan device indices to use, e.g. "0"
# the folders auditwheel gives the libraries of wheels carrying this build (same files in both)
WHEEL_LIB_DIRS = ("inferna_vulkan.libs", "cyllama_vulkan.libs")
# libllama file -> what it is; each entry's context-params layout is the one _context_params_type builds
KNOWN_BUILDS = {"libllama-af9aab63.so.0.7.0": "llama.cpp b11669 with GGML_VULKAN (inferna-vulkan 0.7.0)"}
INSTALL_HINT = ("pip install 'edgespec[gpu]' (Python 3.12+), or unpack the inferna-vulkan==0.7.0 wheel and set "
                f"{LIBS_ENV} to its inferna_vulkan.libs folder (.ci/gpu does this)")
# ggml_backend_dev_type
_DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL"}

_lock = threading.Lock()
_loaded: dict = {}


@dataclass(frozen=True)
class GpuDevice:
    """One device ggml's Vulkan backend registered."""

    name: str  # ggml's, e.g. "Vulkan0"
    description: str  # the driver's, e.g. "llvmpipe (LLVM 15.0.6, 256 bits)"
    kind: str  # ggml's device type: GPU, IGPU, ...

    def __str__(self) -> str:
        return f"{self.name}: {self.description}"


def find_library_dir() -> Path:
    """The folder holding the Vulkan build: EDGESPEC_VULKAN_LIBS, else an installed wheel's."""
    env = os.environ.get(LIBS_ENV)
    if env:
        path = Path(env)
        if not path.is_dir():
            raise BackendError(f"{LIBS_ENV}={env} is not a folder")
        return path
    for entry in sys.path:
        for name in WHEEL_LIB_DIRS:
            path = Path(entry or ".") / name
            if path.is_dir():
                return path
    raise BackendError(f"no Vulkan build of llama.cpp found: {INSTALL_HINT}")


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if not found:
        raise BackendError(f"{folder} has no {pattern}: not a Vulkan build of llama.cpp ({INSTALL_HINT})")
    return found[0]


def _context_params_type(cpu_struct: type[ctypes.Structure]) -> type[ctypes.Structure]:
    """llama-cpp-python's llama_context_params with the pointer this build adds before the booleans."""
    fields = list(cpu_struct._fields_)
    names = [n for n, *_ in fields]
    if "embeddings" not in names:
        raise BackendError("llama-cpp-python's llama_context_params is not the layout this backend binds")
    at = names.index("embeddings")

    class VulkanContextParams(ctypes.Structure):
        _fields_ = fields[:at] + [("_vulkan_build_pointer", ctypes.c_void_p)] + fields[at:]

    return VulkanContextParams


class VulkanLlama:
    """The llama_* functions of the Vulkan build under llama-cpp-python's declarations, plus its
    devices. Functions are bound on first use; `llama_log_callback` is the callback type."""

    def __init__(self, folder: Path) -> None:
        try:
            import llama_cpp as declarations
        except ImportError as e:
            raise BackendError("the Vulkan backend uses llama-cpp-python's declarations: "
                               "pip install 'edgespec[llamacpp]'") from e
        except OSError as e:
            raise BackendError(f"llama-cpp-python cannot load llama.cpp: {str(e).splitlines()[0]}") from e
        self.folder = folder
        llama_file = _one(folder, "libllama-*.so*")
        if llama_file.name not in KNOWN_BUILDS:
            raise BackendError(f"{llama_file.name} is a llama.cpp build this backend has not checked the ABI of; "
                               f"known: {', '.join(KNOWN_BUILDS)} ({INSTALL_HINT})")
        self.build = KNOWN_BUILDS[llama_file.name]
        self._decl = declarations
        try:
            # dependencies first, by path: the libraries name each other by their hashed sonames
            self._base = ctypes.CDLL(str(_one(folder, "libggml-base-*.so*")))
            self._ggml = ctypes.CDLL(str(_one(folder, "libggml-[0-9a-f]*.so*")))
            self._llama = ctypes.CDLL(str(llama_file))
        except OSError as e:
            raise BackendError(f"cannot load the Vulkan build of llama.cpp: {str(e).splitlines()[0]}") from e
        self.llama_log_callback = declarations.llama_log_callback
        self._ctx_params = _context_params_type(declarations.llama_context_params)
        self._bind_ggml()
        self.backends: list[str] = []  # ggml backends registered (load_backends)

    def _bind_ggml(self) -> None:
        g, b = self._ggml, self._base
        g.ggml_backend_load.argtypes, g.ggml_backend_load.restype = [ctypes.c_char_p], ctypes.c_void_p
        g.ggml_backend_dev_count.argtypes, g.ggml_backend_dev_count.restype = [], ctypes.c_size_t
        g.ggml_backend_dev_get.argtypes, g.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
        for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(b, fn).argtypes, getattr(b, fn).restype = [ctypes.c_void_p], ctypes.c_char_p
        b.ggml_backend_dev_type.argtypes, b.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int

    def load_backends(self) -> None:
        """Register the build's CPU and Vulkan backends with its ggml (once, before any model)."""
        folder, loaded = self.folder, []
        for name in ("cpu", "vulkan"):
            # the Vulkan backend registers only when a Vulkan loader (libvulkan.so.1) is there
            if self._ggml.ggml_backend_load(str(_one(folder, f"libggml-{name}-*.so*")).encode()):
                loaded.append(name)
            else:
                logger.info("ggml could not load its %s backend from %s", name, folder)
        if "cpu" not in loaded:
            raise BackendError(f"the Vulkan build of llama.cpp in {folder} cannot load its CPU backend")
        self.backends = loaded

    def __getattr__(self, name: str):
        if not name.startswith("llama_"):
            raise AttributeError(name)
        declared = getattr(self._decl, name)
        fn = getattr(self._llama, name)
        fn.argtypes, fn.restype = list(declared.argtypes or []), declared.restype
        if name == "llama_context_default_params":
            fn.restype = self._ctx_params
        elif name == "llama_init_from_model":
            fn.argtypes = [fn.argtypes[0], self._ctx_params]
        setattr(self, name, fn)  # bound once
        return fn

    def devices(self) -> list[GpuDevice]:
        """The devices ggml's Vulkan backend registered, in its order."""
        out = []
        for i in range(self._ggml.ggml_backend_dev_count()):
            dev = self._ggml.ggml_backend_dev_get(i)
            name = (self._base.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace")
            if name.startswith("Vulkan"):
                out.append(GpuDevice(name, (self._base.ggml_backend_dev_description(dev) or b"").decode(
                    "utf-8", "replace"), _DEVICE_TYPES.get(self._base.ggml_backend_dev_type(dev), "?")))
        return out


def load_vulkan_library() -> VulkanLlama:
    """Load the Vulkan build once: route its C logging to a Python logger, init the backend."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib = VulkanLlama(find_library_dir())

        # before the backends: they log as they register; the callback lives as long as the library
        _loaded["log_cb"] = route_native_log(lib, native_logger)
        lib.load_backends()
        lib.llama_backend_init()
        _loaded["lib"] = lib
        return lib
