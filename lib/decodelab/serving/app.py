"""The HTTP routes: an OpenAI-compatible API on the engine (FastAPI).

    POST /v1/completions, /v1/chat/completions   whole answers, or with "stream": true server-sent events
    GET  /v1/models                              the one model served
    GET  /health                                 200 while the engine thread runs, else 503
    GET  /metrics                                Prometheus text (`serving.metrics`)

With an api_key, every /v1 route wants `Authorization: Bearer KEY` (401 otherwise); /health and
/metrics stay open, as vLLM has them. Every error is OpenAI's shape (`protocol.ApiError`).

A request's samples run on the engine thread (`serving.engine_loop`); the route awaits their
updates. A client that goes away (its stream closed, or the connection dropped while it waited for
a whole answer) is aborted there, and its KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from decodelab.serving.client_request import ClientRequest
from decodelab.serving.engine_loop import EngineLoop, EngineUnavailableError, QueueFullError
from decodelab.serving.metrics import ServingMetrics
from decodelab.serving.protocol import (
    ApiError,
    GenerationRequest,
    ServedModel,
    chat_request,
    completion_request,
    error_body,
    parse_json_object,
)
from decodelab.serving.responses import ResponseShape, server_sent_event

RETRY_AFTER_SECONDS = 1  # what a 503 tells the client to wait
CLIENT_GONE = 499  # nginx's status for a client that closed the connection (nobody reads it)


def build_app(llm, model_name: str, api_key: str | None = None, max_queue: int = 256) -> FastAPI:
    """The server's app for `llm`, served as `model_name`. Starting the app (its lifespan) starts
    the engine thread; stopping it stops the thread. app.state holds engine_loop, metrics, model."""
    metrics = ServingMetrics()
    engine_loop = EngineLoop(llm, max_waiting=max_queue, metrics=metrics)
    model = ServedModel.of(llm, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="decodelab", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop, app.state.metrics, app.state.model = engine_loop, metrics, model
    app.add_exception_handler(ApiError, api_error_response)
    app.add_exception_handler(HTTPException, http_error_response)
    app.include_router(api_routes(engine_loop, model, api_key))
    app.include_router(operations_routes(engine_loop, metrics))
    return app


# --------------------------------------------------------------------------- errors


async def api_error_response(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def http_error_response(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (no such route, wrong method) in OpenAI's shape."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(
        error_body(message, code=str(exc.status_code)),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


def api_key_check(api_key: str | None):
    """A dependency: with an api_key, a request must carry `Authorization: Bearer <api_key>`."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            message = "missing API key: send Authorization: Bearer KEY" if not given else "incorrect API key"
            raise ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


# --------------------------------------------------------------------------- routes


def api_routes(engine_loop: EngineLoop, model: ServedModel, api_key: str | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(api_key))])
    started = int(time.time())

    @router.get("/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model.name,
                    "object": "model",
                    "created": started,
                    "owned_by": "decodelab",
                    "max_model_len": model.context_length,
                }
            ],
        }

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        job = completion_request(parse_json_object(await request.body()), model)
        return await answer(request, engine_loop, job, ResponseShape(model.name, chat=False))

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        job = chat_request(parse_json_object(await request.body()), model)
        return await answer(request, engine_loop, job, ResponseShape(model.name, chat=True))

    return router


def operations_routes(engine_loop: EngineLoop, metrics: ServingMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if engine_loop.is_alive:
            return JSONResponse({"status": "ok"})
        why = f": {engine_loop.failure}" if engine_loop.failure is not None else ""
        return JSONResponse(error_body(f"the engine loop is not running{why}", "server_error"), status_code=503)

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


# --------------------------------------------------------------------------- answering


async def answer(request: Request, engine_loop: EngineLoop, job: GenerationRequest, shape: ResponseShape) -> Response:
    """Hand the job to the engine thread; answer whole, or as a stream of events."""
    try:
        client = ClientRequest(engine_loop, job.prompts, job.params)
    except QueueFullError as exc:
        raise ApiError(
            503, str(exc), type="server_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
        ) from None
    except EngineUnavailableError as exc:
        raise ApiError(503, str(exc), type="server_error", code="engine_unavailable") from None
    if job.stream:
        return EventStreamResponse(stream_events(client, job, shape), on_close=client.abort)
    try:
        final = await unless_disconnected(request, client.final())
    finally:
        client.abort()  # a no-op once every choice finished
    if final is None:
        return Response(status_code=CLIENT_GONE)
    failed = next((update for update in final if update.finish_reason == "error"), None)
    if failed is not None:
        raise ApiError(500, failed.error or "generation failed", type="server_error")
    return JSONResponse(
        shape.response(
            [u.text for u in final],
            [u.finish_reason for u in final],
            job.num_prompt_tokens,
            sum(u.num_tokens for u in final),
        )
    )


async def stream_events(client: ClientRequest, job: GenerationRequest, shape: ResponseShape) -> AsyncIterator[str]:
    """The answer as server-sent events: each choice's new text as it comes, its finish reason, the
    usage if asked, then [DONE]. Text that could still turn out to be the start of a stop string is
    held back until it cannot (the engine cuts a stop string off only once it is complete), so the
    streamed text is exactly the whole answer's."""
    holdback = max((len(stop) for stop in job.params.stop), default=1) - 1
    sent = [0] * job.num_choices
    if shape.chat:
        for choice in range(job.num_choices):
            yield server_sent_event(shape.chunk(choice, "", first=True))
    completion_tokens = 0
    async for updates in client.updates():
        for update in updates:
            if update.finish_reason == "error":
                yield server_sent_event(error_body(update.error or "generation failed", "server_error"))
                yield server_sent_event("[DONE]")
                return
            end = len(update.text) if update.finished else len(update.text) - holdback
            if end > sent[update.choice]:
                yield server_sent_event(shape.chunk(update.choice, update.text[sent[update.choice] : end]))
                sent[update.choice] = end
            if update.finished:
                completion_tokens += update.num_tokens
                yield server_sent_event(shape.chunk(update.choice, "", update.finish_reason))
    if job.include_usage:
        yield server_sent_event(shape.usage_chunk(job.num_prompt_tokens, completion_tokens))
    yield server_sent_event("[DONE]")


class EventStreamResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends: finished, the client gone
    (Starlette stops the stream when the connection drops), or an error."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close):
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def unless_disconnected(request: Request, work: Awaitable):
    """work's result, or None if the client disconnects first (work is then cancelled)."""
    work, gone = asyncio.ensure_future(work), asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
    return work.result() if work.done() and not work.cancelled() else None


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (its body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
