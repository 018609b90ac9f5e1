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

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..bundle import Bundle, load_bundle
from ..decoding import (
    DRAFTERS,
    DraftPolicy,
    GenerationStats,
    SamplingParams,
    SpeculativeDecoder,
    check_max_tokens,
    make_policy,
)
from ..decoding.cache import batch_limit
from ..errors import BusyError, ConfigError, ContextFullError, EngineClosedError
from ..runtimes import BACKENDS, exact_mode_memory, installed_backends, open_runtime, open_shared_pair
from ..tokenizer import IncrementalDecoder, Tokenizer
from .assembly import EnginePlan, decoder_limits, plan_engine, probe_width
from .choices import DRAFT_BODIES, resolve_drafting, shared_body_blocker
from .config import EngineConfig, engine_config
from .exact_mode import inexact_drafting, settle_exact_mode
from .tuning import tune

__all__ = ["load", "Engine", "EngineConfig", "Response", "GenerationStats", "DRAFT_BODIES", "default_bundle",
           "resolve_drafting", "shared_body_blocker"]

logger = logging.getLogger(__name__)


@dataclass
class Response:
    """One streamed piece of a generation; metrics travel with it."""

    text: str  # new text since the previous Response
    token_ids: list[int]
    from_draft: int  # how many of token_ids were accepted drafts
    tokens_per_s: float  # running decode speed of this generation
    finish_reason: str | None = None  # "stop", "length", "cancelled" or None while running
    stats: GenerationStats | None = None
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # bytes per model: weights, kv

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the models (weights, KV caches, buffers) after this step; `kv_used`, the
        filled part of a preallocated cache, is already inside `kv`."""
        return sum(v for parts in self.memory.values() for k, v in parts.items() if k != "kv_used")


def default_bundle() -> Path:
    """The default bundle, exported from the embedded Gemma 3 270M the first time."""
    from ..models.catalog import default_bundle_path

    path = default_bundle_path()
    if not path.exists():
        from ..exporters.export import ExportConfig, export_bundle

        logger.warning("building the default bundle in %s (one time, a few minutes)", path)
        export_bundle(ExportConfig(output=path))
    return path


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
    if isinstance(wait, (int, float)) and wait >= 0:
        return float(wait)
    raise ConfigError(f"wait must be True, False or a number of seconds >= 0, got {wait!r}")


class Engine:
    """A loaded bundle: target (and draft) runtimes, tokenizer, and the speculative decoder.

    Engine(bundle, config) opens what `assembly.plan_engine` decides for `config` (keyword
    overrides of it are accepted too, as `load` takes them), where the config leaves a choice
    open, with what the tuner measured fastest on this machine (tuning.py; `engine.tuning`).
    `clock` (seconds) is what the decoder, its drafters and the generation statistics read; a
    replay passes a virtual one."""

    def __init__(self, bundle: Bundle, config: EngineConfig | None = None, *,
                 clock: Callable[[], float] = time.perf_counter, **overrides) -> None:
        self.config = engine_config(config, **overrides)
        self._clock = clock
        self._stack = ExitStack()  # every runtime opened, closed with the engine
        self._lock = threading.Lock()  # one generation at a time
        self._owner: int | None = None  # thread id of the running generation's consumer
        self._active: weakref.ref | None = None  # the running generation, for close()
        self._closing = threading.Event()  # tells a running generation to stop
        self._closed = False
        self.last_stats = GenerationStats()
        try:
            installed = installed_backends()
            # the fastest exact configuration measured here, where the config leaves one open (None: nothing to tune)
            self.tuning = tune(bundle, self.config, installed, functools.partial(Engine, bundle, clock=clock))
            # under retune the tuner has just probed every candidate: the chosen one reads its verdict
            self._retune = self.config.retune and self.tuning is None
            self._open(bundle, plan_engine(bundle.manifest, self.config, installed,
                                           self.tuning.choice if self.tuning else None))
        except BaseException:  # a later step failed: what was opened must not outlive the error
            self._stack.close()
            raise

    def _open(self, bundle: Bundle, plan: EnginePlan) -> None:
        """Execute `plan`: open the target (and draft), plan memory under a budget, settle the
        target's exact mode, build the decoder. Everything opened is entered into `self._stack`."""
        m = bundle.manifest
        self.plan, self.bundle, self.backend = plan, bundle, plan.backend
        self.drafter_name, self.policy_name, self.k = plan.drafter, plan.policy, plan.k
        self.shared_body = plan.shared_body  # the draft reads the target's body through its own head
        self.draft = self.draft_backend = None
        self.exactness = None  # the probe's verdict: which verify widths round like plain decoding here
        self.tokenizer = Tokenizer(bundle.file(m.tokenizer.file), m.tokenizer)
        budget = self._budget(bundle, plan)  # None: no budget
        files = [bundle.file(plan.target.file)] + ([bundle.file(plan.draft.file)] if plan.shared_body else [])
        reopen, mode, remembered, remember = self._open_models(bundle, plan, budget, files)
        self.memory_plan = budget.finish({"target": self.target, "draft": self.draft}) if budget else None
        if self.memory_plan is not None and self.draft is not None and not self.memory_plan.use_draft:
            self._drop_draft()  # measured, it does not fit after all
        # a plain engine probes only to settle its target's mode where no engine has here yet
        if self.drafter_name is not None or (plan.switchable and remembered is None):
            self._settle(plan, files, reopen if plan.switchable else None, mode, remember)
        kv = [rt.kv_capacity for rt in (self.target, self.draft) if rt is not None]
        self.limits = MappingProxyType(decoder_limits(self.config.max_context, kv, self.memory_plan, self.exactness,
                                                      self.shared_body, plan.verify_limit, self.config.prefill_chunk))
        # most tokens a sequence may hold (prompt + reply); None: no fixed limit
        self.context_limit: int | None = self.limits["context_limit"]
        self.decoder = self.variant()

    def _open_models(self, bundle: Bundle, plan: EnginePlan, budget, files: list[Path]):
        """Open the target (with a draft on its body) in the mode settled on here last time, and a
        draft on its own body; (reopen, mode, remembered, remember) for settling the mode."""
        c, backend = self.config, plan.backend
        # The target's mode (runtimes/exactness.py): the one settled on here last time, opened
        # straight away. Plain and speculative engines share it, so that their greedy outputs are
        # the same model's (an exact mode such as padded rows rounds unlike the default).
        ctx_kw = {"kv_capacity": c.max_context} if c.max_context is not None and budget is None else {}
        modes = BACKENDS[backend].exact_modes if not c.static else ()  # static shapes have one width
        recall, remember = exact_mode_memory(backend, files[:1], {"threads": c.threads, "device": c.device, **ctx_kw}
                                             ) if modes else (lambda: None, None)
        remembered = None if self._retune else recall()
        mode = remembered or {}
        if remembered is None and budget is not None and modes:
            # a budget plans the runtimes it opens and cannot switch them afterwards: where no mode
            # is settled here yet, open the backend's first exact mode (the probe still checks it)
            mode = modes[0]
        options = {**plan.target.options, **mode}
        if plan.shared_body:
            # a trained draft head (edgespec distill) runs on the same body, opened for the drafter 'head' only
            head = bundle.manifest.draft_head if self.drafter_name == "head" else None
            extra = {} if head is None else {"draft_head": bundle.file(head.file)}
            reopen = functools.partial(open_shared_pair, backend, files[0], files[-1], **options, **extra)
            pair = budget.open_pair(reopen) if budget else reopen()
            self.target = self._stack.enter_context(pair[0])
            self.draft = self._stack.enter_context(pair[1])
            self.draft_backend = backend
        else:
            reopen = functools.partial(open_runtime, backend, files[0], **options)
            self.target = self._stack.enter_context(budget.open_target(reopen) if budget else reopen())
        if plan.wants_draft_model and budget is not None and not budget.load_draft:
            self.drafter_name = None  # the draft model does not fit; finish() says so once
            if plan.shared_body:  # its head was opened with the body: let it go
                self._drop_draft()
        if self.drafter_name is not None and plan.draft is not None and not plan.shared_body:
            open_draft = functools.partial(open_runtime, plan.draft.backend, bundle.file(plan.draft.file),
                                           **plan.draft.options)
            self.draft = self._stack.enter_context(budget.open_draft(open_draft) if budget else open_draft())
            self.draft_backend = plan.draft.backend
        return reopen, mode, remembered, remember

    def _settle(self, plan: EnginePlan, files: list[Path], reopen, mode: dict, remember) -> None:
        """Probe exactness and keep the target's exact mode (exact_mode.py); where no verify width
        is exact, drafting goes under require_exact."""
        mp = self.memory_plan
        widest = probe_width(self.drafter_name, self.policy_name, self.k,
                             batch_limit(self.target, decoder_limits(None, [], mp, None, False)["max_batch"]))
        settled = settle_exact_mode(plan.backend, self.target, self.draft if plan.shared_body else None, files,
                                    widest, threads=self.config.threads, retune=self._retune, mode=mode,
                                    stack=self._stack, reopen=reopen, remember=remember)
        self.target, self.exactness = settled.target, settled.verdict
        if plan.shared_body:
            self.draft = settled.shared_draft
        if (settled.verdict.exact_width < 2 and self.drafter_name is not None
                and not inexact_drafting(plan.backend, settled.verdict, self.config.require_exact)):
            self._drop_draft()

    def _drop_draft(self) -> None:
        """Decode without the draft model from here on (it does not fit, or drafting is refused)."""
        if self.draft is not None:
            self.draft.close()
            self.draft = self.draft_backend = None
        self.drafter_name = None

    def _budget(self, bundle: Bundle, plan: EnginePlan):
        """The budgeted-load helper (edgespec.memory), or None when no budget is given."""
        if not plan.budgeted:
            return None
        from ..memory.loading import EngineBudget
        from ..runtimes import runtime_class

        m, fmt = bundle.manifest, plan.target.format
        dfmt = fmt if m.draft is not None and fmt in m.draft.formats else None
        k = plan.k if plan.drafter is not None else 0
        return EngineBudget(self.config.budget_bytes, bundle, fmt, dfmt, runtime_class(plan.backend).kv_dtypes, k,
                            plan.max_k if k else 0, plan.wants_draft_model, self.config.max_context,
                            shared_body=plan.shared_body)

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
        name = None if plain else (drafter or self.drafter_name)
        if name is None:
            return SpeculativeDecoder(self.target, **self.limits, clock=clock)
        needs_model = name in DRAFTERS and DRAFTERS[name].needs_model  # an unknown name: the decoder says so
        if needs_model and self.draft is None:
            raise ConfigError(f"drafter {name!r} needs the draft model, which this engine has not loaded")
        if not isinstance(policy, DraftPolicy):
            # verifies up to the target's free width cost one plain step (static shapes pad to it)
            policy = make_policy(policy or ("fixed" if k is not None else self.policy_name), self.k if k is None else k,
                                 free_width=max(1, self.target.capabilities.free_batch_tokens))
        draft = self.draft if needs_model else None
        limits = {**self.limits, "trees": self.limits["trees"] and trees is not False}
        return SpeculativeDecoder(self.target, draft, id_map=self.bundle.id_map() if draft is not None else None,
                                  drafter=name, policy=policy, **limits, clock=clock)

    def describe(self) -> dict[str, Any]:
        """What this engine runs, as plain values for reports: backends, formats and precisions
        per model, the draft's body, drafting, limits, the exactness verdict and the config."""
        def model(role: str, backend: str | None) -> dict | None:
            entry = getattr(self.bundle.manifest, role)
            if backend is None or entry is None:
                return None
            fmt = BACKENDS[backend].bundle_format
            art = entry.formats.get(fmt)
            return {"backend": backend, "format": fmt, "precision": art.precision if art else None,
                    "quantization": art.quantization if art else None}

        probe = self.exactness
        return {"bundle": self.bundle.path.name, "target": model("target", self.backend),
                "draft": model("draft", self.draft_backend),
                "draft_body": "shared" if self.shared_body and self.draft else "own" if self.draft else None,
                "drafter": self.drafter_name, "policy": self.policy_name, "k": self.k,
                "limits": dict(self.limits),
                "exactness": None if probe is None else {"summary": probe.describe(), **probe.to_dict()},
                "tuning": None if self.tuning is None else self.tuning.to_dict(),
                "config": self.config.to_dict()}

    # -- layered API: step (ids) → stream (Response) → generate (text) -----------------
    def stream_ids(self, tokens: list[int], params: SamplingParams, max_tokens: int,
                   stop: Sequence[str] = (), stats: GenerationStats | None = None, *,
                   stop_event: threading.Event | None = None, wait: bool | float = False) -> Iterator[Response]:
        """Extend `tokens` in place, yielding Responses; the caches stay a prefix of `tokens`.

        One generation per engine at a time, taken when iteration starts: if another runs,
        wait=False raises BusyError, wait=True waits for it, a number waits that many seconds at
        most. Setting `stop_event` ends the stream after the current step with a last Response
        whose finish_reason is "cancelled"."""
        timeout = _wait_timeout(wait)
        if self._closed:
            raise EngineClosedError("the engine is closed; load the bundle again")
        # a negative id would index from the end of the embedding, a large one crash the backend
        vocab = self.target.vocab_size
        bad = next((t for t in tokens if isinstance(t, bool) or not hasattr(t, "__index__") or not 0 <= t < vocab),
                   None)
        if bad is not None:
            raise ConfigError(f"token id {bad!r} is out of range (vocabulary size {vocab})")
        holder: list[weakref.ref] = []
        gen = self._generation(tokens, params, max_tokens, list(stop), stats or GenerationStats(),
                               stop_event, timeout, holder)
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

    def _generation(self, tokens, params, max_tokens, stop, st, stop_event, timeout, holder) -> Iterator[Response]:
        self._acquire(timeout)
        self._active = holder[0]
        try:
            yield from self._stream(tokens, params, max_tokens, stop, st, stop_event)
        finally:
            self._owner = self._active = None
            self._lock.release()

    def _stream(self, tokens, params, max_tokens, stop, st: GenerationStats,
                stop_event: threading.Event | None) -> Iterator[Response]:
        def cancelled() -> bool:
            return self._closing.is_set() or (stop_event is not None and stop_event.is_set())

        self.last_stats = st
        st.prompt_tokens = len(tokens)
        max_tokens = self._fit_context(tokens, max_tokens)
        dec = IncrementalDecoder(self.tokenizer)
        text, sent = "", 0
        t0 = self._clock()
        steps = self.decoder.stream(tokens, params, max_tokens, self.tokenizer.stop_ids)
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
        if self.context_limit is None:
            return max_tokens
        room = self.context_limit - len(tokens)
        if room < 1:
            raise ContextFullError(f"the prompt has {len(tokens)} tokens but the context holds {self.context_limit}"
                                   f"{' (memory budget)' if self.memory_plan else ''}; shorten it")
        return min(max_tokens, room)

    def stream(self, prompt: str | list[int], *, max_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
               stop: Sequence[str] = (), stop_event: threading.Event | None = None,
               wait: bool | float = False) -> Iterator[Response]:
        """Plain completion of `prompt` (text, or token ids), streamed.

        min_p: keep tokens at least min_p times as likely as the likeliest (SamplingParams);
        stop: strings that end the text (not included); stop_event / wait: see stream_ids."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p)
        check_max_tokens(max_tokens)
        if isinstance(prompt, str) and not prompt.isascii():
            try:  # a lone surrogate (from a bad byte in argv or a JSON escape) is not text
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(f"the prompt is not valid Unicode text (a lone surrogate at offset {e.start})") \
                    from None
        tokens = (self.tokenizer.encode(prompt) if prompt else []) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise ConfigError("the prompt is empty")
        return self.stream_ids(tokens, params, max_tokens, stop, stop_event=stop_event, wait=wait)

    def generate(self, prompt: str | list[int], **kwargs) -> str:
        """Plain completion of `prompt`, returned as text."""
        return "".join(r.text for r in self.stream(prompt, **kwargs))

    def chat(self, system: str | None = None, chat_format: str | None = None):
        """A multi-turn chat session that reuses the KV cache across turns.

        chat_format: "auto" (None: the model's own template, or a base model's plain-text
        transcript), "template" or a transcript name (edgespec.models.chat_formats)."""
        from .session import ChatSession

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


@_with_config_fields
def load(bundle: str | Path | None = None, config: EngineConfig | None = None, **overrides) -> Engine:
    """Open a bundle (default: the embedded Gemma 3 270M bundle, built on first use). `bundle`
    may also be a .gguf file: its bundle is built in the user cache on first use and reused
    while the file's content is unchanged (exporters/gguf/bundles.py).

    config: an EngineConfig (edgespec.engine.config; default: EngineConfig()); keyword overrides replace
    its fields, e.g. load(path, backend="openvino", k=3). What each field does: help(EngineConfig).
    """
    cfg = engine_config(config, **overrides)  # checked before any bundle is built
    if bundle is None:
        path = default_bundle()
    else:
        from ..exporters.gguf.bundles import resolve_bundle

        path = resolve_bundle(bundle)
    return Engine(load_bundle(path), cfg)

