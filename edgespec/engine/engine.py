"""The library API that the CLI, the server and desktop apps share.

    engine = edgespec.load()            # default bundle, built on first use
    print(engine.generate("The capital of France is", max_tokens=16))
    for r in engine.stream("Once upon a time"):  # Response objects with metrics
        print(r.text, end="")

Threads: one generation runs per engine at a time. Another caller is refused with BusyError
(wait=False, the default), waits for its turn (wait=True) or waits at most `wait` seconds.
A generation stops early when its `stop_event` (a threading.Event) is set, when the consumer
leaves the iterator, or when the engine is closed; the caches are rewound in every case.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ..bundle import Bundle, load_bundle
from ..checks import is_number
from ..decoding import (
    DRAFTERS,
    DraftPolicy,
    GenerationStats,
    SamplingParams,
    SpeculativeDecoder,
    check_max_tokens,
    make_policy,
)
from ..decoding.grammar import Constraint, Grammar, GrammarCompiler, GrammarError, ResponseFormat, response_format
from ..decoding.overlap import OverlappedDecoder
from ..errors import BusyError, ConfigError, ContextFullError, EngineClosedError
from ..runtimes import Runtime, installed_backends
from ..tokenizer import IncrementalDecoder, Tokenizer
from .assembly import EnginePlan, plan_engine
from .choices import DRAFT_BODIES, resolve_drafting, shared_body_blocker
from .config import EngineConfig, engine_config
from .cores import machine_cores
from .first_use import default_bundle, first_use_format
from .inputs import check_stop, check_text, check_token_ids
from .opening import open_plan
from .response import Response
from .session import ChatSession
from .tuning import tune

__all__ = ["load", "resolve", "Engine", "EngineConfig", "Response", "GenerationStats", "DRAFT_BODIES",
           "default_bundle", "first_use_format", "resolve_drafting", "shared_body_blocker"]

logger = logging.getLogger(__name__)


def _stop_cut(text: str, stops: Sequence[str]) -> tuple[int, bool]:
    """How much of `text` may be emitted, and whether a stop string was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return min(hits), True
    hold = max((len(s) - 1 for s in stops), default=0)  # a stop string may still be forming
    return max(len(text) - hold, 0), False


def _wait_timeout(wait: bool | float) -> float | None:
    """Lock timeout for `wait`: 0 = refuse at once, None = wait as long as it takes."""
    if wait is True:
        return None
    if wait is False:
        return 0.0
    if is_number(wait) and wait >= 0:
        return float(wait)
    raise ConfigError(f"wait must be True, False or a number of seconds >= 0, got {wait!r}")


