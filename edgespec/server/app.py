"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health.

    app = create_app(engine, ServerConfig(model_id="my-model", api_key="secret"))
    uvicorn.run(app, host="127.0.0.1", port=8080)

Before anything is parsed, guard.py checks the API key, the body's size and how long it takes
to arrive. Requests are then validated on the event loop, tokenized off it (plain prompts in a
thread, chat prompts in a child process with a time limit: render.py), checked against the
context and the max-tokens cap, and queued (worker.py); the single worker thread generates,
and the Responses flow back as one JSON body or as server-sent events.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..decoding import SamplingParams
from . import responses as out
from .errors import APIError, install_error_handlers
from .guard import RequestGuard
from .render import ChatRenderer, RendererStopped, RenderTimeout
from .schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, new_id, now, unsupported_features
from .worker import GenerationWorker, Job, QueueFull

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..engine.session import ReplyShaper

__all__ = ["ServerConfig", "create_app", "begin_shutdown"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """What the server adds to an engine; validated when built."""

    model_id: str = "edgespec"
    api_key: str | None = None  # clients must send "Authorization: Bearer <api_key>" (spaces around: stripped)
    max_queue: int = 64  # waiting requests beyond this get a 503
    max_tokens: int = 512  # chat replies without max_tokens stop here
    max_tokens_cap: int = 4096  # a request asking for more new tokens gets a 400
    max_request_bytes: int = 1 << 20  # larger bodies get a 413 (a 4096-token context is ~16 KB of text)
    client_timeout_s: float = 30.0  # to send a body, and to take each part of a reply
    template_timeout_s: float = 5.0  # to render a chat prompt (normally milliseconds)
    shutdown_timeout_s: float = 10.0  # for the running generation to stop when the server stops
    disconnect_poll_s: float = 0.25  # how often a non-streamed request checks for its client

    def __post_init__(self) -> None:
        from ..errors import ConfigError

        if not self.model_id:
            raise ConfigError("the model id must not be empty")
        if self.api_key is not None:
            # a key read from a file or an env var often ends in a newline; a client never sends it
            object.__setattr__(self, "api_key", self.api_key.strip())
            if not self.api_key:
                raise ConfigError("the API key must not be empty")
            if not self.api_key.isprintable() or not self.api_key.isascii() or " " in self.api_key:
                raise ConfigError("the API key must be printable ASCII without spaces (it travels in an HTTP header)")
        for name, low in (("max_queue", 1), ("max_tokens", 1), ("max_tokens_cap", 1), ("max_request_bytes", 64)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.max_tokens > self.max_tokens_cap:
            raise ConfigError(f"--max-tokens ({self.max_tokens}) must not exceed --max-tokens-cap "
                              f"({self.max_tokens_cap})")
        for name in ("client_timeout_s", "template_timeout_s", "shutdown_timeout_s", "disconnect_poll_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


def _refuse_unsupported(req) -> None:
    for param, message in unsupported_features(req):
        raise APIError(400, message, param=param, code="unsupported_parameter")


def _sampling(req) -> SamplingParams:
    # pydantic already checked the ranges; SamplingParams checks the combination
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                          seed=req.seed)


async def _watch_client(request: Request, job: Job, every_s: float) -> None:
    """Cancel `job` when the client of a non-streamed request goes away."""
    while not job.done.is_set():
        if await request.is_disconnected():
            logger.info("client left; cancelling its generation")
            job.cancel.set()
            return
        await asyncio.sleep(every_s)


def _reply_limit(asked: int | None, default: int, cap: int) -> int:
    """New tokens for a request: what it asked for (at most the cap, else a 400), or the
    default within the cap."""
    if asked is None:
        return min(default, cap)
    n = asked
    if n > cap:
        raise APIError(400, f"max_tokens may be at most {cap} on this server, got {n}", param="max_tokens",
                       code="max_tokens_exceeded")
    return n


def _check_context(engine: Engine, tokens: list[int], param: str) -> None:
    """A prompt that leaves no room for a reply is a 400 before anything streams."""
    limit = engine.context_limit
    if limit is not None and len(tokens) >= limit:
        raise APIError(400, f"This model's context holds {limit} tokens and the prompt has {len(tokens)}; "
                            "shorten it.", param=param, code="context_length_exceeded")


def begin_shutdown(app: FastAPI) -> None:
    """The server is about to stop (Ctrl-C): end what would hold it up, such as a chat template
    still rendering. Safe to call from a signal handler."""
    app.state.renderer.interrupt()


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """An ASGI app serving `engine` (which stays the caller's to close)."""
    cfg = config or ServerConfig()
    worker = GenerationWorker(engine, cfg.max_queue)
    renderer = ChatRenderer(engine.bundle.path, cfg.template_timeout_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        starting = asyncio.create_task(renderer.start())  # a second or more: not on the first request
        yield
        starting.cancel()
        with suppress(asyncio.CancelledError):
            await starting
        await renderer.close()
        await asyncio.to_thread(worker.close, cfg.shutdown_timeout_s)

    app = FastAPI(title="edgespec", summary="OpenAI-compatible server for an edgespec bundle", lifespan=lifespan)
    app.state.worker = worker
    app.state.config = cfg
    app.state.renderer = renderer
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=cfg.api_key, max_body=cfg.max_request_bytes,
                       client_timeout_s=cfg.client_timeout_s)
    v1 = APIRouter(prefix="/v1")
    created = now()

    def submit(tokens: list[int], req, max_tokens: int, stop: list[str] | tuple[str, ...] | None = None,
               shaper: ReplyShaper | None = None) -> Job:
        stop = req.stop_list() if stop is None else list(stop)
        job = Job(tokens, _sampling(req), max_tokens, stop, asyncio.get_running_loop(), shaper=shaper)
        try:
            return worker.submit(job)
        except QueueFull as e:
            raise APIError(503, f"The server is busy: {e}", type="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None

    async def finish(request: Request, job: Job, body, prefix: str) -> JSONResponse:
        watcher = asyncio.create_task(_watch_client(request, job, cfg.disconnect_poll_s))
        try:
            text, reason, st = await out.collect(job.responses())
        finally:
            watcher.cancel()
            with suppress(asyncio.CancelledError):
                await watcher
        return JSONResponse(body(new_id(prefix), cfg.model_id, now(), text, reason, st))


    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=cfg.model_id, created=created)])

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        if model_id != cfg.model_id:
            raise APIError(404, f"The model '{model_id}' does not exist; this server runs '{cfg.model_id}'.",
                           param="model", code="model_not_found")
        return ModelCard(id=cfg.model_id, created=created)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        _refuse_unsupported(req)
        # the model's chat template, or a base model's plain-text transcript and its stop strings
        # (chat_format_for(...).prompt), in a child process with a time limit: render.py
        try:
            prompt = await renderer.prompt(req.conversation(), req.stop_list())
        except RenderTimeout as e:
            raise APIError(500, f"{e}; the bundle's chat template is too slow for this conversation",
                           type="server_error", param="messages", code="template_timeout") from None
        except RendererStopped:
            raise APIError(503, "The server is shutting down.", type="server_error", code="shutting_down") from None
        _check_context(engine, prompt.tokens, "messages")
        job = submit(prompt.tokens, req, _reply_limit(req.token_limit(), cfg.max_tokens, cfg.max_tokens_cap),
                     prompt.stop, prompt.shaper())  # a transcript's reply is shaped as ChatSession shapes it
        if not req.stream:
            return await finish(request, job, out.chat_completion, "chatcmpl")
        return _JobStream(job, _chat_events(job, new_id("chatcmpl"), cfg.model_id, now(), req.include_usage()))

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        _refuse_unsupported(req)
        tokens = await asyncio.to_thread(_prompt_tokens, engine, req.prompt)  # a long prompt takes a while
        _check_context(engine, tokens, "prompt")
        job = submit(tokens, req, _reply_limit(req.max_tokens, req.token_limit(), cfg.max_tokens_cap))
        if not req.stream:
            return await finish(request, job, out.completion, "cmpl")
        return _JobStream(job, _completion_events(job, new_id("cmpl"), cfg.model_id, now(), req.include_usage()))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = not engine.closed
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": cfg.model_id,
                             "busy": engine.busy, "queued": worker.queued}, status_code=200 if ok else 503)

    app.include_router(v1)
    return app


