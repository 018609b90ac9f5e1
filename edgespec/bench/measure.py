"""The `edgespec bench` loop: plain and speculative decoding, interleaved on the same runtimes.

Both decoders share the engine's loaded target (and draft) runtimes, so nothing is loaded twice
and both see the same memory, threads and weights. Every run starts from empty caches. The order
rotates per prompt and repeat, so neither configuration always runs first, and a busy neighbour
slows all of them alike; the summary then compares medians (summary.py).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..checks import integer, is_int, number
from ..decoding import FixedK, GenerationStats, SamplingParams, SpeculativeDecoder
from ..engine.session import chat_format_for
from ..errors import ConfigError
from ..memory.measure import PeakRSS
from .endings import Rendered, render, watcher
from .suites import Prompt

__all__ = ["BenchConfig", "RunRecord", "PLAIN", "SPECULATIVE", "PEER", "SERVER_PEER", "is_peer", "build_decoders",
           "measure_run", "cut_at_ending", "run_bench", "rotated", "fits", "run_params"]

logger = logging.getLogger(__name__)

PLAIN, SPECULATIVE = "plain", "speculative"
PEER = "llama.cpp"  # llama-cpp-python's own plain decode (peer.py), when the bench measures it
# llama.cpp's own server (server_peer.py): "llama-server" plain, "llama-server+TYPE" speculative
SERVER_PEER = "llama-server"
WARMUP_TOKENS = 16
# seconds before and after each peer run, so every configuration starts on idle cores:
# onnxruntime's process-wide pool (runtimes/onnxruntime/pool.py) keeps a thread spinning a while
# after edgespec's last forward, llama.cpp's threads for a shorter while after its last
PEER_SETTLE_S = 0.1


@dataclass(frozen=True)
class BenchConfig:
    """How much to measure, and how to sample. Greedy by default: speculative output must then
    equal plain output token for token. Sampled runs are checked by the rejection-sampling tests,
    not token for token (plain and speculative draw their random numbers differently)."""

    repeat: int = 3
    max_tokens: int = 64
    warmup: int = 1  # unmeasured passes of every configuration before the first measured one
    # continuation prompts: end at EOS (default: fixed-length runs, as llama-bench); chat prompts always
    # end where edgespec chat ends a reply (endings.py)
    stop_at_eos: bool = False
    k_sweep: tuple[int, ...] = ()  # extra fixed-k speculative configurations, "k=2", "k=4", ...
    sampling: SamplingParams = SamplingParams()  # every configuration, the llama.cpp peer included
    cooldown_s: float = 0.0  # a pause before every measured run, for a device that heats (thermal.py)

    def __post_init__(self) -> None:
        for name, value, low in (("--repeat", self.repeat, 1), ("--max-tokens", self.max_tokens, 2),
                                 ("--warmup", self.warmup, 0)):
            integer(value, name, least=low)
        if not all(is_int(k) and k >= 1 for k in self.k_sweep):
            raise ConfigError(f"--k-sweep takes draft lengths >= 1, got {list(self.k_sweep)}")
        if len(set(self.k_sweep)) != len(self.k_sweep):
            raise ConfigError(f"--k-sweep repeats a draft length: {list(self.k_sweep)}")
        number(self.cooldown_s, "--cooldown", least=0, most=3600)


def _stat(name: str, doc: str | None = None) -> property:
    """A record's figure read from its GenerationStats."""
    return property(lambda self: getattr(self.stats, name), doc=doc)


