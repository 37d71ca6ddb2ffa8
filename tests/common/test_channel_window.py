"""``stream_window_options``: a reader's small stream window stops a gRPC sender within a few
messages of what it read (real grpc.aio server and client on loopback)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.channels import stream_window_options
from services.common.errors import InvalidArgument
from tandem.worker.v1 import worker_pb2 as pb
from tandem.worker.v1 import worker_pb2_grpc

MESSAGES = 2000


class Sender(worker_pb2_grpc.WorkerServicer):
    """Streams MESSAGES one-token messages as fast as its sends complete, counting them."""

    def __init__(self):
        self.sent = 0

    async def Generate(self, request, context):
        for i in range(MESSAGES):
            yield pb.GenerateResponse(token_ids=[i])
            self.sent += 1


async def sent_while_the_reader_pauses(window_bytes: int) -> int:
    sender = Sender()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(sender, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=stream_window_options(window_bytes)) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Generate(pb.GenerateRequest(request_id="r"), timeout=10)
            await call.read()  # one message read, then the reader pauses
            # until the sender got 1000 ahead (gRPC's window lets it) or 0.5 s passed (a small one stops it)
            for _ in range(100 if window_bytes else 1000):
                await asyncio.sleep(0.005)
                if sender.sent > 1000:
                    break
            ahead = sender.sent - 1
            call.cancel()
            return ahead
    finally:
        await server.stop(None)


def test_a_small_window_holds_the_sender_within_a_few_messages_of_the_reader():
    assert asyncio.run(sent_while_the_reader_pauses(64)) < 50
    assert asyncio.run(sent_while_the_reader_pauses(0)) >= 1000  # gRPC's own window: it queues them all


def test_options():
    assert stream_window_options(0) == ()
    assert dict(stream_window_options(64)) == {"grpc.http2.bdp_probe": 0, "grpc.http2.lookahead_bytes": 64}
    with pytest.raises(InvalidArgument):
        stream_window_options(-1)