class Engine:
    """A loaded bundle: target (and draft) runtimes, tokenizer, and the speculative decoder.

    Engine(bundle, config) opens what `assembly.plan_engine` decides for `config` (keyword
    overrides of it are accepted too, as `load` takes them); Engine(bundle, plan=plan) opens a
    plan resolved already, such as `resolve`'s, which `load` passes: where the config leaves a
    choice open, it holds what the tuner measured fastest on this machine (tuning.py). The plan
    is executed once (opening.py); `engine.opened` records what was opened, deviations from the
    plan and their reasons included, and nothing changes it afterwards. `clock` (seconds) is what
    the decoder, its drafters and the generation statistics read; a replay passes a virtual one."""

    def __init__(self, bundle: Bundle, config: EngineConfig | None = None, *, plan: EnginePlan | None = None,
                 clock: Callable[[], float] = time.perf_counter, **overrides) -> None:
        if plan is None:
            cfg = engine_config(config, **overrides)
            plan = plan_engine(bundle.manifest, cfg, installed_backends(), cores=machine_cores(cfg.threads))
        elif config is not None or overrides:
            raise ConfigError("give Engine a config (and overrides) or a plan, not both")
        self.config, self.plan, self.bundle = plan.config, plan, bundle
        self._clock = clock
        self._stack = ExitStack()  # every runtime opened, closed with the engine
        self._lock = threading.Lock()  # one generation at a time
        self._owner: int | None = None  # thread id of the running generation's consumer
        self._active: weakref.ref | None = None  # the running generation, for close()
        self._closing = threading.Event()  # tells a running generation to stop
        self._closed = False
        self.last_stats = GenerationStats()
        try:
            m = bundle.manifest
            self.tokenizer = Tokenizer(bundle.file(m.tokenizer.file), m.tokenizer)
            self._stack.callback(self.tokenizer.close)  # its chat-template render child, if one started
            # under retune the tuner has just probed every candidate: the chosen one reads its verdict
            opened = open_plan(bundle, plan, self._stack, retune=self.config.retune and plan.tuning is None)
            self.target, self.draft, self.opened = opened.target, opened.draft, opened.opened
            self.decoder = self.variant()
            # builds the grammar engine's view of the tokenizer at its first compile, once (under its lock)
            self._grammars = GrammarCompiler(self.tokenizer.serialized, self.target.vocab_size,
                                             sorted(self.tokenizer.stop_ids))
        except BaseException:  # a later step failed: what was opened must not outlive the error
            self._stack.close()
            raise

    # -- what was opened: read `engine.opened`. These views stay for the callers that still use
    # them; each is one read of `opened`, so none can disagree with it (nothing is mirrored).
    @property
    def backend(self) -> str:
        return self.opened.backend

    @property
    def draft_backend(self) -> str | None:
        return self.opened.draft_backend

    @property
    def drafter_name(self) -> str | None:
        return self.opened.drafter

    @property
    def policy_name(self) -> str:
        return self.opened.policy

    @property
    def k(self) -> int:
        return self.opened.k

    @property
    def shared_body(self) -> bool:
        return self.opened.shared_body

    @property
    def exactness(self):
        return self.opened.exactness

    @property
    def memory_plan(self):
        return self.opened.memory_plan

    @property
    def context_limit(self) -> int | None:
        return self.opened.context_limit

    # -- seams for tools: decoder variants on the same runtimes, a description for reports ------
    def variant(self, *, plain: bool = False, drafter: str | None = None, policy: str | DraftPolicy | None = None,
                k: int | None = None, clock: Callable[[], float] | None = None,
                trees: bool | None = None) -> SpeculativeDecoder:
        """A decoder on this engine's runtimes, built with its limits (context, memory plan, the
        verify widths exact here). By default the engine's own drafting; `plain`: no drafting;
        `drafter`: another drafter name; `policy` (a name or a DraftPolicy) and `k`: another
        draft length (k alone selects the fixed policy); `clock`: another clock; `trees=False`:
        chains only where the target could verify draft trees. The variants share the runtimes'
        caches: run one at a time, and reset the runtimes between them."""
        if self._closed:
            raise EngineClosedError("the engine is closed; load the bundle again")
        clock = clock or self._clock
        name = None if plain else (drafter or self.opened.drafter)
        if name is None:
            return SpeculativeDecoder(self.target, limits=self.opened.limits, clock=clock)
        draft = self._draft_for(name)
        limits = self.opened.limits if trees is not False else self.opened.limits.replace(trees=False)
        decoder = OverlappedDecoder if self.config.overlap else SpeculativeDecoder  # overlap.py: why and where
        return decoder(self.target, draft, id_map=self.bundle.id_map() if draft is not None else None,
                       drafter=name, policy=self._policy(policy, k), limits=limits, clock=clock)

    def _draft_for(self, drafter: str) -> Runtime | None:
        """The draft model where `drafter` needs one (an unknown name: the decoder says so)."""
        if drafter not in DRAFTERS or not DRAFTERS[drafter].needs_model:
            return None
        if self.draft is None:
            raise ConfigError(f"drafter {drafter!r} needs the draft model, which this engine has not loaded")
        return self.draft

    def _policy(self, policy: str | DraftPolicy | None, k: int | None) -> DraftPolicy:
        """`policy` as given, or built by name (the engine's, or fixed where only k is given)."""
        if isinstance(policy, DraftPolicy):
            return policy
        name = policy or ("fixed" if k is not None else self.opened.policy)
        # verifies up to the target's free width cost one plain step (static shapes pad to it)
        return make_policy(name, self.opened.k if k is None else k,
                           free_width=max(1, self.target.capabilities.free_batch_tokens))

    def describe(self) -> dict[str, Any]:
        """What this engine runs, as plain values for reports: backends, formats and precisions
        per model, the draft's body, drafting, limits, the exactness verdict, deviations from the
        plan, the tuning and the config (all read from `opened`)."""
        tuning = self.opened.tuning
        return {"bundle": self.bundle.path.name, **self.opened.to_dict(self.bundle.manifest),
                "tuning": None if tuning is None else tuning.to_dict(), "config": self.config.to_dict()}

    # -- structured output -----------------------------------------------------------------
    def grammar(self, fmt: ResponseFormat | dict | None) -> Grammar | None:
        """`fmt` (a ResponseFormat, OpenAI's response_format object, or None) compiled for this
        model's tokenizer, cached; a GrammarError names what is wrong with it. The first call
        builds the grammar engine's view of the tokenizer (a second or more for a large vocabulary)."""
        fmt = response_format(fmt)
        return None if fmt is None else self._grammars.compile(fmt)

    # -- layered API: step (ids) → stream (Response) → generate (text) -----------------
    def stream_ids(self, tokens: list[int], params: SamplingParams, max_tokens: int,
                   stop: Sequence[str] = (), stats: GenerationStats | None = None, *,
                   stop_event: threading.Event | None = None, wait: bool | float = False,
                   grammar: Grammar | None = None) -> Iterator[Response]:
        """Extend `tokens` in place, yielding Responses; the caches stay a prefix of `tokens`.

        One generation per engine at a time, taken when iteration starts: if another runs,
        wait=False raises BusyError, wait=True waits for it, a number waits that many seconds at
        most. Setting `stop_event` ends the stream after the current step with a last Response
        whose finish_reason is "cancelled". `grammar` (from `engine.grammar`): the reply follows
        it; a reply that reaches max_tokens before the grammar is complete raises GrammarError."""
        timeout = _wait_timeout(wait)
        if self._closed:
            raise EngineClosedError("the engine is closed; load the bundle again")
        # a negative id would index from the end of the embedding, a large one crash the backend
        check_token_ids(tokens, self.target.vocab_size)
        if grammar is not None and not isinstance(grammar, Grammar):
            raise ConfigError(f"grammar must come from engine.grammar(), got {type(grammar).__name__}")
        holder: list[weakref.ref] = []
        gen = self._generation(tokens, params, max_tokens, list(stop), stats or GenerationStats(),
                               stop_event, timeout, holder, grammar)
        holder.append(weakref.ref(gen))
        return gen

    def _acquire(self, timeout: float | None) -> None:
        if self._owner == threading.get_ident():
            # waiting here would wait for ourselves
            raise BusyError("this thread is still iterating another generation of this engine; "
                            "finish or close it first")
        got = self._lock.acquire(blocking=False) if timeout == 0 else \
            self._lock.acquire(timeout=-1 if timeout is None else timeout)
        if not got:
            waited = f" after waiting {timeout:g} s" if timeout else ""
            raise BusyError(f"the engine is already generating{waited}; wait for it (wait=True) or stop it first")
        if self._closed:
            self._lock.release()
            raise EngineClosedError("the engine is closed; load the bundle again")
        self._owner = threading.get_ident()

    def _generation(self, tokens, params, max_tokens, stop, st, stop_event, timeout, holder,
                    grammar) -> Iterator[Response]:
        self._acquire(timeout)
        self._active = holder[0]
        try:
            yield from self._stream(tokens, params, max_tokens, stop, st, stop_event, grammar)
        finally:
            self._owner = self._active = None
            self._lock.release()

    def _stream(self, tokens, params, max_tokens, stop, st: GenerationStats,
                stop_event: threading.Event | None, grammar: Grammar | None = None) -> Iterator[Response]:
        def cancelled() -> bool:
            return self._closing.is_set() or (stop_event is not None and stop_event.is_set())

        self.last_stats = st
        st.prompt_tokens = len(tokens)
        max_tokens = self._fit_context(tokens, max_tokens)
        constraint = _constraint(grammar, max_tokens)
        dec = IncrementalDecoder(self.tokenizer)
        text, sent = "", 0
        t0 = self._clock()
        steps = self.decoder.stream(tokens, params, max_tokens, self.tokenizer.stop_ids, constraint)
        try:
            while not cancelled():
                step = next(steps, None)
                if step is None:  # the decoder ended on its own (it always gives a reason first)
                    return
                st.add(step, self._clock() - t0)
                ended = step.tokens[-1] in self.tokenizer.stop_ids
                text += dec.push([t for t in step.tokens if t not in self.tokenizer.stop_ids])
                done = ended or st.new_tokens >= max_tokens
                if done:
                    text += dec.flush()
                cut, hit = _stop_cut(text, stop)
                if done and not hit:
                    cut = len(text)
                reason = "stop" if (ended or hit) else ("length" if done else None)
                _check_complete(reason, constraint, max_tokens)
                yield Response(text[sent:cut], step.tokens, min(step.accepted, len(step.tokens) - 1),
                               st.tokens_per_s, reason, st, self.memory())
                sent = cut
                if reason:
                    return
            # stopped from outside: hand over the text held back for stop strings, then end
            yield Response(text[sent:] + dec.flush(), [], 0, st.tokens_per_s, "cancelled", st, self.memory())
        finally:
            steps.close()  # rewinds caches if we stopped early
            st.elapsed_s = self._clock() - t0

    def _fit_context(self, tokens: list[int], max_tokens: int) -> int:
        """New tokens that fit the context: a reply that reaches the limit ends with "length"."""
        limit = self.opened.context_limit
        if limit is None:
            return max_tokens
        room = limit - len(tokens)
        if room < 1:
            raise ContextFullError(f"the prompt has {len(tokens)} tokens but the context holds {limit}"
                                   f"{' (memory budget)' if self.opened.memory_plan else ''}; shorten it")
        return min(max_tokens, room)

    def stream(self, prompt: str | list[int], *, max_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
               stop: Sequence[str] = (), stop_event: threading.Event | None = None,
               wait: bool | float = False, response_format: ResponseFormat | dict | None = None) -> Iterator[Response]:
        """Plain completion of `prompt` (text, or token ids), streamed.

        min_p: keep tokens at least min_p times as likely as the likeliest (SamplingParams);
        stop: strings that end the text (not included); stop_event / wait: see stream_ids;
        response_format: what the reply must match (a ResponseFormat, or OpenAI's response_format
        object): the target's distribution masked by its grammar, sampled or greedy, with drafts."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p)
        check_max_tokens(max_tokens)
        stop = check_stop(stop)
        grammar = self.grammar(response_format)
        if isinstance(prompt, str):
            prompt = check_text(prompt, "the prompt")
            tokens = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, Sequence):
            tokens = list(prompt)  # each id is checked by stream_ids
        else:
            raise ConfigError(f"the prompt must be text or a list of token ids, got {type(prompt).__name__}")
        if not tokens:
            raise ConfigError("the prompt is empty")
        return self.stream_ids(tokens, params, max_tokens, stop, stop_event=stop_event, wait=wait, grammar=grammar)

    def generate(self, prompt: str | list[int], **kwargs) -> str:
        """Plain completion of `prompt`, returned as text."""
        return "".join(r.text for r in self.stream(prompt, **kwargs))

    def chat(self, system: str | None = None, chat_format: str | None = None):
        """A multi-turn chat session that reuses the KV cache across turns.

        chat_format: "auto" (None: the model's own template, or a base model's plain-text
        transcript), "template" or a transcript name (edgespec.models.chat_formats)."""
        return ChatSession(self, system=system, chat_format=chat_format)

    def memory(self) -> dict[str, dict[str, int]]:
        out = {"target": self.target.memory_bytes()}
        if self.draft is not None:
            out["draft"] = self.draft.memory_bytes()
        return out

    @property
    def busy(self) -> bool:
        """Whether a generation is running (a hint: it may end or start any moment)."""
        return self._lock.locked()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Free the runtimes; idempotent.

        A running generation is cancelled at its next step (its consumer gets a last Response
        with finish_reason "cancelled") and awaited, at most `timeout` seconds (BusyError then).
        """
        if self._closed:
            return
        self._closing.set()
        if self._owner == threading.get_ident():  # our own suspended stream: end it here
            gen = self._active() if self._active is not None else None
            if gen is not None:
                gen.close()
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            self._closing.clear()
            raise BusyError(f"a generation did not stop within {timeout:g} s; the engine stays open")
        try:
            if not self._closed:
                self._closed = True
                self._stack.close()
        finally:
            self._lock.release()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _constraint(grammar: Grammar | None, max_tokens: int) -> Constraint | None:
    """A generation's grammar state (None: no grammar); a GrammarError at once where the text the
    grammar forces at the start alone is longer than max_tokens."""
    if grammar is None:
        return None
    constraint = grammar.constraint()
    opening = constraint.opening()
    if opening > max_tokens:
        raise GrammarError(f"{grammar.format.describe()} forces {opening} tokens before any choice, more than "
                           f"max_tokens ({max_tokens}); raise max_tokens")
    return constraint


