"""The FastAPI app: routes, error handlers, and the engine thread started and stopped with the server."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from runtime.server import lora, metrics
from runtime.server.chat import create_chat_completion
from runtime.server.completions import create_completion
from runtime.server.connections import with_read_deadline
from runtime.server.errors import error_response, install_error_handlers
from runtime.server.middleware import Guard
from runtime.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard, ModelList
from runtime.server.state import ServerState

router = APIRouter()

# What the generation routes answer besides 200, for the OpenAPI schema (FastAPI's own 422 is never sent: a
# request that fails validation gets a 400).
ERRORS = {status: {"model": ErrorResponse, "description": description} for status, description in (
    (400, "a bad request: the message names the field"), (401, "no valid API key (with --api-key)"),
    (404, "another model than the served one"), (413, "a body over --max-request-bytes"),
    (500, "an error inside the engine"), (503, "the waiting queue is full, or the server is shutting down"))}


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health")
async def health(request: Request) -> Response:
    if not _state(request).engine.is_running:
        return error_response(503, "the engine is not running", code="engine_stopped")
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    state = _state(request)
    # `root` is the served name too: a filesystem path tells a client nothing it needs, and an attacker a lot.
    card = ModelCard(id=state.model_name, created=state.created, root=state.model_name,
                     max_model_len=state.max_model_len)
    adapters = [ModelCard(id=name, created=state.created, root=name, parent=state.model_name,
                          max_model_len=state.max_model_len) for name in state.loras]
    return ModelList(data=[card, *adapters])


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(request: Request) -> PlainTextResponse:
    state = _state(request)
    return PlainTextResponse(metrics.render(state.engine.stats, state.http_responses, state.model_name),
                             media_type="text/plain; version=0.0.4")


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    """Forget every cached prefix (vLLM's endpoint); requests in flight keep their pages."""
    await _state(request).engine.call(_state(request).engine.engine.reset_prefix_cache)
    return JSONResponse({"status": "ok"})


@router.post("/v1/completions", responses=ERRORS)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(_state(request), body, request)


@router.post("/v1/chat/completions", responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(_state(request), body, request)


def build_app(state: ServerState, enable_openapi: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            # Uvicorn has let in-flight requests finish (or cancelled them after its timeout);
            # whatever the engine still holds is aborted here.
            await state.engine.stop()
            state.tokenize.close()

    # The OpenAPI pages describe every route and field to whoever asks: off unless asked for.
    docs = {} if enable_openapi else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="Tandem", lifespan=lifespan, **docs)
    app.state.server = state
    app.openapi = lambda: openapi_schema(app)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(lora.router)
    paths = frozenset(route.path for route in [*router.routes, *lora.router.routes])
    app.add_middleware(Guard, state=state, paths=paths)
    return app


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema, less the 422 it documents for every route with a body (ERRORS says what is sent)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


class GracefulServer(uvicorn.Server):
    """Uvicorn, with in-flight requests aborted `shutdown_timeout` seconds into a shutdown.

    Uvicorn stops taking connections on SIGINT/SIGTERM and waits for open responses to end. Requests
    still running after the timeout are aborted in the engine, so that each one ends with an error
    event (or a 503) and its connection closes normally; uvicorn's own cancellation, a few seconds
    later, is only the backstop for a client that stops reading.
    """

    BACKSTOP_S = 5.0

    def __init__(self, app: FastAPI, host: str, port: int, shutdown_timeout: float, log_level: str):
        self.state: ServerState = app.state.server
        limits = self.state.limits
        super().__init__(uvicorn.Config(app, host=host, port=port, lifespan="on", log_level=log_level,
                                        timeout_graceful_shutdown=shutdown_timeout + self.BACKSTOP_S,
                                        http=with_read_deadline(limits.request_read_timeout),
                                        timeout_keep_alive=limits.timeout_keep_alive))
        self.shutdown_timeout = shutdown_timeout

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            # The bound port, which is the point with --port 0; tests read it back from this line.
            host = f"[{host}]" if ":" in host else host
            print(f"tandem serve: serving on http://{host}:{port} (model {self.state.model_name!r}, API at /v1)",
                  file=sys.stderr, flush=True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        abort = asyncio.get_running_loop().call_later(
            self.shutdown_timeout, self.state.engine.abort_all,
            f"the server is shutting down; the request was aborted after {self.shutdown_timeout:g} s",
        )
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()
