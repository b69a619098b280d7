"""The HTTP side: an ASGI (Starlette) app in front of the generation worker.

Handlers validate the request, apply the context policy (in a thread, the tokenizer is slow) and
queue a job; they wait for the worker's first event before answering, so a request that fails
before generating (a failed rebuild, a full queue) gets a proper status code even when it asked
for a stream. A client that goes away cancels its job.
"""

import asyncio
import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .prompts import Prepared, Prompter
from .protocol import (
    CHAT,
    TEXT,
    APIError,
    Defaults,
    Envelope,
    GenerationRequest,
    choice,
    error_body,
    parse_json,
    parse_request,
)
from .worker import Delta, Failed, Finished, Job, Started, Worker

# How often a waiting handler checks whether its client is still there (seconds).
DISCONNECT_POLL = 0.1


@dataclass
class ServerState:
    """What the handlers share.

    Attributes:
        worker: The generation worker.
        prompter: Renders prompts and applies the context policy.
        defaults: Defaults for fields a request leaves out.
        model_names: Names the served model answers to (the first is its id).
        draft_names: Names the served draft model answers to.
        allowed_origins: CORS origins (``["*"]``: any).
        created: Unix time the app was made (the model card's ``created``).
    """

    worker: Worker
    prompter: Prompter
    defaults: Defaults
    model_names: List[str]
    draft_names: List[str] = field(default_factory=list)
    allowed_origins: List[str] = field(default_factory=lambda: ["*"])
    created: int = 0

    @property
    def model_id(self) -> str:
        return self.model_names[0]

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.model_id.encode("utf-8")).hexdigest()[:12]
        return f"fp_dflash_{digest}"


class Channel:
    """Events from the worker thread to one handler's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: "asyncio.Queue[Any]" = asyncio.Queue()
        self._getter: Optional[asyncio.Future] = None

    def put(self, event: Any) -> None:
        """Thread-safe; raises ``RuntimeError`` once the loop is closed."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def get(
        self, request: Optional[Request] = None, job: Optional[Job] = None
    ) -> Any:
        """The next event; with ``request``, cancels ``job`` if the client disconnects."""
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.queue.get())
        while True:
            done, _ = await asyncio.wait({self._getter}, timeout=DISCONNECT_POLL)
            if done:
                event, self._getter = self._getter.result(), None
                return event
            if request is not None and await request.is_disconnected():
                if job is not None:
                    job.cancelled.set()
                raise ClientGone()

    def close(self) -> None:
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None


class ClientGone(Exception):
    """The client disconnected while its request was waiting."""


def error_response(error: APIError) -> JSONResponse:
    """The JSON response of an :class:`APIError` (status, body and headers)."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _check_models(state: ServerState, request: GenerationRequest) -> None:
    if request.model is not None and request.model not in state.model_names + [
        "default_model"
    ]:
        raise APIError(
            404,
            f"the model {request.model!r} does not exist; this server serves {state.model_id!r}",
            param="model",
            code="model_not_found",
        )
    drafts = state.draft_names + ["default_model"]
    if request.draft_model is not None and request.draft_model not in drafts:
        served = state.draft_names[0] if state.draft_names else "no draft model"
        raise APIError(
            404,
            f"the draft model {request.draft_model!r} does not exist; this server has {served}",
            param="draft_model",
            code="model_not_found",
        )


def _context_headers(prepared: Prepared, started: Started) -> Dict[str, str]:
    """Response headers that tell the client what the context policy did."""
    headers = {
        "X-Context-Epoch": str(started.epoch),
        "X-Cached-Tokens": str(started.cached_tokens),
    }
    if prepared.messages is not None:
        headers["X-Context-Dropped-Turns"] = str(prepared.dropped_turns)
    else:
        headers["X-Context-Dropped-Tokens"] = str(prepared.dropped_tokens)
    return headers


async def _complete(http: Request, kind: str) -> Response:
    """Validate, apply the context policy, queue, and answer (streamed or one body)."""
    state: ServerState = http.app.state.server
    body = parse_json(await http.body())
    request = parse_request(body, kind, state.defaults)
    _check_models(state, request)
    prepared = await run_in_threadpool(state.prompter.prepare, request)
    channel = Channel(asyncio.get_running_loop())
    job = Job(prepared.tokens, request, prepared.dropped, channel.put)
    state.worker.submit(job)
    envelope = Envelope(kind, request.model or state.model_id, state.fingerprint)
    try:
        first = await channel.get(http, job)
    except ClientGone:
        channel.close()
        return Response(status_code=499)
    if isinstance(first, Failed):
        channel.close()
        raise first.error
    headers = _context_headers(prepared, first)
    if request.stream:
        stream = _events(channel, job, request, envelope)
        return StreamingResponse(
            stream,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **headers},
        )
    return await _collect(http, channel, job, request, envelope, headers)


async def _collect(http, channel, job, request, envelope, headers) -> Response:
    """Wait for the whole completion and answer with one body."""
    text, entries = [], []
    try:
        while True:
            event = await channel.get(http, job)
            if isinstance(event, Delta):
                text.append(event.text)
                entries.extend(event.logprobs)
            elif isinstance(event, Failed):
                raise event.error
            elif isinstance(event, Finished):
                break
    except ClientGone:
        return Response(status_code=499)
    finally:
        channel.close()
    body = envelope.base(stream=False)
    body["choices"] = [
        choice(request.kind, False, "".join(text), event.finish_reason, entries or None)
    ]
    body["usage"] = event.usage.body()
    return JSONResponse(body, headers=headers)


def _sse(data: Dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode("utf-8")


async def _events(channel, job, request, envelope) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed completion; a cancelled stream cancels the job."""
    offset = 0
    try:
        if request.kind == CHAT:
            chunk = envelope.base(stream=True)
            chunk["choices"] = [choice(CHAT, True, "", None, first=True)]
            yield _sse(chunk)
        while True:
            event = await channel.get()
            if isinstance(event, Delta):
                if not event.text and not event.logprobs:
                    continue  # text withheld (a possible stop string) or not yet decoded
                chunk = envelope.base(stream=True)
                chunk["choices"] = [
                    choice(
                        request.kind,
                        True,
                        event.text,
                        None,
                        event.logprobs or None,
                        offset=offset,
                    )
                ]
                offset += len(event.text)
                yield _sse(chunk)
            elif isinstance(event, Failed):
                yield _sse(event.error.body())
                return
            elif isinstance(event, Finished):
                chunk = envelope.base(stream=True)
                chunk["choices"] = [choice(request.kind, True, "", event.finish_reason)]
                yield _sse(chunk)
                if request.include_usage:
                    chunk = envelope.base(stream=True)
                    chunk["choices"] = []
                    chunk["usage"] = event.usage.body()
                    yield _sse(chunk)
                yield b"data: [DONE]\n\n"
                return
    finally:
        # Reached on normal end, on error and when Starlette cancels a disconnected stream.
        job.cancelled.set()
        channel.close()


