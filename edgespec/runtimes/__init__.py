"""Backends behind one interface; looked up by name and imported only when used.

A backend is one folder plus one row of BACKENDS: `runtimes/<name>/runtime.py` defines its Runtime
class and `available_devices() -> list[str]`, and where it can run a draft on the target's body, a
module of the same folder (`split.py`) defines `open_shared_pair`. What backends share (the Runtime
contract, the exactness probe, lazily mapped tables, the shared-body pair) stays in `runtimes/`.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .base import Capabilities, Runtime

__all__ = ["Capabilities", "Runtime", "BackendInfo", "BACKENDS", "backend_info", "open_runtime", "installed_backends",
           "backend_devices", "pick_backend", "runtime_class", "open_shared_pair", "probe_exactness",
           "exact_mode_memory", "backend_version"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendInfo:
    name: str  # also its folder, runtimes/<name>/
    bundle_format: str  # which artifact of a bundle this backend runs
    cls: str  # its Runtime class, in runtimes/<name>/runtime.py
    extra: str  # pip extra that installs it
    package: str  # the import name of the library it wraps (checked without importing it)
    # "module:function" opening (target, draft) runtimes on one body, the draft reading it through
    # its own head (runtimes/shared_body.py), the module named within the backend's folder (or in
    # full); None: the backend cannot
    shared_body: str | None = None
    # runtime options of slower modes that are exact where the default is not (a verify rounding
    # unlike one-token forwards), in the order the engine tries them when its probe asks
    exact_modes: tuple[dict, ...] = ()
    # the backend has a static-shape mode (as NPUs need): it takes `static` and the fixed forward
    # `width`, and turns the mode on by itself on a device that needs it, so it always gets the width
    static_shapes: bool = False
    # runtime options for a model whose forwards alternate with another model's in this process
    # (a separate draft and its target): e.g. threads that must not spin-wait between runs
    alternating: dict = field(default_factory=dict)
    # it drives devices besides the CPU (GPU, NPU, AUTO): naming such a device picks it
    accelerators: bool = False

    @property
    def module(self) -> str:
        """The module holding the Runtime class and `available_devices`."""
        return f"{__name__}.{self.name}.runtime"

    def shared_body_opener(self):
        """The function opening a (target, draft) pair on one body; None where there is none."""
        if self.shared_body is None:
            return None
        module, fn = self.shared_body.split(":")
        return getattr(importlib.import_module(module if "." in module else f"{__name__}.{self.name}.{module}"), fn)

    def static_options(self, static: bool, width: int) -> dict:
        """Runtime options for the static-shape mode (none where the backend has no such mode)."""
        return {"static": static, "width": width} if self.static_shapes else {}


# order = preference when a bundle holds several formats and no backend is named
BACKENDS: dict[str, BackendInfo] = {
    "onnxruntime": BackendInfo("onnxruntime", "onnx", "OnnxRuntime", "onnx", "onnxruntime", "split:open_shared_pair",
                               # a one-row MatMulNBits with int8 activations rounds unlike a taller
                               # one (whole logits apart on Gemma 3 270M): no forward of one row
                               exact_modes=({"pad_rows": True},),
                               # its threads spin-wait between runs by default, which starves the other model
                               alternating={"spin": False}),
    "openvino": BackendInfo("openvino", "openvino", "OpenVinoRuntime", "openvino", "openvino", "split:open_shared_pair",
                            # CPUs whose one-row FullyConnected rounds unlike a taller one (AVX2 with
                            # int8/int4 weights): no forward computes fewer than two rows
                            exact_modes=({"pad_rows": True},), static_shapes=True, accelerators=True),
    "llamacpp": BackendInfo("llamacpp", "gguf", "LlamaCppRuntime", "llamacpp", "llama_cpp"),
    # llama.cpp's Vulkan build from the inferna-vulkan wheel, beside the CPU build above
    "llamacpp_vulkan": BackendInfo("llamacpp_vulkan", "gguf", "LlamaCppVulkanRuntime", "gpu", "inferna",
                                   accelerators=True),
}


def installed_backends() -> list[str]:
    """Backends whose library is importable here, in preference order."""
    return [n for n, b in BACKENDS.items() if importlib.util.find_spec(b.package) is not None]


def backend_devices(backend: str) -> list[str]:
    """Devices `backend` sees on this machine (imports the backend)."""
    return list(importlib.import_module(backend_info(backend).module).available_devices())


def pick_backend(formats, backend: str | None = None, installed: list[str] | None = None) -> str:
    """`backend` if given (checked), else the first installed backend that runs one of `formats`
    (`installed`: the backends installed here, default: looked up)."""
    if backend is not None:
        backend_info(backend)
        return backend
    installed = installed_backends() if installed is None else installed
    for name in installed:
        if BACKENDS[name].bundle_format in formats:
            return name
    need = ", ".join(f"{n} (pip install 'edgespec[{b.extra}]')" for n, b in BACKENDS.items()
                     if b.bundle_format in formats)
    raise ConfigError(f"no installed backend runs this bundle's formats ({', '.join(formats)}); install one of: "
                      f"{need or 'none known'}")


def backend_info(backend: str) -> BackendInfo:
    """The registry row of `backend`; a ConfigError naming the known ones if there is none."""
    info = BACKENDS.get(backend)
    if info is None:
        raise ConfigError(f"unknown backend '{backend}' (available: {', '.join(BACKENDS)})")
    return info


def runtime_class(backend: str) -> type[Runtime]:
    """The Runtime class of `backend` (imports the backend), e.g. to read its kv_dtypes."""
    info = backend_info(backend)
    return getattr(importlib.import_module(info.module), info.cls)


def open_runtime(backend: str, model_path: Path, **kwargs) -> Runtime:
    """Instantiate `backend` on one model file; kwargs: threads, device, and backend options."""
    info = backend_info(backend)
    cls = getattr(importlib.import_module(info.module), info.cls)
    return cls(model_path, **kwargs)


def open_shared_pair(backend: str, target_path: Path, draft_path: Path, **kwargs) -> tuple[Runtime, Runtime]:
    """(target, draft) runtimes sharing the target's body: the draft artifact gives only its head.
    kwargs: threads, device, kv_capacity, and the backend's own (openvino: wide)."""
    info = backend_info(backend)
    opener = info.shared_body_opener()
    if opener is None:
        raise ConfigError(f"backend {backend} cannot run a draft on the target's body; use --draft-body own")
    return opener(target_path, draft_path, **kwargs)


