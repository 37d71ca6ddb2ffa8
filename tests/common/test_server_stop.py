"""services/common/server.py: what runs once a server has drained. A plain callback runs in a
thread (it may block); a coroutine function is awaited on the server's loop (a ``grpc.aio``
channel can only be closed there)."""

from __future__ import annotations

import asyncio
import threading

from services.common.server import GrpcServer


def test_stop_callbacks_run_after_draining_blocking_ones_in_a_thread_coroutines_on_the_loop():
    ran: list[tuple[str, bool]] = []

    async def main():
        loop_thread = threading.get_ident()
        server = GrpcServer([], port=0, grace_s=0)
        await server.start()

        def blocking():
            ran.append(("blocking", threading.get_ident() == loop_thread))

        async def closing():
            await asyncio.sleep(0)
            ran.append(("coroutine", threading.get_ident() == loop_thread))

        server.on_stop(blocking)
        server.on_stop(closing)
        assert ran == []
        await server.stop()

    asyncio.run(main())
    assert ran == [("blocking", False), ("coroutine", True)]
