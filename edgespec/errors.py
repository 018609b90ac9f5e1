"""Typed, user-facing errors: the CLI prints their message on one line and exits non-zero."""
from __future__ import annotations

__all__ = ["EdgespecError", "ConfigError", "BundleError", "ExportError", "BackendError", "BusyError",
           "EngineClosedError", "MemoryBudgetError", "ContextFullError", "DeployError", "GrammarError"]


class EdgespecError(Exception):
    """Base of every error whose message is meant for the user as it is."""


class ConfigError(EdgespecError, ValueError):
    """An option or option combination is invalid."""


class BundleError(EdgespecError):
    """A bundle folder or its manifest is missing, broken or inconsistent."""


class ExportError(EdgespecError):
    """A source model cannot be exported."""


class BackendError(EdgespecError):
    """A backend failed to load or run a model, or cannot do what was asked."""


class BusyError(EdgespecError):
    """The engine is already generating; one generation per engine at a time."""


class EngineClosedError(EdgespecError):
    """The engine was closed; load the bundle again to generate."""


class MemoryBudgetError(ConfigError):
    """A memory budget is malformed or too small to run the model at all."""


class ContextFullError(EdgespecError):
    """A forward would write past the KV cache's fixed capacity."""


class DeployError(EdgespecError):
    """llama.cpp's server cannot be built, found, configured or started for a bundle."""


class GrammarError(ConfigError):
    """A response format that cannot be compiled or followed, or a reply too short to complete it."""
