"""OpenAI-compatible HTTP server for one engine (`edgespec serve`); needs the `serve` extra.

`ServerConfig` imports without it (the CLI builds its flags from it); `create_app` and
`begin_shutdown` load FastAPI when first used, `http_protocol` (uvicorn's HTTP protocol with a
time limit on request heads) uvicorn."""
from __future__ import annotations

from typing import Any

from .config import ServerConfig

__all__ = ["ServerConfig", "begin_shutdown", "create_app", "http_protocol"]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "begin_shutdown"):
        from . import app

        return getattr(app, name)
    if name == "http_protocol":
        from .protocol import http_protocol

        return http_protocol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
