"""The memory model of speculative decoding (after SpecMemo, arXiv 2506.01986).

A process running a target and a draft holds (a draft on the target's body holds only its head:
no KV cache, no forward scratch of its own):
  base        the interpreter, libraries and tokenizer (measured before the models load)
  fixed       per model: its weights as the backend holds them plus the runtime's own buffers
              (measured at load: RSS before/after opening it and one warm-up forward)
  kv          per model: positions x layers x KV heads x head dim x 2 (K and V) x dtype bytes,
              except that a sliding-window layer held in a window-sized buffer (onnxruntime,
              docs/long-context.md) counts that buffer's rows at most, whatever the context
  candidates  logits of one step: (k+1) x vocab for the target's verify, k x K for a draft with
              a K-token (VocabTrim) head; sampling adds one target row's selection scratch or
              float32 exps, and each draft row's float32 exps (decoding/token_dist.py)
  workspace   per model: scratch activations of its largest forward (a prefill chunk over the
              whole context), held by the backend's allocator once touched
All functions here are pure; numbers are bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ALLOCATOR_SLACK", "KV_DTYPE_BYTES", "Shapes", "ModelMemory", "kv_bytes_per_token", "workspace_bytes",
           "candidate_bytes", "estimate_fixed"]

# prompts fed in chunks over a growing context ask the allocator for ever larger blocks, which
# fragments it beyond what one probe forward touches, as measured on onnxruntime's arena (now off;
# under a budget glibc's mmap threshold is fixed, heap.fixed_mmap_threshold); that excess is kept
# as the margin for allocators that keep what they free (docs/memory-budgets.md)
ALLOCATOR_SLACK = 0.3

# bytes per cached element; block-quantized llama.cpp types include their scales
KV_DTYPE_BYTES: dict[str, float] = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "f32": 4.0, "f16": 2.0,
                                    "q8_0": 34 / 32, "q4_0": 18 / 32}


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: str = "float32") -> int:
    """layers x KV heads x head dim x 2 (K and V) x dtype bytes."""
    return int(round(n_layers * n_kv_heads * head_dim * 2 * KV_DTYPE_BYTES[dtype]))


@dataclass(frozen=True)
class Shapes:
    """A decoder's sizes, enough to bound the scratch memory of one forward."""

    hidden: int
    n_heads: int
    intermediate: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab: int

    def __post_init__(self) -> None:
        if min(self.hidden, self.n_heads, self.intermediate, self.n_layers, self.n_kv_heads, self.head_dim,
               self.vocab) < 1:
            raise ValueError(f"model sizes must be positive: {self}")


def workspace_bytes(s: Shapes, n_new: int, n_ctx: int) -> int:
    """Peak scratch of one fp32 forward of `n_new` tokens attending over `n_ctx` positions.

    Activations live one layer at a time: the residual stream and norms (~6 x hidden per token),
    the MLP (gate, up, product: 3 x intermediate), query/attention output (2 x heads x head dim),
    attention scores, masked scores and softmax (3 x heads x n_ctx), the additive masks (2 layer
    types x n_ctx) and the layer's K/V over the whole context in the layout attention reads
    (concatenated and transposed: 4 x KV heads x head dim x n_ctx). A sliding-window layer bound
    only its window (docs/long-context.md) reads less, but layers run one at a time and a
    full-attention layer's forward is the peak, so the whole context stays the bound."""
    per_token = 6 * s.hidden + 3 * s.intermediate + 2 * s.n_heads * s.head_dim + (3 * s.n_heads + 2) * n_ctx
    floats = n_new * per_token + 4 * s.n_kv_heads * s.head_dim * n_ctx
    return 4 * floats


def _along(points: list[tuple[int, int]], est: int) -> float:
    """Measured scratch at an estimate of `est`, from (estimate, measured) probe points sorted by
    estimate: a line through the two outer points where they rise (what a runtime holds whatever
    the shape stays as it is, and only what grows is scaled), else the largest point scaled."""
    (e1, m1), (e2, m2) = points[0], points[-1]
    if e2 > e1 and m2 > m1:
        return m1 + (m2 - m1) * (est - e1) / (e2 - e1)
    return m2 * est / e2 if e2 else m2


