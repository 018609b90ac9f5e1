"""Memory budgets (SpecMemo-style): a footprint model, lower bounds, and a planner that picks
KV capacity, maximum draft length, KV dtype and whether the draft model stays."""
from edgespec.memory.budget import format_bytes, parse_bytes
from edgespec.memory.footprint import (
    KV_DTYPE_BYTES,
    ModelMemory,
    Shapes,
    candidate_bytes,
    estimate_fixed,
    kv_bytes_per_token,
    workspace_bytes,
)
from edgespec.memory.planner import (
    MAX_CONTEXT,
    MIN_CONTEXT,
    PREFILL_CHUNK,
    Bounds,
    Plan,
    describe_plan,
    lower_bounds,
    plan_memory,
)

__all__ = [
    "KV_DTYPE_BYTES",
    "MAX_CONTEXT",
    "MIN_CONTEXT",
    "PREFILL_CHUNK",
    "Bounds",
    "ModelMemory",
    "Plan",
    "Shapes",
    "candidate_bytes",
    "describe_plan",
    "estimate_fixed",
    "format_bytes",
    "kv_bytes_per_token",
    "lower_bounds",
    "parse_bytes",
    "plan_memory",
    "workspace_bytes",
]
