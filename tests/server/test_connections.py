"""The lingering close of `runtime.server.connections` on real sockets, without a server around it."""

import asyncio
import socket
import struct

from runtime.server.connections import LingeringTransport


def test_closing_a_connection_the_client_has_reset_closes_it_without_an_error():
    # The CI's SIGTERM test once raised ENOTCONN from write_eof here: a client gone before the response ended.
    async def scenario():
        loop = asyncio.get_running_loop()
        made = loop.create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport):
                made.set_result(transport)

        server = await loop.create_server(Accept, "127.0.0.1", 0)
        client = socket.create_connection(server.sockets[0].getsockname())
        transport = await made
        transport.pause_reading()  # the reset is not read, as when the engine thread holds the loop
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # a zero linger sends a reset
        await asyncio.sleep(0.2)
        lingering = LingeringTransport(transport, loop)
        lingering.close()
        assert transport.is_closing() and not lingering.lingering
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())