@dataclass(frozen=True)
class RunRecord:
    """One measured generation of one configuration on one prompt: the generation's own
    statistics (decoding/stats.py, as the API and the server keep them), the reply as shown, and
    where and how it ran. `tokens` ends where the reply's text ended (endings.py); the statistics
    count every step the decoder took, a step past that end included."""

    stats: GenerationStats
    tokens: list[int]
    total_s: float  # the whole run, prompt included, until the stream was closed
    config: str = ""
    cls: str = ""
    prompt: str = ""
    repeat: int = 0
    peak_rss: int = 0
    heat: tuple | None = None  # (before, after) thermal.Reading of the CPU around the run, where read

    # the parameters before "/" are positional-only, so `cls=` in `where` is the prompt's class
    @classmethod
    def from_stats(cls, st: GenerationStats, tokens: list[int], total_s: float, /, **where) -> RunRecord:
        """A record of one measured generation, the other fields from `where` (config, cls,
        prompt, repeat, peak_rss, heat; blank if not given). A generation that took no step has
        the whole run as its first-token time."""
        if not st.steps:
            st = dataclasses.replace(st, first_token_s=total_s)
        return cls(st, tokens, total_s, **where)

    @classmethod
    def timed(cls, prompt_tokens: int, tokens: list[int], ttft_s: float, total_s: float, /, *, steps: int = 0,
              drafted: int = 0, accepted: int = 0, draft_ms: float = 0.0, verify_ms: float = 0.0,
              **where) -> RunRecord:
        """A record from a run's figures as another program reports them (a peer: bench/peer.py,
        server_peer.py), in the engine's statistics: its first token timed within `ttft_s`."""
        st = GenerationStats(prompt_tokens=prompt_tokens, new_tokens=len(tokens), steps=steps, drafted=drafted,
                             accepted=accepted, draft_ms=draft_ms, verify_ms=verify_ms, first_token_s=ttft_s,
                             first_step_tokens=1, elapsed_s=total_s)
        return cls(st, list(tokens), total_s, **where)

    # the figures the summary reads: the statistics' own, not copies
    prompt_tokens = _stat("prompt_tokens")
    ttft_s = _stat("first_token_s", "Prefill (draft catch-up included) and the first committed step.")
    steps = _stat("steps")
    drafted = _stat("drafted")
    accepted = _stat("accepted")
    draft_ms = _stat("draft_ms")
    verify_ms = _stat("verify_ms")

    @property
    def by_k(self) -> dict[str, list[int]]:
        """{"model:4": [steps, accepted], ...}: GenerationStats.by_draft_length."""
        return self.stats.by_draft_length()

    @property
    def first_tokens(self) -> int:
        """Tokens the first step committed (timed inside ttft_s), of those shown."""
        return min(self.stats.first_step_tokens, len(self.tokens))

    @property
    def decode_s(self) -> float:
        return max(self.total_s - self.ttft_s, 0.0)

    @property
    def decode_tokens(self) -> int:
        """Tokens after the first step: the ones `decode_s` times."""
        return max(len(self.tokens) - self.first_tokens, 0)

    @property
    def tok_s(self) -> float:
        """Decode speed after the first step (its tokens are timed with the prompt, so not counted)."""
        n = self.decode_tokens
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def is_peer(config: str) -> bool:
    """Whether a configuration is another program (a peer), not one of edgespec's decoders."""
    return config == PEER or config == SERVER_PEER or config.startswith(SERVER_PEER + "+")


def build_decoders(engine, k_sweep: Iterable[int] = ()) -> dict[str, SpeculativeDecoder]:
    """plain, the engine's own speculative decoder, and one fixed-k decoder per swept k."""
    if engine.drafter_name is None:
        probe = getattr(engine, "exactness", None)
        if probe is not None and getattr(probe, "exact_width", 2) < 2:
            raise ConfigError(f"nothing to compare: {probe.describe()}, so drafting is off; --allow-inexact "
                              "measures drafting anyway (its output may then differ from plain decoding)")
        if getattr(engine, "memory_plan", None) is not None:
            raise ConfigError("nothing to compare: the memory budget leaves no room for drafting; raise "
                              "--memory-budget or use --drafter ngram")
        raise ConfigError("nothing to compare: this configuration drafts nothing (--drafter none, -k 0, "
                          "or --no-draft); use --drafter ngram for prompt lookup without a draft model")
    # variants on the engine's runtimes keep its limits: a memory plan's, and the verify widths the
    # exactness probe found exact on this machine
    decoders = {PLAIN: engine.variant(plain=True), SPECULATIVE: engine.decoder}
    for k in k_sweep:
        decoders[f"k={k}"] = engine.variant(policy=FixedK(k))
    return decoders


