"""What one gRPC stream message costs, against one message carrying many requests' tokens: the
saving a multiplexed worker -> router stream (one message per engine step) would bring (issue 7).

    per-request streams   N Worker.Generate streams, one message per stream per step
    one stream            1 stream, one message per step carrying N token ids

Server and client run in this process over loopback (grpc.aio, the router's and the worker's
stack), so the CPU per token is both sides together. Prints the CPU µs per token of each, in
alternating runs (and writes them with the machine to ``--out``).

    python bench/stream_fanin_bench.py [--streams 64] [--steps 300] [--rounds 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402

from _common import machine  # noqa: E402
from tandem.worker.v1 import worker_pb2 as pb, worker_pb2_grpc  # noqa: E402


class _Worker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, streams: int, steps: int):
        self.streams, self.steps = streams, steps

    async def Generate(self, request, context):
        batched = request.request_id == "one-stream"
        for s in range(self.steps):
            yield pb.GenerateResponse(token_ids=list(range(self.streams)) if batched else [s], decode_steps=s)


async def _run(args) -> list[dict]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(_Worker(args.streams, args.steps), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    rows = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)

            async def tokens(rid: str) -> int:
                return sum([len(m.token_ids) async for m in stub.Generate(pb.GenerateRequest(request_id=rid))])

            for _ in range(args.rounds):
                for mode in ("per-request streams", "one stream"):
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    if mode == "one stream":
                        n = await tokens("one-stream")
                    else:
                        n = sum(await asyncio.gather(*(tokens(f"r{i}") for i in range(args.streams))))
                    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                    rows.append({"mode": mode, "tokens": n, "cpu_us_per_token": 1e6 * cpu / n, "wall_s": wall})
                    print(f"{mode:>20}: {n} tokens, {1e6 * cpu / n:.1f} µs of CPU a token, wall {wall:.2f} s", flush=True)
    finally:
        await server.stop(0)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64, help="requests (streams) per step")
    ap.add_argument("--steps", type=int, default=300, help="messages per stream")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of both modes")
    ap.add_argument("--out", type=Path, help="write the runs and the machine here (JSON)")
    args = ap.parse_args()
    rows = asyncio.run(_run(args))
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "command": " ".join(sys.argv), "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