class _JobStream(StreamingResponse):
    """Server-sent events of one job; the job is cancelled however the response ends
    (finished, client gone, server shutting down)."""

    def __init__(self, job: Job, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel.set()


def _prompt_tokens(engine: Engine, prompt: str | list) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        bad = [t for t in prompt if not 0 <= t < engine.target.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range (vocabulary size {engine.target.vocab_size})",
                           param="prompt")
        return list(prompt)
    text = prompt[0] if isinstance(prompt, list) else prompt
    tokens = engine.tokenizer.encode(text) if text else []
    if not tokens:
        raise APIError(400, "the prompt is empty", param="prompt")
    return tokens


async def _chat_events(job: Job, id_: str, model: str, created: int, include_usage: bool) -> AsyncIterator[bytes]:
    yield out.sse(out.chat_chunk(id_, model, created, {"role": "assistant", "content": ""}))
    reason, st = None, None
    try:
        async for r in job.responses():
            if r.text:
                yield out.sse(out.chat_chunk(id_, model, created, {"content": r.text}))
            reason, st = r.finish_reason or reason, r.stats
    except Exception as e:
        yield out.sse_error(e)
        return
    yield out.sse(out.chat_chunk(id_, model, created, {}, out.finish_reason(reason)))
    if include_usage and st is not None:
        yield out.sse(out.chat_chunk(id_, model, created, {}, st=st, choices=False))
    yield out.sse_done()


async def _completion_events(job: Job, id_: str, model: str, created: int,
                             include_usage: bool) -> AsyncIterator[bytes]:
    reason, st = None, None
    try:
        async for r in job.responses():
            if r.text:
                yield out.sse(out.completion_chunk(id_, model, created, r.text))
            reason, st = r.finish_reason or reason, r.stats
    except Exception as e:
        yield out.sse_error(e)
        return
    yield out.sse(out.completion_chunk(id_, model, created, "", out.finish_reason(reason)))
    if include_usage and st is not None:
        yield out.sse(out.completion_chunk(id_, model, created, "", st=st, choices=False))
    yield out.sse_done()
