"""The HTTP front's listening socket: accepted connections must get TCP_NODELAY, or Nagle holds
an SSE event written right after the response headers until the client's delayed ACK (~40 ms)."""

from __future__ import annotations

import asyncio
import socket

from services.router.http.server import bind


def test_accepted_connections_have_tcp_nodelay():
    async def run() -> int:
        sock = bind("127.0.0.1", 0)
        seen: list[int] = []

        def on_connect(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)  # as uvicorn serves a given socket
        host, port = sock.getsockname()[:2]
        _r, w = await asyncio.open_connection(host, port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        w.close()
        server.close()
        await server.wait_closed()
        return seen[0]

    assert asyncio.run(run()) != 0
