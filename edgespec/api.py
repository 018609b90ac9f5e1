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
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from .bundle import Bundle, load_bundle
from .choices import (
    DRAFT_BODIES,
    STATIC_DRAFT_WIDTH,
    alternating_options,
    backend_for_device,
    resolve_drafting,
    shared_body_blocker,
    static_options,
)
from .decoding import DEFAULT_K, DRAFTERS, SamplingParams, SpeculativeDecoder, make_policy
from .errors import BusyError, ConfigError, ContextFullError, EngineClosedError
from .runtimes import BACKENDS, exact_mode_memory, open_runtime, open_shared_pair, pick_backend, probe_exactness
from .tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["load", "Engine", "Response", "GenerationStats", "DRAFT_BODIES", "default_bundle", "resolve_drafting",
           "shared_body_blocker"]

logger = logging.getLogger(__name__)

MAX_PROBE_WIDTH = 33  # the widest verify the exactness probe tries (and so the widest one allowed)
_warned_inexact: set[tuple[str, float]] = set()


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


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    first_token_s: float = 0.0  # prompt processing + first step
    elapsed_s: float = 0.0
    k_history: list[int] = field(default_factory=list)  # drafted tokens per step: k over time
    source_history: list[str] = field(default_factory=list)  # who drafted each step ("model", "ngram:3", "")

    def add(self, step, now_s: float) -> None:
        """Account one decoding step that ended `now_s` seconds into the generation."""
        if self.steps == 0:
            self.first_token_s = now_s
        self.steps += 1
        self.new_tokens += len(step.tokens)
        self.drafted += step.drafted
        self.accepted += step.accepted
        self.draft_ms += step.draft_ms
        self.verify_ms += step.verify_ms
        self.k_history.append(step.drafted)
        self.source_history.append(step.source)
        self.elapsed_s = now_s

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward (1 = no speed-up from drafting)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        decode = self.elapsed_s - self.first_token_s
        return (self.new_tokens - 1) / decode if decode > 0 and self.new_tokens > 1 else 0.0


def default_bundle() -> Path:
    """The default bundle, exported from the embedded Gemma 3 270M the first time."""
    from .models.catalog import default_bundle_path

    path = default_bundle_path()
    if not path.exists():
        from .exporters.export import ExportConfig, export_bundle

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