async def chat_completions(http: Request) -> Response:
    """``POST /v1/chat/completions``."""
    return await _complete(http, CHAT)


async def completions(http: Request) -> Response:
    """``POST /v1/completions``: a text or token-id prompt."""
    return await _complete(http, TEXT)


async def models(http: Request) -> Response:
    """``GET /v1/models``: the served model."""
    state: ServerState = http.app.state.server
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model_detail(http: Request) -> Response:
    """``GET /v1/models/{id}``: the served model, or 404."""
    state: ServerState = http.app.state.server
    name = http.path_params["model_id"]
    if name not in state.model_names + ["default_model"]:
        raise APIError(
            404,
            f"the model {name!r} does not exist",
            param="model",
            code="model_not_found",
        )
    return JSONResponse(_model_card(state))


def _model_card(state: ServerState) -> Dict[str, Any]:
    return {
        "id": state.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "dflash",
    }


async def health(http: Request) -> Response:
    """``GET /health``: 200 with the worker's counters while it runs, else 503."""
    state: ServerState = http.app.state.server
    worker = state.worker
    body = {
        "status": "ok" if worker.healthy else "unavailable",
        "busy": worker.busy,
        "queued": worker.queue.qsize(),
        "sessions": len(worker.pool),
        **worker.stats,
    }
    return JSONResponse(body, status_code=200 if worker.healthy else 503)


async def _api_error(http: Request, error: APIError) -> Response:
    return error_response(error)


async def _http_error(http: Request, error: HTTPException) -> Response:
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    message = {
        404: f"no route {http.url.path}",
        405: f"method {http.method} is not allowed " f"on {http.url.path}",
    }.get(error.status_code, str(error.detail))
    return JSONResponse(
        error_body(message, kind),
        status_code=error.status_code,
        headers=getattr(error, "headers", None),
    )


async def _unexpected(http: Request, error: Exception) -> Response:
    return JSONResponse(
        error_body(f"internal error: {type(error).__name__}", "server_error"),
        status_code=500,
    )


def create_app(state: ServerState, start_worker: bool = True) -> Starlette:
    """The ASGI app.

    Args:
        state: The worker, prompter and settings.
        start_worker: Start the worker on startup and stop it on shutdown.

    Returns:
        A Starlette application.
    """
    state.created = int(time.time())
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_detail, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_worker:
            state.worker.start()
        try:
            yield
        finally:
            if start_worker:
                await run_in_threadpool(state.worker.stop)

    middleware = [
        Middleware(
            CORSMiddleware,
            allow_origins=state.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=[
                "X-Context-Epoch",
                "X-Cached-Tokens",
                "X-Context-Dropped-Turns",
                "X-Context-Dropped-Tokens",
                "Retry-After",
            ],
        )
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    app.state.server = state
    return app
