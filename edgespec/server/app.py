"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health.

    app = create_app(engine, ServerConfig(model_id="my-model", api_key="secret"))
    uvicorn.run(app, host="127.0.0.1", port=8080)

Requests are validated and tokenized on the event loop, then queued (worker.py); the single
worker thread generates, and the Responses flow back as one JSON body or as server-sent events.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..decoding import SamplingParams
from . import responses as out
from .errors import APIError, install_error_handlers
from .schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, now, new_id, unsupported_features
from .worker import GenerationWorker, Job, QueueFull

if TYPE_CHECKING:
    from ..api import Engine

__all__ = ["ServerConfig", "create_app"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """What the server adds to an engine; validated when built."""

    model_id: str = "edgespec"
    api_key: str | None = None  # clients must send "Authorization: Bearer <api_key>"
    max_queue: int = 64  # waiting requests beyond this get a 503
    max_tokens: int = 512  # chat replies without max_tokens stop here
    disconnect_poll_s: float = 0.25  # how often a non-streamed request checks for its client

    def __post_init__(self) -> None:
        from ..errors import ConfigError

        if not self.model_id:
            raise ConfigError("the model id must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key must not be empty")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_tokens}")


def _auth(api_key: str | None):
    async def check(authorization: str | None = Header(default=None)) -> None:
        if api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


def _refuse_unsupported(req) -> None:
    for param, message in unsupported_features(req):
        raise APIError(400, message, param=param, code="unsupported_parameter")


def _sampling(req) -> SamplingParams:
    # pydantic already checked the ranges; SamplingParams checks the combination
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed)


async def _watch_client(request: Request, job: Job, every_s: float) -> None:
    """Cancel `job` when the client of a non-streamed request goes away."""
    while not job.done.is_set():
        if await request.is_disconnected():
            logger.info("client left; cancelling its generation")
            job.cancel.set()
            return
        await asyncio.sleep(every_s)


def create_app(engine: "Engine", config: ServerConfig | None = None) -> FastAPI:
    """An ASGI app serving `engine` (which stays the caller's to close)."""
    cfg = config or ServerConfig()
    worker = GenerationWorker(engine, cfg.max_queue)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.close)

    app = FastAPI(title="edgespec", summary="OpenAI-compatible server for an edgespec bundle", lifespan=lifespan)
    app.state.worker = worker
    app.state.config = cfg
    install_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_auth(cfg.api_key))])
    created = now()

    def submit(tokens: list[int], req, max_tokens: int) -> Job:
        job = Job(tokens, _sampling(req), max_tokens, req.stop_list(), asyncio.get_running_loop())
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
        if not engine.tokenizer.has_chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        tokens = engine.tokenizer.encode_chat(req.conversation())
        job = submit(tokens, req, req.token_limit() or cfg.max_tokens)
        if not req.stream:
            return await finish(request, job, out.chat_completion, "chatcmpl")
        return _JobStream(job, _chat_events(job, new_id("chatcmpl"), cfg.model_id, now(), req.include_usage()))

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        _refuse_unsupported(req)
        tokens = _prompt_tokens(engine, req.prompt)
        job = submit(tokens, req, req.token_limit())
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


def _prompt_tokens(engine: "Engine", prompt: str | list) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        bad = [t for t in prompt if not 0 <= t < engine.target.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range (vocabulary size {engine.target.vocab_size})",
                           param="prompt")
        return list(prompt)
    text = prompt[0] if isinstance(prompt, list) else prompt
    tokens = engine.tokenizer.encode(text)
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
