"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health.

    app = create_app(engine, ServerConfig(model_id="my-model", api_key="secret"))
    uvicorn.run(app, host="127.0.0.1", port=8080)

Before anything is parsed, guard.py checks the API key, the body's size and how long it takes
to arrive. Requests are then validated on the event loop, tokenized off it (plain prompts in a
thread, chat prompts in a child process with a time limit: render.py), checked against the
context and the max-tokens cap, and queued (worker.py); the single worker thread generates,
and the Responses flow back as one JSON body or as server-sent events (responses.py).

The routes are plain module-level functions that read what `create_app` put on
`request.app.state` (engine, config, worker, renderer); the two generation routes share one
handler, their differences given as data (an `_Endpoint`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..decoding import SamplingParams
from ..errors import ConfigError
from . import responses as out
from .config import ServerConfig
from .errors import APIError, install_error_handlers
from .guard import RequestGuard
from .render import ChatRenderer, RendererStopped, RenderTimeout
from .schemas import (
    COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    format_conflicts,
    now,
    unsupported_features,
)
from .tools import ReplyCalls, RequestFormat, format_param
from .worker import GenerationWorker, Job, QueueFull

if TYPE_CHECKING:
    from ..decoding.grammar import Grammar
    from ..engine.engine import Engine
    from ..engine.session import ReplyShaper

__all__ = ["ServerConfig", "create_app", "begin_shutdown", "router"]

logger = logging.getLogger(__name__)

router = APIRouter()

_GenerationRequest = ChatCompletionRequest | CompletionRequest


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """An ASGI app serving `engine` (which stays the caller's to close)."""
    cfg = config or ServerConfig()
    app = FastAPI(title="edgespec", summary="OpenAI-compatible server for an edgespec bundle", lifespan=_lifespan)
    app.state.engine = engine
    app.state.config = cfg
    app.state.worker = GenerationWorker(engine, cfg.max_queue)
    app.state.renderer = ChatRenderer(engine.bundle.path, cfg.template_timeout_s)
    app.state.created = now()
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=cfg.api_key, max_body=cfg.max_request_bytes,
                       client_timeout_s=cfg.client_timeout_s)
    app.include_router(router)
    return app


def begin_shutdown(app: FastAPI) -> None:
    """The server is about to stop (Ctrl-C): end what would hold it up, such as a chat template
    still rendering. Safe to call from a signal handler."""
    app.state.renderer.interrupt()


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app.state
    state.worker.start()
    starting = asyncio.create_task(state.renderer.start())  # a second or more: not on the first request
    yield
    starting.cancel()
    with suppress(asyncio.CancelledError):
        await starting
    await state.renderer.close()
    await asyncio.to_thread(state.worker.close, state.config.shutdown_timeout_s)


# -- the routes ------------------------------------------------------------------------------

@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state
    ok = not state.engine.closed
    return JSONResponse({"status": "ok" if ok else "unavailable", "model": state.config.model_id,
                         "busy": state.engine.busy, "queued": state.worker.queued,
                         **state.engine.opened.speculation()}, status_code=200 if ok else 503)


def _usage_note(engine) -> dict | None:
    """What each response's usage block adds where the engine decodes plainly because no verify
    width rounds like plain decoding here (None: nothing to say)."""
    opened = engine.opened
    return opened.speculation() if opened.inexact_refusal is not None else None


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    return ModelList(data=[_card(request)])


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> ModelCard:
    served = request.app.state.config.model_id
    if model_id != served:
        raise APIError(404, f"The model '{model_id}' does not exist; this server runs '{served}'.",
                       param="model", code="model_not_found")
    return _card(request)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    return await _generate(request, req, _CHAT)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    return await _generate(request, req, _COMPLETION)


def _card(request: Request) -> ModelCard:
    return ModelCard(id=request.app.state.config.model_id, created=request.app.state.created)


# -- one handler for both generation routes --------------------------------------------------

@dataclass(frozen=True)
class _Prompt:
    """What a request feeds the engine: its tokens, the strings that end the reply, how a
    transcript's reply is shaped (None: as the engine writes it), and how its model writes tool
    calls (models/tool_calls.SYNTAXES)."""

    tokens: list[int]
    stop: Sequence[str]
    shaper: ReplyShaper | None = None
    tool_syntax: str = "plain"


@dataclass(frozen=True)
class _Endpoint:
    """What tells /v1/chat/completions from /v1/completions."""

    shape: out.ReplyShape
    param: str  # the request field holding the prompt, named by a context-length error
    default_tokens: Callable[[ServerConfig], int]  # the reply length when the request gives none
    prompt: Callable[[Any, Any, RequestFormat], Awaitable[_Prompt]]  # (app.state, request body, its format)


