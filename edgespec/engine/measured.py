"""What the tuner (tuning.py) measured and chose, as values: one candidate's step costs
(`Measurement`), the choice (`Tuned`) and the record of both (`Tuning`).

The plan (assembly.py) carries a `Tuned` and a `Tuning`, and the tuner builds its candidates'
plans: the values live here, apart from both, so that neither imports the other.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import mean

from ..checks import integer, number
from ..decoding.policy import expected_tokens, isotonic

__all__ = ["ACCEPTANCES", "DRAFT_LENGTHS", "WIDTHS_SHOWN", "Measurement", "Tuned", "Tuning"]

ACCEPTANCES = (0.5, 0.7, 0.9)  # the cost policy's prior .. a self-draft on grounded prompts (BENCHMARKS.md)
DRAFT_LENGTHS = (0, 1, 2, 4, 8, 16)  # k measured (verify width k+1), within the exact widths
WIDTHS_SHOWN = tuple(k + 1 for k in DRAFT_LENGTHS[1:])


@dataclass(frozen=True)
class Tuned:
    """What the tuner (tuning.py) measured fastest here: it fills what the config leaves open."""

    backend: str
    draft_body: str | None  # "shared" or "own"; None: no draft model
    verify_width: int  # the widest verify worth running here (within the exact widths)


@dataclass(frozen=True)
class Measurement:
    """What a speculative step costs with one candidate configuration on this machine."""

    backend: str
    draft_body: str | None  # "shared", "own", None: no draft model
    free: bool  # the drafter has a source that drafts for free too (prompt lookup, Token Recycling)
    one_token_ms: float  # a plain step
    draft_ms: float  # one token drafted by the draft model (0.0: no draft model)
    verify_ms: dict[int, float]  # verify width B (exact here) -> a verify of B tokens after B-1 drafts
    exact_width: int  # the widest exact verify (the probe's; 1: none)
    measure_ms: float  # what measuring took when it ran
    cached: bool = False

    @property
    def name(self) -> str:
        return self.backend + (f", draft body {self.draft_body}" if self.draft_body else "")

    @property
    def draft_costs(self) -> tuple[float, ...]:
        """ms per drafted token of each source the drafter draws on: the draft model's, and 0.0
        for a free one (none: plain decoding)."""
        return (self.draft_ms,) * (self.draft_body is not None) + (0.0,) * self.free

    @property
    def curve(self) -> dict[int, float]:
        """Forward width -> ms: 1 (a plain step) and the verify widths, made non-decreasing in
        width (isotonic fit): a wider forward does not cost less, whatever a noisy sample says."""
        widths = [1, *sorted(self.verify_ms)]
        return dict(zip(widths, isotonic([self.one_token_ms, *(self.verify_ms[b] for b in widths[1:])])))

    def step_ms(self, k: int, draft_ms: float, curve: dict[int, float] | None = None) -> float:
        """A step drafting k tokens at `draft_ms` each, then their verify (k = 0: a plain step)."""
        return k * draft_ms + (curve or self.curve)[k + 1]

    def best(self, alpha: float, draft_ms: float) -> tuple[int, float]:
        """(k, expected tokens/s) of the best draft length of a source drafting at `draft_ms` per
        token with acceptance `alpha`, among the measured (exact) widths."""
        curve = self.curve
        rates = {b - 1: 1e3 * expected_tokens(alpha, b - 1) / self.step_ms(b - 1, draft_ms, curve) for b in curve}
        k = max(rates, key=lambda n: (rates[n], -n))
        return k, rates[k]

    def score(self) -> float:
        """Expected tokens/s: each source's best draft length's, averaged over ACCEPTANCES and
        the sources (as if each drafted half the steps); plain decoding's without a source."""
        costs = self.draft_costs
        if not costs:
            return 1e3 / self.curve[1]
        return mean(self.best(a, d)[1] for a in ACCEPTANCES for d in costs)

    def width(self) -> int:
        """The widest verify worth running: the best of any source at the highest acceptance (at
        least 2, so that drafting stays possible where a policy finds it pays)."""
        return max([2, *(self.best(ACCEPTANCES[-1], d)[0] + 1 for d in self.draft_costs)])

    def to_dict(self) -> dict:
        out = asdict(self)
        out["verify_ms"] = {str(b): ms for b, ms in self.verify_ms.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Measurement:
        """A cached record, validated as a manifest is (known fields, bounded positive figures);
        anything else is a ValueError, and the caller measures again."""
        if not isinstance(d, dict) or set(d) - _RECORD_FIELDS:
            raise ValueError("not a tuning record")
        if not isinstance(d["backend"], str) or d["draft_body"] not in (None, "shared", "own"):
            raise ValueError("unknown backend or draft body")
        if not isinstance(d["free"], bool) or not isinstance(d["verify_ms"], dict):
            raise ValueError("malformed fields")
        widths = {_width(b, key=True): _ms(ms, f"verify_ms[{b}]") for b, ms in d["verify_ms"].items()}
        return cls(d["backend"], d["draft_body"], d["free"], _ms(d["one_token_ms"], "one_token_ms"),
                   _ms(d["draft_ms"], "draft_ms", zero=True), widths, _width(d["exact_width"], low=1),
                   _ms(d["measure_ms"], "measure_ms", zero=True), bool(d.get("cached", False)))


_RECORD_FIELDS = {"backend", "draft_body", "free", "one_token_ms", "draft_ms", "verify_ms", "exact_width",
                  "measure_ms", "cached"}
_MAX_MS = 3.6e6  # an hour: no step of a model edgespec runs takes longer


def _ms(value: object, name: str, zero: bool = False) -> float:
    """A measured time in ms: finite, > 0 (>= 0 where `zero`), below an hour."""
    bound = {"least": 0} if zero else {"above": 0}
    return number(value, name, most=_MAX_MS, error=ValueError, **bound)


def _width(value: object, low: int = 2, key: bool = False) -> int:
    """A verify width: an integer in low..1024 (`key`: a JSON object key, which arrives as a string)."""
    if key and isinstance(value, str) and value.isdigit():
        value = int(value)
    return integer(value, "width", least=low, most=1024, error=ValueError)


@dataclass(frozen=True)
class Tuning:
    """The measured candidates and the one chosen."""

    choice: Tuned
    candidates: tuple[Measurement, ...]
    tune_ms: float  # measuring in this process (0: every figure came from the cache)

    def describe(self) -> list[str]:
        """Lines for `edgespec info`: the choice, then each candidate's figures."""
        c = self.choice
        fresh = [m for m in self.candidates if not m.cached]
        how = (f"measured now: {self.tune_ms / 1e3:.1f} s, of which {sum(m.measure_ms for m in fresh) / 1e3:.1f} s "
               "measuring, the rest opening and the exactness probe" if fresh else "cached")
        lines = [f"chosen: {c.backend}" + (f", draft body {c.draft_body}" if c.draft_body else "")
                 + f", verify width <= {c.verify_width} [{how}]",
                 "  candidate                        plain ms  draft ms  c(B) " + " ".join(
                     f"{b:>5}" for b in WIDTHS_SHOWN) + "  exact  width  tok/s"]
        for m in sorted(self.candidates, key=lambda m: -m.score()):
            curve = m.curve
            cb = " ".join(f"{curve[b] / curve[1]:5.2f}" if b in curve else "    -" for b in WIDTHS_SHOWN)
            lines.append(f"  {m.name:<32} {curve[1]:8.1f} {m.draft_ms:9.1f}       {cb}  {m.exact_width:5}  "
                         f"{m.width():5}  {m.score():5.1f}{' (cached)' if m.cached else ''}")
        mixed = any(len(m.draft_costs) > 1 for m in self.candidates)
        lines.append(f"  (tok/s expected, averaged over acceptances {', '.join(map(str, ACCEPTANCES))}"
                     f"{' and the draft model and free sources' if mixed else ''}; c(B): a non-decreasing fit "
                     "of the fastest of the repeats; width: the widest verify kept)")
        return lines

    def to_dict(self) -> dict:
        return {"choice": asdict(self.choice), "tune_ms": self.tune_ms,
                "candidates": [{**m.to_dict(), "score": round(m.score(), 2)} for m in self.candidates]}
