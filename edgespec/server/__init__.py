"""OpenAI-compatible HTTP server for one engine (`edgespec serve`); needs the `serve` extra."""
from __future__ import annotations

from .app import ServerConfig, begin_shutdown, create_app

__all__ = ["ServerConfig", "begin_shutdown", "create_app"]
