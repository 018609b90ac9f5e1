"""Tiny random models of each family and their bundles, each built once per test session.

Bundles are built on first use (an export takes a fraction of a second; loading transformers
the first time a few seconds). The `zoo` fixture in conftest.py hands out one TinyZoo.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.tiny import CHATML, make_model

AGREEING = "int8"  # int8 self-draft: agrees with the target on nearly every greedy token
DISAGREEING = "int4"  # int4 self-draft: agrees on roughly 20-90% of greedy tokens here, so it rolls back
OTHER_SEED = "other"  # draft from a different-seed model of the same family: a very different distribution

# name -> make_model arguments. A tied random Gemma 3 mostly repeats its input token, which
# makes greedy decoding trivial, so the decoding tests use an untied one; "gemma3-tied" still
# checks the tied, embedding-scaled head against transformers.
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": dict(family="llama"),
    "qwen2": dict(family="qwen2", chat_template=CHATML),
    "gemma3": dict(family="gemma3", tied=False),
    "gemma3-tied": dict(family="gemma3"),
    "llama3": dict(family="llama3"),  # Llama 3.1's RoPE scaling: GGUF writes it as rope_freqs.weight
}
FAMILIES = ("llama", "qwen2", "gemma3")


class TinyZoo:
    """Tiny HF sources, their bundles and their transformers models, each built once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[tuple, Any] = {}

    def _once(self, key: tuple, build: Callable[[], Any]) -> Any:
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def source(self, name: str, seed: int = 0) -> Path:
        """HF folder of the `name` variant (seed 0 is the target)."""
        return self._once(("source", name, seed),
                          lambda: make_model(out=self.root / f"{name}-seed{seed}", seed=seed, **VARIANTS[name]))

    def bundle(self, name: str, draft: str | None = AGREEING, formats: tuple[str, ...] = ("onnx",),
               **export: Any) -> Path:
        """Bundle of the seed-0 target with `draft`: a precision ("int8", "int4") for a self-draft,
        OTHER_SEED for the seed-1 model of the same variant, or None for no draft. `formats` and
        `export` (more ExportConfig fields) make other bundles of the same model."""

        def build() -> Path:
            from edgespec.exporters.export import ExportConfig, export_bundle

            if draft is None:
                kw: dict[str, Any] = dict(draft=None)
            elif draft == OTHER_SEED:
                kw = dict(draft=self.source(name, seed=1))
            else:
                kw = dict(draft_precision=draft)
            tag = "-".join([*formats, *(f"{k}={v}" for k, v in sorted(export.items()))])
            out = self.root / f"{name}-{draft or 'nodraft'}-{tag}.bundle".replace(",", "_")
            return export_bundle(ExportConfig(output=out, target=self.source(name), formats=formats, **kw, **export))

        key = ("bundle", name, draft, formats, tuple(sorted(export.items())))
        return self._once(key, build)

    def hf_model(self, name: str):
        def build():
            import torch
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(self.source(name), dtype=torch.float32).eval()

        return self._once(("hf", name), build)

    def hf_tokenizer(self, name: str):
        def build():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.source(name))

        return self._once(("hf_tok", name), build)
