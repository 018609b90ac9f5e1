"""The library API that the CLI, the server and desktop apps share.

    engine = edgespec.load()            # default bundle, built on first use
    print(engine.generate("The capital of France is", max_tokens=16))
    for r in engine.stream("Once upon a time"):  # Response objects with metrics
        print(r.text, end="")
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from .bundle import Bundle, load_bundle
from .decoding import DEFAULT_K, DEFAULT_POLICY, DRAFTERS, SamplingParams, SpeculativeDecoder, make_policy
from .errors import BusyError, ConfigError
from .runtimes import BACKENDS, installed_backends, open_runtime, pick_backend
from .tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["load", "Engine", "Response", "GenerationStats", "default_bundle", "resolve_drafting"]

logger = logging.getLogger(__name__)


@dataclass
class Response:
    """One streamed piece of a generation; metrics travel with it."""

    text: str  # new text since the previous Response
    token_ids: list[int]
    from_draft: int  # how many of token_ids were accepted drafts
    tokens_per_s: float  # running decode speed of this generation
    finish_reason: str | None = None  # "stop", "length" or None while running
    stats: "GenerationStats | None" = None


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


def resolve_drafting(drafter: str, policy: str | None, k: int | None, *, has_draft: bool,
                     use_draft: bool) -> tuple[str | None, str, int]:
    """(drafter name or None for plain decoding, policy name, k) from the user's choices.

    drafter "auto" drafts with prompt lookup and the draft model when the bundle has one, with
    prompt lookup alone otherwise, and not at all under use_draft=False (--no-draft). A k given
    without a policy asks for exactly that draft length, so it selects the fixed policy.
    """
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ConfigError(f"k must be an integer >= 0, got {k}")
    policy = policy or ("fixed" if k is not None else DEFAULT_POLICY)
    k = DEFAULT_K if k is None else k
    make_policy(policy, k)  # an unknown name fails even when nothing will be drafted
    choices = ("auto", "none", *DRAFTERS)
    if drafter not in choices:
        raise ConfigError(f"unknown drafter {drafter!r}; choose one of: {', '.join(choices)}")
    if drafter == "auto":
        drafter = "none" if not use_draft else "both" if has_draft else "ngram"
    elif drafter != "none" and DRAFTERS[drafter].needs_model and not (has_draft and use_draft):
        why = "--no-draft was given" if has_draft else "the bundle has no draft model"
        raise ConfigError(f"drafter {drafter!r} needs the draft model, but {why}; use drafter 'ngram'")
    return (None if drafter == "none" or k == 0 else drafter), policy, k


def _stop_cut(text: str, stops: Sequence[str]) -> tuple[int, bool]:
    """How much of `text` may be emitted, and whether a stop string was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return min(hits), True
    hold = max((len(s) - 1 for s in stops), default=0)  # a stop string may still be forming
    return max(len(text) - hold, 0), False


# static shapes: the target verifies k drafts plus its own token in one fixed-width forward; the
# draft mostly feeds one token, two when it catches up after a fully accepted draft
STATIC_DRAFT_WIDTH = 2


def _static_options(backend: str, static: bool, width: int) -> dict:
    """Runtime options for the static-shape mode, which only the openvino backend has (it also
    gets the width when not asked: an NPU device turns the mode on by itself)."""
    return {"static": static, "width": width} if backend == "openvino" else {}


def _backend_for_device(device: str | None, formats) -> str | None:
    """A device only OpenVINO drives (GPU, NPU, AUTO) picks it when no backend is named."""
    if device is None or device.upper() == "CPU" or "openvino" not in formats:
        return None
    return "openvino" if "openvino" in installed_backends() else None


