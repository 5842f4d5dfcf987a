"""What every HTTP request passes before any route: the API key, the body size limit, and the count of
responses by status code. Plain ASGI, so that streamed responses pass through untouched."""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.errors import error_response
from runtime.server.state import ServerState

OPEN_PATHS = frozenset({"/health", "/metrics"})


class TooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes "
                              "(--max-request-bytes)")


class Guard:
    def __init__(self, app: ASGIApp, state: ServerState, paths: frozenset[str]):
        # `paths`: the app's routes, to label refused requests in the metrics by route, never by a raw path
        # (that is the client's choice, and a label per random path would grow without bound).
        self.app, self.state, self.paths = app, state, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # if the app fails before it starts a response, ServerErrorMiddleware sends a 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 413:
                    # The rest of the body is not wanted: closing is the only way not to read it (a chunked body
                    # could go on until the read deadline, 187 MiB of it in a test).
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, counting_send)
            await self.app(scope, self._limited(receive), counting_send)
        finally:
            handler = scope["path"] if scope["path"] in self.paths else "unmatched"
            self.state.http_responses[(scope["method"], handler, status)] += 1

    def _refusal(self, scope: Scope):
        """An error response for a request refused on its headers alone, or None."""
        headers = dict(scope["headers"])
        key = self.state.api_key
        # /health and /metrics stay open for probes and scrapers; everything that serves or changes state is guarded.
        if key is not None and scope["path"] not in OPEN_PATHS:
            sent = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
                return error_response(401, "a valid API key is required: send the header `Authorization: Bearer KEY` "
                                      "(the server's --api-key or TANDEM_API_KEY)", code="invalid_api_key")
        length = headers.get(b"content-length")
        limit = self.state.limits.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return error_response(413, TooLarge(limit).detail, code="request_too_large")
        return None

    def _limited(self, receive: Receive) -> Receive:
        """`receive`, raising 413 once the body passes the limit (a chunked body has no length to check first)."""
        limit, received = self.state.limits.max_request_bytes, 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise TooLarge(limit)
            return message

        return limited