def _check_complete(reason: str | None, constraint: Constraint | None, max_tokens: int) -> None:
    """A reply that ends at max_tokens before its grammar is complete is an error, not a reply:
    it would not parse (or match its format) as the caller was promised."""
    if reason == "length" and constraint is not None and not constraint.accepting:
        raise GrammarError(f"the reply reached max_tokens ({max_tokens}) before it completed "
                           f"{constraint.format.describe()}; raise max_tokens")


def _with_config_fields(fn):
    """Show EngineConfig's fields as `fn`'s keyword parameters (help(), IDEs, inspect.signature):
    generated from the dataclass, so there is no second list to keep equal."""
    import dataclasses
    import inspect

    sig = inspect.signature(fn)
    fixed = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    # a field built by a factory (tune: on unless the environment says otherwise) shows its value now
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                               default=f.default if f.default is not dataclasses.MISSING else f.default_factory())
             for f in dataclasses.fields(EngineConfig)]
    fn.__signature__ = sig.replace(parameters=fixed + extra)
    return fn


def resolve(bundle: Bundle, config: EngineConfig | None = None, *, installed: list[str] | None = None,
            clock: Callable[[], float] = time.perf_counter, **overrides) -> EnginePlan:
    """The plan `load` opens: `config` (with overrides) on `bundle` where `installed` backends are
    (default: looked up), with what the tuner measured fastest here where the config leaves a
    choice open. Tuning opens each candidate's own plan as an Engine, one at a time, and closes
    it: this runs before the engine that is kept exists."""
    cfg = engine_config(config, **overrides)
    installed = installed_backends() if installed is None else installed
    cores = machine_cores(cfg.threads)  # the fast cores of a big.LITTLE CPU (cores.py)
    tuning = tune(bundle, cfg, installed, lambda plan: Engine(bundle, plan=plan, clock=clock), cores)
    plan = plan_engine(bundle.manifest, cfg, installed, tuning.choice if tuning else None, cores)
    return plan if tuning is None else dataclasses.replace(plan, tuning=tuning)


@_with_config_fields
def load(bundle: str | Path | None = None, config: EngineConfig | None = None, **overrides) -> Engine:
    """Open a bundle (default: the embedded Gemma 3 270M bundle, built on first use). `bundle`
    may also be a .gguf file: its bundle is built in the user cache on first use and reused
    while the file's content is unchanged (exporters/gguf/bundles.py).

    config: an EngineConfig (edgespec.engine.config; default: EngineConfig()); keyword overrides replace
    its fields, e.g. load(path, backend="openvino", k=3). What each field does: help(EngineConfig).
    """
    cfg = engine_config(config, **overrides)  # checked before any bundle is built
    fmt = first_use_format(cfg)
    if bundle is None:
        path = default_bundle(fmt, cfg.memory_budget)
    else:
        from ..exporters.gguf.bundles import resolve_bundle

        path = resolve_bundle(bundle, fmt, cfg.memory_budget)
    b = load_bundle(path)
    return Engine(b, plan=resolve(b, cfg))

