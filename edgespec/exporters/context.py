"""The trained context of a source model, recorded in the manifest at export so a context asked
for past it is refused when the bundle opens (engine/context.py)."""
from __future__ import annotations

from typing import Any

__all__ = ["trained_context"]


def trained_context(model: Any) -> int | None:
    """The trained context of a loaded source model: its config's (or a multimodal config's text
    part's) `max_position_embeddings`, which the GGUF reader fills from `<arch>.context_length`.
    None when the config does not say, or says something that is not a positive count."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    n = getattr(cfg, "max_position_embeddings", None)
    return n if type(n) is int and n >= 1 else None