def backend_version(backend: str) -> str:
    """The installed version of the backend's package, "?" if it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(backend_info(backend).package.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return "?"


def exact_mode_memory(backend: str, model_files: list[Path], options: dict):
    """(recall, remember): the runtime options an engine with these `options` settled on for these
    models on this machine last time, and a function storing the ones it settles on now."""
    from .exactness import remember_mode, remembered_mode

    version = backend_version(backend)
    known = ({}, *backend_info(backend).exact_modes)

    def recall() -> dict | None:
        mode = remembered_mode(backend, version, model_files, options)
        if mode is not None and mode not in known:  # an edited or foreign entry: settle the mode again
            logger.warning("discarding a remembered exact mode %s that %s does not have", mode, backend)
            return None
        return mode

    return recall, lambda mode: remember_mode(backend, version, model_files, options, mode)


def probe_exactness(backend: str, rt: Runtime, model_files: list[Path], max_width: int, *, threads: int | None = None,
                    retune: bool = False, reach: int | None = None):
    """Which verify widths of `rt` are bit-identical to one-token forwards on this machine, up to
    `reach` keys (None: the probe's default; runtimes/exactness.py), probed once per machine,
    backend build, model file and options."""
    from .exactness import PROBE_REACH, probe_cached

    version = backend_version(backend)
    options = {"threads": threads, **rt.kernel_options()}
    return probe_cached(rt, max_width, backend=backend, version=version, model_files=model_files, options=options,
                        retune=retune, reach=reach or PROBE_REACH)
