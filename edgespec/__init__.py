"""edgespec: on-device LLM inference with lossless speculative decoding.

    import edgespec
    with edgespec.load() as engine:          # the embedded Gemma 3 270M bundle
        print(engine.generate("The capital of France is", max_tokens=16))
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__", "load", "default_bundle", "Engine", "EngineConfig", "Response", "GenerationStats",
           "ChatSession", "SamplingParams", "EdgespecError", "ConfigError", "BundleError", "BackendError", "BusyError",
           "EngineClosedError", "GrammarError", "ResponseFormat", "share_threads"]

_LAZY = {
    **{name: "edgespec.engine.engine" for name in ("load", "default_bundle", "Engine", "Response")},
    "GenerationStats": "edgespec.decoding", "EngineConfig": "edgespec.engine.config",
    "ChatSession": "edgespec.engine.session", "SamplingParams": "edgespec.decoding",
    "ResponseFormat": "edgespec.decoding.grammar",
    "share_threads": "edgespec.runtimes.onnxruntime.pool",
    **{name: "edgespec.errors" for name in ("EdgespecError", "ConfigError", "BundleError", "BackendError",
                                             "BusyError", "EngineClosedError", "GrammarError")},
}


def __getattr__(name: str):
    # lazy, so `edgespec --help` and `import edgespec` stay cheap on small devices
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'edgespec' has no attribute {name!r}")