def _close(runtimes) -> None:
    """Close the runtimes of a (target, shared draft) pair; None stands for no draft."""
    for rt in runtimes:
        if rt is not None:
            rt.close()


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
    """A loaded bundle: target (and draft) runtimes, tokenizer, and the speculative decoder."""

    def __init__(self, bundle: Bundle, *, backend: str | None = None, device: str | None = None,
                 draft_backend: str | None = None, draft_device: str | None = None, use_draft: bool = True,
                 k: int | None = None, policy: str | None = None, drafter: str = "auto",
                 threads: int | None = None, memory_budget: str | int | None = None,
                 max_context: int | None = None, static: bool = False, draft_body: str = "auto",
                 require_exact: bool = False, retune: bool = False) -> None:
        self._stack = ExitStack()  # every runtime opened, closed with the engine
        self._lock = threading.Lock()  # one generation at a time
        self._owner: int | None = None  # thread id of the running generation's consumer
        self._active: weakref.ref | None = None  # the running generation, for close()
        self._closing = threading.Event()  # tells a running generation to stop
        self._closed = False
        self.last_stats = GenerationStats()
        try:
            self._open(bundle, backend=backend, device=device, draft_backend=draft_backend,
                       draft_device=draft_device, use_draft=use_draft, k=k, policy=policy, drafter=drafter,
                       threads=threads, memory_budget=memory_budget, max_context=max_context, static=static,
                       draft_body=draft_body, require_exact=require_exact, retune=retune)
        except BaseException:  # a later step failed: what was opened must not outlive the error
            self._stack.close()
            raise

    def _open(self, bundle: Bundle, *, backend, device, draft_backend, draft_device, use_draft, k, policy, drafter,
              threads, memory_budget, max_context, static, draft_body, require_exact, retune) -> None:
        """Assemble the engine: pick the backend, open the target (and draft), plan memory, probe
        exactness, build the decoder. Everything opened is entered into `self._stack`."""
        m = bundle.manifest
        if draft_body not in DRAFT_BODIES:
            raise ConfigError(f"draft_body must be one of {', '.join(DRAFT_BODIES)}, got {draft_body!r}")
        backend = pick_backend(m.target.formats, backend or backend_for_device(device, m.target.formats))
        if static and "openvino" not in (backend, draft_backend):
            raise ConfigError(f"static shapes need the openvino backend, not {backend} (add --backend openvino)")
        fmt = BACKENDS[backend].bundle_format
        self.drafter_name, self.policy_name, self.k = resolve_drafting(
            drafter, policy, k, has_draft=m.draft is not None, use_draft=use_draft)
        if fmt not in m.target.formats:
            raise ConfigError(f"bundle has no {fmt} artifacts for backend {backend} "
                              f"(it has: {', '.join(bundle.formats())})")
        self.bundle = bundle
        self.backend = backend
        self.tokenizer = Tokenizer(bundle.file(m.tokenizer.file), m.tokenizer)
        wants_draft = self.drafter_name is not None and DRAFTERS[self.drafter_name].needs_model
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or max_context < 2):
            raise ConfigError(f"max_context must be an integer >= 2, got {max_context!r}")
        budget = self._budget(memory_budget, bundle, backend, fmt, wants_draft, max_context)  # None: no budget
        ctx_kw = {"kv_capacity": max_context} if max_context is not None and budget is None else {}
        self.draft = None
        self.draft_backend = None
        self.shared_body = False  # the draft reads the target's body through its own head
        if wants_draft and draft_body != "own":
            why = shared_body_blocker(m, fmt, backend, draft_backend=draft_backend, device=device,
                                      draft_device=draft_device, static=static, budgeted=budget is not None,
                                      auto=draft_body == "auto")
            if why is not None and draft_body == "shared":
                raise ConfigError(f"--draft-body shared: {why}")
            self.shared_body = why is None
        alternating = wants_draft and not self.shared_body  # two models take turns on the cores
        # The target's mode (runtimes/exactness.py): the one settled on here last time, opened
        # straight away. Plain and speculative engines share it, so that their greedy outputs are
        # the same model's (an exact mode such as padded rows rounds unlike the default). A budget
        # plans the target as opened, and static shapes have one width: neither switches.
        switchable = budget is None and not static and bool(BACKENDS[backend].exact_modes)
        files = [bundle.file(m.target.formats[fmt].file)] + ([bundle.file(m.draft.formats[fmt].file)]
                                                            if self.shared_body else [])
        recall, self._remember_mode = exact_mode_memory(backend, files[:1], {
            "threads": threads, "device": device, **ctx_kw}) if switchable else (lambda: None, None)
        remembered = None if retune else recall()
        mode = remembered or {}
        open_target = functools.partial(open_runtime, backend, files[0], threads=threads, device=device, **ctx_kw,
                                        **static_options(backend, static, self.k + 1),
                                        **(alternating_options(backend) if alternating else {}), **mode)
        open_pair = functools.partial(open_shared_pair, backend, files[0], files[-1], threads=threads, device=device,
                                      **ctx_kw, **mode)
        if self.shared_body:
            pair = open_pair()
            self.target = self._stack.enter_context(pair[0])
            self.draft = self._stack.enter_context(pair[1])
            self.draft_backend = backend
        else:
            self.target = self._stack.enter_context(budget.open_target(open_target) if budget else open_target())
        if wants_draft and budget is not None and not budget.load_draft:
            self.drafter_name = None  # the draft model does not fit; finish() says so once
        if self.drafter_name is not None and DRAFTERS[self.drafter_name].needs_model and not self.shared_body:
            # the draft may run on another backend/device; its id map is one per bundle, so it agrees
            dback = draft_backend or (backend if fmt in m.draft.formats else pick_backend(m.draft.formats))
            dfmt = BACKENDS[pick_backend(m.draft.formats, dback)].bundle_format
            if dfmt not in m.draft.formats:
                raise ConfigError(f"the bundle's draft has no {dfmt} artifact for backend {dback} (it has: "
                                  f"{', '.join(m.draft.formats)}); use --drafter ngram or --no-draft")
            self.draft_backend = dback
            open_draft = functools.partial(open_runtime, dback, bundle.file(m.draft.formats[dfmt].file),
                                           threads=threads,
                                           device=draft_device or (device if dback == backend else None),
                                           **ctx_kw, **static_options(dback, static, STATIC_DRAFT_WIDTH),
                                           **alternating_options(dback))
            self.draft = self._stack.enter_context(budget.open_draft(open_draft) if budget else open_draft())
        self.memory_plan = budget.finish({"target": self.target, "draft": self.draft}) if budget else None
        if self.memory_plan is not None:
            self._apply_plan(self.memory_plan)
        # which verify widths round like plain decoding on this machine; a plain engine probes only
        # to settle its target's mode where no engine has here yet (None: not probed)
        if self.drafter_name is None and not (switchable and remembered is None):
            self.exactness = None
        else:
            reopen = open_pair if self.shared_body else open_target
            self.exactness = self._probe(files, threads, require_exact, retune, reopen if switchable else None, mode)
        verify_width = self.exactness.exact_width if self.exactness and self.exactness.exact_width >= 2 else None
        caps = [rt.kv_capacity for rt in (self.target, self.draft) if rt is not None and rt.kv_capacity]
        caps += [max_context] if max_context is not None else []
        if self.memory_plan is not None:
            caps.append(self.memory_plan.kv_capacity)
        # most tokens a sequence may hold (prompt + reply); None: no fixed limit
        self.context_limit: int | None = min(caps) if caps else None
        self.decoder = SpeculativeDecoder(
            self.target, self.draft, id_map=bundle.id_map() if self.draft else None, drafter=self.drafter_name,
            policy=make_policy(self.policy_name, self.k) if self.drafter_name is not None else None,
            context_limit=self.context_limit, max_draft=self.memory_plan.max_draft if self.memory_plan else None,
            verify_width=verify_width, draft_width=verify_width if self.shared_body else None)

    def _probe(self, files: list[Path], threads: int | None, require_exact: bool, retune: bool, reopen, mode: dict):
        """The exactness probe of the target as opened (runtimes/exactness.py). Where some verify
        widths are not exact here, the backend's exact modes (BackendInfo.exact_modes) are opened
        through `reopen(**options)` and probed too, and the target (with a draft on its body)
        switches to the first that is exact at every width, else to the one exact the widest.
        The mode kept is remembered, so the next load opens it directly (`mode`: the one opened now).
        Where no width is exact, drafting is refused under `require_exact`, else it runs with a warning."""
        # adaptive policies draft up to 2k and lookup tails as many again; a plain engine probes
        # what the default speculative one does
        k = self.k if self.drafter_name is not None else DEFAULT_K
        widest = k + 1 if self.policy_name == "fixed" and self.drafter_name is not None else 4 * k + 1
        if (cap := self.target.capabilities.max_batch_tokens) is not None:
            widest = min(widest, cap)
        widest = max(2, min(widest, MAX_PROBE_WIDTH))
        verdict = probe_exactness(self.backend, self.target, files, widest, threads=threads, retune=retune)
        for options in BACKENDS[self.backend].exact_modes if reopen is not None else ():
            if verdict.fully_exact:
                break
            opened = reopen.func(*reopen.args, **{**reopen.keywords, **options})
            pair = opened if isinstance(opened, tuple) else (opened, None)
            try:
                other = probe_exactness(self.backend, pair[0], files, widest, threads=threads, retune=retune)
            except BaseException:
                _close(pair)
                raise
            if other.exact_width <= verdict.exact_width:
                _close(pair)
                continue
            logger.info("%s: switching to %s, exact here (%s)", self.backend, options, other.describe())
            old = (self.target, self.draft if self.shared_body else None)
            self.target = self._stack.enter_context(pair[0])
            if pair[1] is not None:
                self.draft = self._stack.enter_context(pair[1])
            _close(old)
            verdict, mode = other, options
        if reopen is not None:
            self._remember_mode(mode)
        if verdict.exact_width >= 2 or self.drafter_name is None:
            return verdict
        if require_exact:
            logger.warning("%s: %s; drafting is off (require_exact)", self.backend, verdict.describe())
            if self.draft is not None:
                self.draft.close()
                self.draft = self.draft_backend = None
            self.drafter_name = None
        elif (self.backend, verdict.worst_diff) not in _warned_inexact:  # once per process: chats reload
            _warned_inexact.add((self.backend, verdict.worst_diff))
            logger.warning("%s: %s; greedy output with drafting may differ from plain decoding on near-ties "
                           "(--require-exact refuses to draft)", self.backend, verdict.describe())
        return verdict

    def _budget(self, memory_budget, bundle: Bundle, backend: str, fmt: str, wants_draft: bool,
                max_context: int | None):
        """The budgeted-load helper (edgespec.memory), or None when no budget is given."""
        if memory_budget is None:
            return None
        from .memory import parse_bytes
        from .memory.loading import EngineBudget
        from .runtimes import runtime_class

        m = bundle.manifest
        dfmt = fmt if m.draft is not None and fmt in m.draft.formats else None
        max_k = self.k if self.policy_name == "fixed" else 2 * self.k
        k = self.k if self.drafter_name is not None else 0
        return EngineBudget(parse_bytes(memory_budget), bundle, fmt, dfmt, runtime_class(backend).kv_dtypes, k,
                            max_k if k else 0, wants_draft, max_context)

    def _apply_plan(self, plan) -> None:
        from .memory.loading import apply_plan

        if self.draft is not None and not plan.use_draft:  # measured, it does not fit after all
            self.draft.close()
            self.draft = self.draft_backend = None
            self.drafter_name = None
        apply_plan(plan, [rt for rt in (self.target, self.draft) if rt is not None])

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
        t0 = time.perf_counter()
        steps = self.decoder.stream(tokens, params, max_tokens, self.tokenizer.stop_ids)
        try:
            while not cancelled():
                step = next(steps, None)
                if step is None:  # the decoder ended on its own (it always gives a reason first)
                    return
                st.add(step, time.perf_counter() - t0)
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
            st.elapsed_s = time.perf_counter() - t0

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
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
               stop_event: threading.Event | None = None, wait: bool | float = False) -> Iterator[Response]:
        """Plain completion of `prompt` (text, or token ids), streamed.

        stop: strings that end the text (not included); stop_event / wait: see stream_ids."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if max_tokens < 1:
            raise ConfigError(f"max-tokens must be >= 1, got {max_tokens}")
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


def load(bundle: str | Path | None = None, *, backend: str | None = None, device: str | None = None,
         draft_backend: str | None = None, draft_device: str | None = None, use_draft: bool = True,
         k: int | None = None, policy: str | None = None, drafter: str = "auto",
         threads: int | None = None, memory_budget: str | int | None = None,
         max_context: int | None = None, static: bool = False, draft_body: str = "auto",
         require_exact: bool = False, retune: bool = False) -> Engine:
    """Open a bundle (default: the embedded Gemma 3 270M bundle, built on first use).

    backend: a name from edgespec.runtimes.BACKENDS (default: the first installed one that runs a
    format the bundle has); device: e.g. "CPU", "GPU", "NPU", "AUTO" where the backend has them;
    draft_backend / draft_device: run the draft elsewhere (default: as the target).
    drafter: "auto", "model", "ngram" (prompt lookup, no draft model needed), "both" or "none";
    policy: a draft-length policy from edgespec.decoding.POLICIES; k: the draft length (adaptive
    policies range up to 2k). See `resolve_drafting` for the defaults.
    memory_budget: bytes, or a size such as "1.5GB" or "900MiB", for the whole process: the KV
    capacity, draft length and whether the draft model loads are planned to fit it
    (edgespec.memory); below what plain decoding needs, a MemoryBudgetError names the bound.
    max_context: most tokens (prompt + reply) a sequence may hold (default: the backend's, 4096
    for onnxruntime, or what the budget allows); a chat drops its oldest turns to stay inside it.
    static: OpenVINO's static-shape mode (as NPUs need; an NPU device turns it on by itself):
    fixed KV capacity and a fixed verify width k+1, so adaptive policies draft at most k.
    draft_body: "shared" runs the draft model on the target's body, the draft artifact giving
    only its (VocabTrim) head: one body's weights and KV cache, and no position goes through the
    body twice; "own" loads the draft's own body; "auto" (default) shares where the draft is a
    self-draft without a layer cut, the target is int8 or int4 and the backend can (OpenVINO,
    dynamic shapes, no memory budget). See shared_body_blocker.
    require_exact: draft only where a verify is bit-identical to plain decoding on this machine
    (the exactness probe, run at the first load and cached; `Engine.exactness` holds its verdict);
    otherwise greedy drafting runs with a warning. retune: probe again instead of reading the cache.
    """
    path = Path(bundle) if bundle is not None else default_bundle()
    return Engine(load_bundle(path), backend=backend, device=device, draft_backend=draft_backend,
                  draft_device=draft_device, use_draft=use_draft, k=k, policy=policy, drafter=drafter,
                  threads=threads, memory_budget=memory_budget, max_context=max_context, static=static,
                  draft_body=draft_body, require_exact=require_exact, retune=retune)