def candidate_bytes(k: int, target_vocab: int, draft_vocab: int | None, sampling: bool = True) -> int:
    """Logits (and, when sampling, distributions) of one speculative step with up to k drafts.

    Target: (k+1) x vocab fp32 logits (a reused buffer). Draft: k x K fp32 logit rows. Sampling
    builds the target's distributions one row at a time, the largest being either the top-k /
    top-p selection (argpartition's int64 indices and a bool mask: 9 bytes a token) or, for pure
    temperature, float32 exps, a float32 residual and a draft row placed in target ids (12 bytes
    a token); each draft row keeps its float32 exps (K wide) until the verify. No float64 row of
    the vocabulary is built."""
    rows = k + 1
    b = 4 * rows * target_vocab
    if draft_vocab is not None and k > 0:
        b += 4 * k * draft_vocab
        if sampling:
            b += 4 * k * draft_vocab
    if sampling:
        b += 12 * target_vocab
    return b


def estimate_fixed(file_bytes: int, fp32_matmul_fraction: float = 0.0) -> int:
    """A model's fixed bytes before it is loaded: its files, plus the packed copies onnxruntime
    makes of fp32 matmul weights (`fp32_matmul_fraction` of the file). Loading measures it."""
    return int(file_bytes * (1.0 + fp32_matmul_fraction))


@dataclass(frozen=True)
class ModelMemory:
    """One model (target or draft) as the planner sees it."""

    role: str
    fixed: int  # weights as held + runtime overhead
    kv_per_token: dict[str, int]  # per KV dtype the backend allows, preferred first
    vocab: int  # logits row width (K for a trimmed draft)
    shapes: Shapes | None = None
    measured: bool = False  # fixed was measured at load (else estimated from files)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # (n_new, n_ctx, bytes): scratch measured by one probe forward at load, or None
    scratch: tuple[int, int, int] | None = None
    # (share of kv_per_token on window-sized buffers, rows they hold): those layers' KV stops
    # growing at that many positions (runtimes/onnxruntime/kv.KVPlan.sliding_kv); (0.0, 0): none
    sliding: tuple[float, int] = (0.0, 0)
    # the same, measured first at the lower bounds' own shape (MIN_CHUNK tokens over MIN_CONTEXT),
    # so the bounds do not depend on how roomy the budget was
    bound_scratch: tuple[int, int, int] | None = None
    # a draft reading the target's body through its own head (runtimes/shared_body.py): `fixed` is
    # its head; it holds no KV cache and runs no forward of its own (the body's are the target's)
    shares_body: bool = False

    def __post_init__(self) -> None:
        least = 0 if self.shares_body else 1
        if self.fixed < 0 or not self.kv_per_token or min(self.kv_per_token.values()) < least:
            raise ValueError(f"bad memory figures for the {self.role}: {self}")
        share, rows = self.sliding
        if not 0.0 <= share <= 1.0 or rows < 0 or (share > 0) != (rows > 0):
            raise ValueError(f"bad window-sized KV for the {self.role}: {self.sliding}")

    @property
    def kv_dtypes(self) -> tuple[str, ...]:
        return tuple(self.kv_per_token)

    def kv(self, dtype: str, positions: int) -> int:
        """KV bytes at `positions` of context: the full-attention layers' per position, the
        window-sized ones' up to their rows."""
        share, rows = self.sliding
        return int(round(self.kv_per_token[dtype] * ((1 - share) * positions + share * min(positions, rows))))

    def workspace(self, n_new: int, n_ctx: int) -> int:
        """Scratch held for forwards of up to n_new tokens over n_ctx positions, with
        ALLOCATOR_SLACK: the estimate, or once probed, the probes' measured peaks carried to this
        shape along the estimate (scaled from one probe, a line through two), never below a peak
        measured at a larger shape's probe (an allocator may keep what it took)."""
        if self.shares_body:  # its hidden rows come from the target's forwards, its logits are candidates
            return 0
        est = workspace_bytes(self.shapes, n_new, n_ctx) if self.shapes else 0
        if self.scratch is None:
            return est
        probes = {self.scratch, *([self.bound_scratch] if self.bound_scratch else [])}
        points = sorted((workspace_bytes(self.shapes, p_new, p_ctx) if self.shapes else 0, took)
                        for p_new, p_ctx, took in probes)
        return int(max(_along(points, est), max(took for _, took in points)) * (1 + ALLOCATOR_SLACK))
