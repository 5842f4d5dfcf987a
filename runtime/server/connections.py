"""Connections that send nothing, or send a request slowly, are closed: each one holds a socket and memory;
and a connection is closed so that the client reads the response, even one the server sent early.

Uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), and h11
limits the size of the headers; but a connection that never completes its first request (no bytes,
half the headers, half the body) stays open for ever. Here every request must arrive whole within
`request_read_timeout` seconds of the connection opening, or of the previous response ending.

A 413 is sent on the headers alone, while the client is still sending the body. A socket closed with
bytes unread sends a TCP reset, and the client's stack then drops the response it had received but not
yet read: the client sees "connection reset" instead of the 413. So every close lingers, as nginx's and
Apache's do: the server sends its FIN (the response is complete), then reads and discards what still
arrives until the client closes, for `LINGER_S` seconds at most.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_S = 5.0


class LingeringTransport:
    """The connection's transport, whose `close` half-closes and drains before it closes."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop
        self.lingering = False

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        if not self._transport.can_write_eof():  # TLS cannot half-close
            self._transport.close()
            return
        try:
            self._transport.write_eof()  # after what is buffered: the response goes out whole
        except OSError:  # the client is already gone (ENOTCONN): there is no one to linger for
            self._transport.close()
            return
        self.lingering = True
        self._transport.resume_reading()  # flow control may have paused it while the body arrived
        self._loop.call_later(LINGER_S, self._transport.close)


def with_read_deadline(read_timeout: float) -> type[H11Protocol]:
    class DeadlineH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(LingeringTransport(transport, self.loop))  # type: ignore[arg-type]
            self._arm()

        def data_received(self, data: bytes) -> None:
            if not self.transport.lingering:  # the rest of a refused body, say: read only to be dropped
                super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._deadline = self.loop.call_later(read_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            # DONE: the request has arrived whole and is being answered (a long stream, say); leave it.
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self.logger.info("closing a connection that did not send its request within %g s", read_timeout)
                if self.cycle is not None and not self.cycle.response_complete:
                    self.cycle.disconnected = True
                    self.cycle.message_event.set()
                self.transport.close()

    return DeadlineH11Protocol
