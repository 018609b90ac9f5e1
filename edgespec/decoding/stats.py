"""One accumulator for decoding-step statistics, shared by the API, the server and bench."""
from __future__ import annotations

from dataclasses import dataclass, field

from edgespec.decoding.sources import family
from edgespec.decoding.speculative import StepResult

__all__ = ["GenerationStats"]


@dataclass
class GenerationStats:
    """What the steps of one generation added up to. `add` accounts each step as it ends."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    forced: int = 0  # tokens a grammar forced, committed without a target forward
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    first_token_s: float = 0.0  # prompt processing + first step
    first_step_tokens: int = 0  # what the first step committed: timed inside first_token_s
    elapsed_s: float = 0.0
    k_history: list[int] = field(default_factory=list)  # drafted tokens per step: k over time
    source_history: list[str] = field(default_factory=list)  # who drafted each step ("model", "ngram:3", "")
    accepted_history: list[int] = field(default_factory=list)  # accepted drafts per step

    def add(self, step: StepResult, now_s: float) -> None:
        """Account one decoding step that ended `now_s` seconds into the generation."""
        if self.steps == 0:
            self.first_token_s = now_s
            self.first_step_tokens = len(step.tokens)
        self.steps += 1
        self.new_tokens += len(step.tokens)
        self.drafted += step.drafted
        self.accepted += step.accepted
        self.forced += step.forced
        self.draft_ms += step.draft_ms
        self.verify_ms += step.verify_ms
        self.k_history.append(step.drafted)
        self.source_history.append(step.source)
        self.accepted_history.append(step.accepted)
        self.elapsed_s = now_s

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward (1 = no speed-up from drafting)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def decode_tokens(self) -> int:
        """Tokens committed after the first step: the ones whose time `tokens_per_s` counts."""
        return self.new_tokens - self.first_step_tokens

    @property
    def tokens_per_s(self) -> float:
        """Decode speed after the first step. A first step that committed several tokens (a draft
        accepted right after the prompt) is timed with the prompt, so its tokens are left out too."""
        decode = self.elapsed_s - self.first_token_s
        return self.decode_tokens / decode if decode > 0 and self.decode_tokens > 0 else 0.0

    def by_draft_length(self) -> dict[str, list[int]]:
        """{"<drafter kind>:<drafted>": [steps, accepted]} over the steps that drafted, the drafter
        kind being its policy key before any ":" ("model", "ngram")."""
        out: dict[str, list[int]] = {}
        for drafted, source, accepted in zip(self.k_history, self.source_history, self.accepted_history):
            if drafted:
                slot = out.setdefault(f"{family(source) if source else 'none'}:{drafted}", [0, 0])
                slot[0] += 1
                slot[1] += accepted
        return out
