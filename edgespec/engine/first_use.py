"""The bundle a first run builds: the embedded default model's, exported once into the user
cache, in the format the chosen backend runs."""
from __future__ import annotations

from pathlib import Path

from ..progress import task
from ..runtimes import BACKENDS
from ..staging import built_once
from .config import EngineConfig

__all__ = ["default_bundle", "first_use_format"]


def default_bundle(fmt: str = "onnx", memory_budget: int | None = None) -> Path:
    """The default bundle in format `fmt`, exported from the embedded Gemma 3 270M the first time
    (within `memory_budget` bytes for the whole process, where one is given)."""
    from ..models.catalog import DEFAULT_PRESET, default_bundle_path

    path = default_bundle_path(DEFAULT_PRESET, fmt)
    if path.exists():
        return path
    with built_once(path):  # a second first run waits for this one and takes its bundle
        if not path.exists():
            from ..exporters.export import ExportConfig, export_bundle
            from ..runtimes.heap import trim_heap

            with task(f"building the default bundle in {path} (one time, a few minutes)", announce=True):
                # a GGUF target shares the assembled file (written by rename, never in place) by a link
                export_bundle(ExportConfig(output=path, formats=(fmt,), share_source=True, memory_budget=memory_budget))
            trim_heap()  # the build's freed pages back to the OS before the engine measures what it holds
    return path


def first_use_format(config: EngineConfig) -> str:
    """The format a bundle built on first use is exported in: the one the named backend runs
    (a GGUF run on llama.cpp stays GGUF), else ONNX, which the default backend runs."""
    return BACKENDS[config.backend].bundle_format if config.backend in BACKENDS else "onnx"