def fits(engine, n_prompt: int, max_tokens: int) -> bool:
    """Whether prompt + reply fit the engine's context (a memory budget may fix one)."""
    limit = getattr(engine, "context_limit", None)
    return limit is None or n_prompt + max_tokens <= limit


def measure_run(decoder: SpeculativeDecoder, runtimes, ids: list[int], max_tokens: int, stop_ids,
                rss: PeakRSS | None = None, params: SamplingParams = SamplingParams(),
                ended: Callable[[list[int]], bool] | None = None) -> RunRecord:
    """Decode `ids` from empty caches and a drafter that has learned nothing (greedy unless
    `params` say otherwise), to `max_tokens`, a stop id, or the step after which `ended` (called
    on the new tokens: endings.watcher) says the reply has ended; config/class/prompt fields are
    left blank."""
    for rt in runtimes:
        rt.reset()
    if decoder.drafter is not None:
        # a repeat of the same prompt must not replay what the drafter learned in the last one
        decoder.drafter.forget()
    if rss is not None:
        rss.mark()
    tokens = list(ids)
    clock = decoder.clock  # the decoder's own: a replay's virtual clock times its runs too
    st = GenerationStats(prompt_tokens=len(ids))
    t0 = clock()
    stream = decoder.stream(tokens, params, max_tokens, stop_ids)
    before = 0  # new tokens before the last step: the reply had not ended there
    try:
        for step in stream:
            st.add(step, clock() - t0)
            if ended is not None and ended(tokens[len(ids):]):
                break
            before = len(tokens) - len(ids)
    finally:
        stream.close()  # a reply that ended by its text: the decoder rewinds its caches now
    total_s = clock() - t0
    new = tokens[len(ids):]
    return RunRecord.from_stats(st, new if ended is None else cut_at_ending(new, before, ended), total_s,
                                peak_rss=0 if rss is None else rss.mark())


def cut_at_ending(new: list[int], before: int, ended: Callable[[list[int]], bool]) -> list[int]:
    """`new` up to the token at which `ended` first holds, looking past `before` (a step may commit
    several tokens past a reply's end: what the user is shown, and what plain decoding would have
    produced, stops there)."""
    for n in range(before + 1, len(new) + 1):
        if ended(new[:n]):
            return new[:n]
    return new


def rotated(names: list[str], shift: int) -> list[str]:
    s = shift % len(names)
    return names[s:] + names[:s]


def run_params(sampling: SamplingParams, prompt_index: int, repeat: int) -> SamplingParams:
    """The sampling of one measured run: the bench's, with a seed of its own per prompt and
    repeat (from the bench's seed), so repeats draw different samples and every configuration
    of one (prompt, repeat) gets the same seed."""
    if sampling.greedy:
        return sampling
    base = 0 if sampling.seed is None else sampling.seed
    return dataclasses.replace(sampling, seed=base * 1_000_003 + prompt_index * 1_009 + repeat)


def _heated(run: Callable[[], RunRecord], thermal, cooldown_s: float) -> RunRecord:
    """`run()` after `cooldown_s` of rest, with the CPU read just before and after it (thermal.py:
    clocks, temperatures), outside the run's own timing."""
    if cooldown_s:
        time.sleep(cooldown_s)
    if thermal is None:
        return run()
    before = thermal.read()
    rec = run()
    return dataclasses.replace(rec, heat=(before, thermal.read()))


def _by_name(peer, peers) -> dict:
    return {p.name: p for p in [*([] if peer is None else [peer]), *peers]}


