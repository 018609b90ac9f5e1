"""A bundle build under a memory budget: each costly phase's need checked before it runs.

The first run of `edgespec chat --memory-budget SIZE` builds the default bundle before it opens
it, so the budget covers the build too. The build streams (gguf/deferred.py, onnx/external.py):
what it holds beyond the process as it stands is one phase's working set, and each is known from
the files before the phase starts:

- writing a model: the largest matrix transcoded (one row transcoded, times the rows) and the
  chunk it is read in;
- VocabTrim calibration: an onnxruntime session on the written target (its files, as the memory
  planner estimates a model before loading it: memory/footprint.estimate_fixed), its KV cache
  and a logits row;
- before anything is read, the tokenizer (from the vocabulary's length) and the calibration
  (from the GGUF file's size) together.

A phase whose need, added to the resident set as it is then (the heap trimmed first), passes the
budget stops the build with a MemoryBudgetError naming both figures and the way out; nothing is
left behind (the staging folder is removed).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..errors import MemoryBudgetError
from ..memory.budget import format_bytes
from ..memory.footprint import estimate_fixed, kv_bytes_per_token
from ..memory.measure import rss_bytes, trim_heap

__all__ = ["BuildBudget", "CALIBRATION_KV_TOKENS", "SOURCE_GROWTH", "TOKENIZER_BYTES_PER_TOKEN"]

logger = logging.getLogger(__name__)

CALIBRATION_KV_TOKENS = 1024  # the calibration runtime's KV capacity (exporters/export._calibration_runtime)
# transcoded ONNX weights against the GGUF's bytes: 8-bit codes for 5- and 6-bit types, float scales
# (Gemma 3 270M Q4_K_M: 297 MB of ONNX data from a 253 MB file)
SOURCE_GROWTH = 1.25
# what the exporter's tokenizer holds per vocabulary entry while the bundle is built (its vocabulary,
# merges and added tokens in tokenizers' Rust structures, and the token strings): measured ~580 bytes
# on Gemma 3's 262k-token SentencePiece vocabulary
TOKENIZER_BYTES_PER_TOKEN = 600


@dataclass(frozen=True)
class BuildBudget:
    """`budget` bytes for the whole process while a bundle is built (None: no budget)."""

    budget: int | None = None

    def check(self, what: str, need: int) -> None:
        """Raise MemoryBudgetError unless `need` more bytes fit beside what the process holds now."""
        if self.budget is None:
            return
        trim_heap()  # what was freed goes back first: the resident set is what is really in use
        have = rss_bytes()
        logger.debug("build budget: %s needs %s beside %s (budget %s)", what, format_bytes(need), format_bytes(have),
                     format_bytes(self.budget))
        if have + need > self.budget:
            raise MemoryBudgetError(
                f"building the bundle needs about {format_bytes(have + need)} for {what}, more than --memory-budget "
                f"{format_bytes(self.budget)}: raise the budget for this first run, or build the bundle elsewhere "
                "(`edgespec export -o DIR`) and copy it here")

    def check_source(self, path: Path) -> None:
        """Before any work: the tokenizer held through the build and the calibration session beside
        it, estimated from the GGUF itself (its size, its vocabulary's length)."""
        if self.budget is None or not path.is_file() or path.suffix.lower() != ".gguf":
            return
        from .gguf.reader import open_gguf

        tokens = open_gguf(path).fields.get("tokenizer.ggml.tokens")
        n_tokens = len(tokens.value) if tokens is not None and isinstance(tokens.value, list) else 0
        self.check("the build (its tokenizer and the VocabTrim calibration)",
                   n_tokens * TOKENIZER_BYTES_PER_TOKEN + estimate_fixed(int(path.stat().st_size * SOURCE_GROWTH)))

    def check_matrices(self, weights, role: str) -> None:
        """Before a model is written: its largest matrix transcoded, and one chunk of the file."""
        from .gguf.deferred import CHUNK_BYTES, LazyTensors

        if self.budget is not None and isinstance(weights, LazyTensors):
            self.check(f"writing the {role}", weights.largest_bytes() + 4 * CHUNK_BYTES)

    def check_session(self, data_file: Path, spec) -> None:
        """Before the calibration opens the written target: its weights, KV cache and logits."""
        if self.budget is None:
            return
        kv = CALIBRATION_KV_TOKENS * kv_bytes_per_token(spec.n_layers, spec.n_kv_heads, spec.head_dim)
        self.check("the VocabTrim calibration", estimate_fixed(data_file.stat().st_size) + kv + 8 * spec.vocab_size)
