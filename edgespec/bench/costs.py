"""c(B): what a B-token forward of the target costs over a one-token forward, measured.

A speculative step verifies k drafts in one forward of k+1 tokens; it pays when the tokens it
commits outnumber c(k+1). Devices differ most in this curve (a GPU-less ARM core pays nearly B
times, a wide AVX-512 core far less), so the bench records it for fleet comparisons. The
measurement lives with the engine's tuner (edgespec/engine/tuning.py), which picks the backend and draft
body from the same curve; the bench records the one of the engine it runs.
"""
from __future__ import annotations

from ..engine.tuning import WIDTHS, verify_costs

__all__ = ["verify_costs", "WIDTHS"]
