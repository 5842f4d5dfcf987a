"""Connections that send nothing, or send a request slowly, are closed: each one holds a socket and memory.

Uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), and h11
limits the size of the headers; but a connection that never completes its first request (no bytes,
half the headers, half the body) stays open for ever. Here every request must arrive whole within
`request_read_timeout` seconds of the connection opening, or of the previous response ending.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_read_deadline(read_timeout: float) -> type[H11Protocol]:
    class DeadlineH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

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