class Engine:
    """A loaded bundle: target (and draft) runtimes, tokenizer, and the speculative decoder."""

    def __init__(self, bundle: Bundle, *, backend: str | None = None, device: str | None = None,
                 draft_backend: str | None = None, draft_device: str | None = None, use_draft: bool = True,
                 k: int | None = None, policy: str | None = None, drafter: str = "auto",
                 threads: int | None = None, static: bool = False) -> None:
        m = bundle.manifest
        backend = pick_backend(m.target.formats, backend or _backend_for_device(device, m.target.formats))
        if static and "openvino" not in (backend, draft_backend):
            raise ConfigError(f"static shapes need the openvino backend, not {backend} (add --backend openvino)")
        fmt = BACKENDS[backend].bundle_format
        self.drafter_name, self.policy_name, self.k = resolve_drafting(
            drafter, policy, k, has_draft=m.draft is not None, use_draft=use_draft)
        if fmt not in m.target.formats:
            raise ConfigError(f"bundle has no {fmt} artifacts for backend {backend} (it has: {', '.join(bundle.formats())})")
        self.bundle = bundle
        self.backend = backend
        self.tokenizer = Tokenizer(bundle.file(m.tokenizer.file), m.tokenizer)
        self._stack = ExitStack()
        self.target = self._stack.enter_context(
            open_runtime(backend, bundle.file(m.target.formats[fmt].file), threads=threads, device=device,
                         **_static_options(backend, static, self.k + 1)))
        self.draft = None
        self.draft_backend = None
        if self.drafter_name is not None and DRAFTERS[self.drafter_name].needs_model:
            # the draft may run on another backend/device; its id map is one per bundle, so it agrees
            dback = draft_backend or (backend if fmt in m.draft.formats else pick_backend(m.draft.formats))
            dfmt = BACKENDS[pick_backend(m.draft.formats, dback)].bundle_format
            if dfmt not in m.draft.formats:
                raise ConfigError(f"the bundle's draft has no {dfmt} artifact for backend {dback} (it has: "
                                  f"{', '.join(m.draft.formats)}); use --drafter ngram or --no-draft")
            self.draft_backend = dback
            self.draft = self._stack.enter_context(
                open_runtime(dback, bundle.file(m.draft.formats[dfmt].file), threads=threads,
                             device=draft_device or (device if dback == backend else None),
                             **_static_options(dback, static, STATIC_DRAFT_WIDTH)))
        self.decoder = SpeculativeDecoder(
            self.target, self.draft, id_map=bundle.id_map() if self.draft else None, drafter=self.drafter_name,
            policy=make_policy(self.policy_name, self.k) if self.drafter_name is not None else None)
        self._lock = threading.Lock()
        self.last_stats = GenerationStats()

    # -- layered API: step (ids) → stream (Response) → generate (text) -----------------
    def stream_ids(self, tokens: list[int], params: SamplingParams, max_tokens: int,
                   stop: Sequence[str] = (), stats: GenerationStats | None = None) -> Iterator[Response]:
        """Extend `tokens` in place, yielding Responses; the caches stay a prefix of `tokens`.

        One generation per engine at a time: a second concurrent call raises BusyError."""
        if not self._lock.acquire(blocking=False):
            raise BusyError("the engine is already generating; wait for it or stop it first")
        try:
            yield from self._stream(tokens, params, max_tokens, list(stop), stats or GenerationStats())
        finally:
            self._lock.release()

    def _stream(self, tokens, params, max_tokens, stop, st: GenerationStats) -> Iterator[Response]:
        self.last_stats = st
        st.prompt_tokens = len(tokens)
        dec = IncrementalDecoder(self.tokenizer)
        text, sent = "", 0
        t0 = time.perf_counter()
        steps = self.decoder.stream(tokens, params, max_tokens, self.tokenizer.stop_ids)
        try:
            for step in steps:
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
                               st.tokens_per_s, reason, st)
                sent = cut
                if reason:
                    return
        finally:
            steps.close()  # rewinds caches if we stopped early
            st.elapsed_s = time.perf_counter() - t0

    def stream(self, prompt: str | list[int], *, max_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               stop: Sequence[str] = ()) -> Iterator[Response]:
        """Plain completion of `prompt` (text, or token ids), streamed."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if max_tokens < 1:
            raise ConfigError(f"max-tokens must be >= 1, got {max_tokens}")
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise ConfigError("the prompt is empty")
        return self.stream_ids(tokens, params, max_tokens, stop)

    def generate(self, prompt: str | list[int], **kwargs) -> str:
        """Plain completion of `prompt`, returned as text."""
        return "".join(r.text for r in self.stream(prompt, **kwargs))

    def chat(self, system: str | None = None):
        """A multi-turn chat session that reuses the KV cache across turns."""
        from .session import ChatSession

        return ChatSession(self, system=system)

    def memory(self) -> dict[str, dict[str, int]]:
        out = {"target": self.target.memory_bytes()}
        if self.draft is not None:
            out["draft"] = self.draft.memory_bytes()
        return out

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(bundle: str | Path | None = None, *, backend: str | None = None, device: str | None = None,
         draft_backend: str | None = None, draft_device: str | None = None, use_draft: bool = True,
         k: int | None = None, policy: str | None = None, drafter: str = "auto",
         threads: int | None = None, static: bool = False) -> Engine:
    """Open a bundle (default: the embedded Gemma 3 270M bundle, built on first use).

    backend: a name from edgespec.runtimes.BACKENDS (default: the first installed one that runs a
    format the bundle has); device: e.g. "CPU", "GPU", "NPU", "AUTO" where the backend has them;
    draft_backend / draft_device: run the draft elsewhere (default: as the target).
    drafter: "auto", "model", "ngram" (prompt lookup, no draft model needed), "both" or "none";
    policy: a draft-length policy from edgespec.decoding.POLICIES; k: the draft length (adaptive
    policies range up to 2k). See `resolve_drafting` for the defaults.
    static: OpenVINO's static-shape mode (as NPUs need; an NPU device turns it on by itself):
    fixed KV capacity and a fixed verify width k+1, so adaptive policies draft at most k.
    """
    path = Path(bundle) if bundle is not None else default_bundle()
    return Engine(load_bundle(path), backend=backend, device=device, draft_backend=draft_backend,
                  draft_device=draft_device, use_draft=use_draft, k=k, policy=policy, drafter=drafter,
                  threads=threads, static=static)
