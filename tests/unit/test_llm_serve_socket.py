"""serve's listening socket (hpcmac.llm.server.bind): what uvicorn accepts on it.

uvicorn serves an already-bound socket through ``loop.create_server(sock=...)``, and
asyncio turns Nagle off (TCP_NODELAY) only on a connection whose socket names
IPPROTO_TCP as its protocol, which it inherits from the listener at accept. A listener
made with protocol 0 left Nagle on: a stream's first chunk then waited behind the
unacknowledged response headers for the client's delayed ACK, ~40 ms on every TTFT.
Checked here on a real accepted connection, through the same asyncio call uvicorn makes.
"""

from __future__ import annotations

import asyncio
import socket

from hpcmac.llm.server import bind


def _accepted_nodelay(host: str) -> int:
    sock = bind(host, 0)
    got: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            s = transport.get_extra_info("socket")
            got.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main():
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection(host, port)
        for _ in range(200):
            if got:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    try:
        asyncio.run(asyncio.wait_for(main(), 10))
    finally:
        sock.close()
    assert got, "no connection was accepted"
    return got[0]


def test_accepted_connections_have_nagle_off():
    assert _accepted_nodelay("127.0.0.1") != 0