async def _generate(request: Request, req: _GenerationRequest, endpoint: _Endpoint) -> Response:
    """Validate, build the prompt, queue the job, and answer with JSON or a stream of events."""
    state = request.app.state
    cfg: ServerConfig = state.config
    _refuse_unsupported(req)
    # the cheap checks first: a refused request never waits for a chat template
    params = _sampling(req)
    max_tokens = _reply_limit(req.asked_tokens(), endpoint.default_tokens(cfg), cfg.max_tokens_cap)
    try:
        fmt = RequestFormat.of(req)
    except ConfigError as e:  # a schema too large, say
        raise APIError(400, str(e), param=format_param(req), code="invalid_response_format") from None
    prompt = await endpoint.prompt(state, req, fmt)
    _check_context(state.engine, prompt.tokens, endpoint.param)
    grammar, calls = await _reply_grammar(state.engine, fmt, prompt, format_param(req))
    if grammar is not None:  # the grammar says where the reply ends: no transcript stop cuts it short
        prompt = _Prompt(prompt.tokens, req.stop_list(), None, prompt.tool_syntax)
    job = _submit(state.worker, Job(prompt.tokens, params, max_tokens, list(prompt.stop), asyncio.get_running_loop(),
                                    shaper=prompt.shaper, grammar=grammar))
    env = out.Envelope.new(endpoint.shape, cfg.model_id, _usage_note(state.engine))
    if req.stream:
        return _JobStream(job, out.events(job.responses(), endpoint.shape, env, req.include_usage(), calls))
    watcher = asyncio.create_task(_watch_client(request, job, cfg.disconnect_poll_s))
    try:
        text, reason, st = await out.collect(job.responses())
    finally:
        watcher.cancel()
        with suppress(asyncio.CancelledError):
            await watcher
    return JSONResponse(out.reply(endpoint.shape, env, text, reason, st, calls))


async def _reply_grammar(engine: Engine, fmt: RequestFormat, prompt: _Prompt,
                         param: str) -> tuple[Grammar | None, ReplyCalls | None]:
    """The compiled grammar the reply follows (None: free text), off the event loop (the first
    one builds the grammar engine's view of the tokenizer), and its calls' reader where tools may
    be called. A format that does not compile is a 400 naming its field, `param`."""
    from ..models.tool_calls import SYNTAXES

    syntax = SYNTAXES[prompt.tool_syntax]
    try:
        spec = fmt.grammar_format(syntax, engine.tokenizer.special_token_id)
        grammar = None if spec is None else await asyncio.to_thread(engine.grammar, spec)
    except ConfigError as e:
        raise APIError(400, str(e), param=param, code="invalid_response_format") from None
    return grammar, (ReplyCalls(fmt, syntax) if fmt.calls else None)


async def _chat_prompt(state: Any, req: ChatCompletionRequest, fmt: RequestFormat) -> _Prompt:
    """The model's chat template, or a base model's plain-text transcript and its stop strings
    (chat_format_for(...).tool_prompt, with the tools the model may call), rendered in a child
    process with a time limit: render.py."""
    try:
        p = await state.renderer.prompt(req.conversation(), req.stop_list(), fmt.prompt_tools())
    except RenderTimeout as e:
        raise APIError(500, f"{e}; the bundle's chat template is too slow for this conversation",
                       type="server_error", param="messages", code="template_timeout") from None
    except RendererStopped:
        raise APIError(503, "The server is shutting down.", type="server_error", code="shutting_down") from None
    return _Prompt(p.tokens, p.stop, p.shaper(), p.tool_syntax)  # a transcript's reply is shaped as ChatSession's


async def _completion_prompt(state: Any, req: CompletionRequest, fmt: RequestFormat) -> _Prompt:
    tokens = await asyncio.to_thread(_prompt_tokens, state.engine, req.prompt)  # a long prompt takes a while
    return _Prompt(tokens, req.stop_list())


_CHAT = _Endpoint(out.CHAT, "messages", lambda cfg: cfg.max_tokens, _chat_prompt)
_COMPLETION = _Endpoint(out.COMPLETION, "prompt", lambda cfg: COMPLETION_MAX_TOKENS, _completion_prompt)


def _refuse_unsupported(req: _GenerationRequest) -> None:
    for param, message in [*unsupported_features(req), *format_conflicts(req)]:
        raise APIError(400, message, param=param, code="unsupported_parameter")


def _sampling(req: _GenerationRequest) -> SamplingParams:
    # pydantic already checked the ranges; SamplingParams checks the combination
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                          seed=req.seed)


def _reply_limit(asked: int | None, default: int, cap: int) -> int:
    """New tokens for a request: what it asked for (at most the cap, else a 400), or the
    endpoint's default within the cap."""
    if asked is None:
        return min(default, cap)
    if asked > cap:
        raise APIError(400, f"max_tokens may be at most {cap} on this server, got {asked}", param="max_tokens",
                       code="max_tokens_exceeded")
    return asked


def _check_context(engine: Engine, tokens: list[int], param: str) -> None:
    """A prompt that leaves no room for a reply is a 400 before anything streams."""
    limit = engine.context_limit
    if limit is not None and len(tokens) >= limit:
        raise APIError(400, f"This model's context holds {limit} tokens and the prompt has {len(tokens)}; "
                            "shorten it.", param=param, code="context_length_exceeded")


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


def _submit(worker: GenerationWorker, job: Job) -> Job:
    try:
        return worker.submit(job)
    except QueueFull as e:
        raise APIError(503, f"The server is busy: {e}", type="server_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None


async def _watch_client(request: Request, job: Job, every_s: float) -> None:
    """Cancel `job` when the client of a non-streamed request goes away."""
    while not job.done.is_set():
        if await request.is_disconnected():
            logger.info("client left; cancelling its generation")
            job.cancel.set()
            return
        await asyncio.sleep(every_s)


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
