"""Backends behind one interface; looked up by name and imported only when used."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .base import Capabilities, Runtime

__all__ = ["Capabilities", "Runtime", "BackendInfo", "BACKENDS", "open_runtime"]


@dataclass(frozen=True)
class BackendInfo:
    name: str
    bundle_format: str  # which artifact of a bundle this backend runs
    module: str
    cls: str
    extra: str  # pip extra that installs it


BACKENDS: dict[str, BackendInfo] = {
    "onnxruntime": BackendInfo("onnxruntime", "onnx", "edgespec.runtimes.onnxruntime", "OnnxRuntime", "onnx"),
}


def open_runtime(backend: str, model_path: Path, **kwargs) -> Runtime:
    """Instantiate `backend` on one model file."""
    info = BACKENDS.get(backend)
    if info is None:
        raise ConfigError(f"unknown backend '{backend}' (available: {', '.join(BACKENDS)})")
    cls = getattr(importlib.import_module(info.module), info.cls)
    return cls(model_path, **kwargs)