def _rendered(engine, prompts: list[Prompt], cfg: BenchConfig) -> list[tuple[Prompt, Rendered]]:
    """The prompts as the model sees them (endings.render: chat's own format and ending), those
    that fit the engine's context with a reply of --max-tokens."""
    fmt = chat_format_for(engine.bundle.manifest, engine.tokenizer)
    encoded = []
    for p in prompts:
        r = render(p, engine.tokenizer, fmt, cfg.stop_at_eos)
        if not r.ids:
            raise ConfigError(f"prompt {p.cls}/{p.id} encodes to no tokens")
        if fits(engine, len(r.ids), cfg.max_tokens):
            encoded.append((p, r))
        else:
            logger.warning("skipping %s/%s: %d prompt tokens + %d new exceed the context limit of %d", p.cls, p.id,
                           len(r.ids), cfg.max_tokens, engine.context_limit)
    return encoded


def run_bench(engine, prompts: list[Prompt], cfg: BenchConfig,
              on_run: Callable[[RunRecord, int, int], None] | None = None,
              rss: PeakRSS | None = None, peer=None, peers=(), thermal=None) -> list[RunRecord]:
    """Every configuration on every prompt, `cfg.repeat` times, interleaved; returns all runs.

    `on_run(record, done, total)` is called after each measured run (the live table). `peer` and
    each of `peers` (bench/peer.py, bench/server_peer.py: `.name`, `.decode(ids, max_tokens,
    stop_ids, rss, params=, ending=, ended=)`) is one more configuration in the rotation, decoding
    the same prompt ids and ending each run where edgespec's ends (endings.py: `ending`, and
    `ended`, its watcher on the new tokens, for a peer in this process). `thermal`
    (thermal.Thermal) is read before and after every measured run, outside its timing;
    `cfg.cooldown_s` pauses before each."""
    if not prompts:
        raise ConfigError("no prompts to run")
    decoders = build_decoders(engine, cfg.k_sweep)
    runtimes = [rt for rt in (engine.target, engine.draft) if rt is not None]
    encoded = _rendered(engine, prompts, cfg)
    if not encoded:
        raise ConfigError(f"no prompt fits the engine's context limit ({engine.context_limit} tokens) with "
                          f"--max-tokens {cfg.max_tokens}")
    others = _by_name(peer, peers)
    names = list(decoders) + list(others)

    def one(name: str, r: Rendered, n: int, sampler: PeakRSS | None, params: SamplingParams) -> RunRecord:
        if name in others:
            time.sleep(PEER_SETTLE_S)
            try:
                return others[name].decode(r.ids, n, r.ending.stop_ids, sampler, params=params, ending=r.ending,
                                           ended=watcher(engine.tokenizer, r.ending))
            finally:
                time.sleep(PEER_SETTLE_S)
        return measure_run(decoders[name], runtimes, r.ids, n, r.ending.stop_ids, sampler, params,
                           watcher(engine.tokenizer, r.ending))

    for w in range(cfg.warmup):  # first runs pay for allocations; adaptive policies get first measurements
        for name in names:
            one(name, encoded[w % len(encoded)][1], min(WARMUP_TOKENS, cfg.max_tokens), None,
                run_params(cfg.sampling, len(encoded) + w, 0))  # seeds apart from the measured runs'
    total = cfg.repeat * len(encoded) * len(names)
    runs: list[RunRecord] = []
    for rep in range(cfg.repeat):  # repeats outermost: a slow patch of the machine hits every class
        for i, (p, rendered) in enumerate(encoded):
            params = run_params(cfg.sampling, i, rep)
            for name in rotated(names, rep + i):
                rec = _heated(functools.partial(one, name, rendered, cfg.max_tokens, rss, params), thermal,
                              cfg.cooldown_s)
                rec = dataclasses.replace(rec, config=name, cls=p.cls, prompt=p.id, repeat=rep)
                runs.append(rec)
                if on_run is not None:
                    on_run(rec, len(runs), total)
    for rt in runtimes:  # leave the engine as a fresh one: nothing cached from the bench
        rt.reset()
    return runs
