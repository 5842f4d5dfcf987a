"""Server-sent events, text deltas that never need taking back, and noticing clients that leave."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.outputs import RequestOutput
from runtime.server.async_engine import EngineFailed, EngineStopped, RequestHandle
from runtime.server.errors import error_body

logger = logging.getLogger("tandem")

DONE = "data: [DONE]\n\n"
REPLACEMENT_CHARACTER = "\ufffd"


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


class EventStream(StreamingResponse):
    """An SSE response whose generator is closed the moment the response ends, however it ends.

    When the client disconnects, Starlette cancels the task sending the response, which can leave
    the generator suspended at a `yield`; closing it here runs its `finally` (which aborts the
    request and frees its pages) now, not whenever the generator is garbage-collected.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


async def guarded(events: AsyncIterator[str], handle: RequestHandle | list[RequestHandle]) -> AsyncIterator[str]:
    """`events`, then [DONE]; an error mid-stream becomes an error event, and an early end aborts the requests."""
    handles = handle if isinstance(handle, list) else [handle]
    try:
        async for event in events:
            yield event
    # The 200 status has been sent: an error can only travel as an event (OpenAI's clients raise on it).
    except EngineStopped as err:
        yield sse(error_body(503, str(err), code="engine_stopped"))
    except EngineFailed as err:
        yield sse(error_body(500, str(err), code="engine_error"))  # the engine thread has logged it
    except Exception as err:
        logger.exception("request %s failed mid-stream", handles[0].request_id)
        yield sse(error_body(500, f"internal server error: {type(err).__name__}: {err}", code="internal_error"))
    finally:
        for each in handles:
            each.abort()
    yield DONE


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the handle, output) from every handle, as the outputs arrive."""
    pending = {asyncio.ensure_future(handle.__anext__()): i for i, handle in enumerate(handles)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                yield i, output
                pending[asyncio.ensure_future(handles[i].__anext__())] = i
    finally:
        for task in pending:
            task.cancel()


class TextDeltas:
    """Cuts the engine's full text-so-far into deltas whose concatenation is the final text.

    Until the request finishes, text that may still change is held back: a trailing U+FFFD (an
    incomplete UTF-8 character that the next token may complete) and the last characters that
    could be the start of a stop string (which would be cut from the text once it completes).
    """

    def __init__(self, stop: tuple[str, ...]):
        self.sent = ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def next(self, text: str, finished: bool) -> str:
        if not finished:
            text = text.rstrip(REPLACEMENT_CHARACTER)
            text = text[: len(text) - self.hold]
        if len(text) <= len(self.sent):
            return ""
        if not text.startswith(self.sent):
            logger.warning("streamed text changed after it was sent; deltas no longer add up to the text")
        delta = text[len(self.sent):]
        self.sent += delta
        return delta


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def result_unless_disconnected(request: Request, handle: RequestHandle) -> RequestOutput | None:
    """The request's final output, or None (and the request aborted) if the client leaves first."""
    results = await results_unless_disconnected(request, [handle])
    return results[0] if results is not None else None


async def results_unless_disconnected(request: Request, handles: list[RequestHandle]) -> list[RequestOutput] | None:
    """Each request's final output, or None (and every request aborted) if the client leaves first."""

    async def all_results() -> list[RequestOutput]:
        return list(await asyncio.gather(*(handle.result() for handle in handles)))

    result = asyncio.ensure_future(all_results())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
        if not result.done() or result.cancelled() or result.exception() is not None:
            for handle in handles:
                handle.abort()
    return result.result() if result.done() and not result.cancelled() else None
