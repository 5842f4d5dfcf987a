"""Every failure becomes JSON in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, so no request
can take the server down: 4xx for the client's mistakes, 503 when full or stopping, 500 for our own."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from runtime.server.async_engine import EngineFailed, EngineStopped, QueueFull
from runtime.server.protocol import ErrorInfo, ErrorResponse

MAX_SHOWN_INPUT = 80


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code).model_dump(), status_code=status)


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One message naming the first bad field, and that field."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['ctx']['error']} at character {first['loc'][-1]}", None
    loc = first["loc"][1:]  # the first element says where: "body"
    if not loc:
        if isinstance(first["input"], bytes):
            # FastAPI parses the body as JSON only when the request says it is JSON.
            return "the request body must be JSON, sent with the header Content-Type: application/json", None
        return f"the request body must be a JSON object: {first['msg']}", None
    field = str(loc[0])
    if sum(1 for e in errors if e["loc"][1:2] == (loc[0],)) > 1:
        # A union failed every branch; no single branch's message describes the problem.
        shown = repr(first["input"])
        shown = shown if len(shown) <= MAX_SHOWN_INPUT else shown[:MAX_SHOWN_INPUT] + "..."
        return f"{field}: invalid value {shown}", field
    return f"{'.'.join(map(str, loc))}: {first['msg']}", field


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(400, *describe_validation_error(list(err.errors())))

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, err: ValueError) -> JSONResponse:
        # Our user errors are ValueErrors whose message names the problem (SamplingParams, Engine.validate).
        return error_response(400, str(err), getattr(err, "param", None))

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, err: QueueFull) -> JSONResponse:
        return error_response(503, str(err), code="queue_full")

    @app.exception_handler(EngineStopped)
    async def engine_stopped(request: Request, err: EngineStopped) -> JSONResponse:
        return error_response(503, str(err), code="engine_stopped")

    @app.exception_handler(EngineFailed)
    async def engine_failed(request: Request, err: EngineFailed) -> JSONResponse:
        return error_response(500, str(err), code="engine_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        # Starlette's own: unknown paths (404), wrong methods (405).
        response = error_response(err.status_code, f"{err.detail}: {request.method} {request.url.path}")
        response.headers.update(err.headers or {})  # a 405's Allow: the methods the path takes
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        # Starlette re-raises after sending this response, and uvicorn logs the traceback.
        return error_response(500, f"internal server error: {type(err).__name__}: {err}", code="internal_error")
