"""HTTP (OpenAI-compatible) front vs gRPC front of the same router, on the same run (issue 12).

One suite as processes (kvstore, one tiny-model worker on the torch backend, the router serving
gRPC and ``--http-port``). Both fronts get the same requests: prompts of ``--prompt-len`` random
printable bytes, unique per request (no prefix reuse, so neither front profits from the other's
cache), greedy, ``--max-tokens`` tokens each, streamed. Per concurrency level, rounds of
``concurrency`` simultaneous requests alternate between the fronts in ABBA order, so drifting load
from other processes hits both alike. Measured from the client:

* TTFT: request sent → first streamed message carrying a token (gRPC: the first GenerateResponse;
  HTTP: the first SSE ``data:`` event, which the router sends with the first token);
* tokens/s: completion tokens / wall time of that front's rounds.

The HTTP client is ``httpx2``/``httpx`` (what the ``openai`` package uses underneath) reading the SSE lines;
the gRPC client ``grpc.aio``; both in this process, one event loop.

    python bench/http_bench.py                                    # ~2-3 min on 2 busy cores
    python bench/http_bench.py --quick                            # smoke (~30 s)
    python bench/http_bench.py --json http.json --plot docs/img/http_bench.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import free_port, machine, start_suite  # noqa: E402

FRONTS = ("grpc", "http")


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` printable ASCII bytes (the byte tokenizer: 1 token each)."""
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(n)]


def sse_events(lines) -> list[dict]:
    """The JSON events of SSE ``lines`` up to ``data: [DONE]`` (pure; for tests)."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        out.append(json.loads(data))
    return out


async def grpc_one(stub, ids: list[int], max_tokens: int) -> tuple[float, int]:
    from services.common.wire import tokens_to_proto
    from tandem.router.v1 import router_pb2

    req = router_pb2.GenerateRequest(token_ids=tokens_to_proto(ids), max_new_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async for msg in stub.Generate(req, timeout=120):
        if msg.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        tokens += len(msg.token_ids)
    return ttft, tokens


async def http_one(client, url: str, ids: list[int], max_tokens: int) -> tuple[float, int]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft, tokens


async def run_levels(router: str, http_url: str, args) -> dict:
    import grpc

    try:  # the HTTP library the openai package uses (httpx2 from openai 3, httpx before)
        import httpx2 as httpx
    except ImportError:
        import httpx

    from tandem.router.v1 import router_pb2_grpc

    channel = grpc.aio.insecure_channel(router)
    stub = router_pb2_grpc.RouterStub(channel)
    client = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64))
    url = f"{http_url}/v1/completions"
    results = {}
    try:
        # warm-up: both fronts, a few requests (imports, first-step costs, connection set-up)
        for ids in prompts(args.seed + 99, 2, args.prompt_len):
            await grpc_one(stub, ids, 4)
            await http_one(client, url, ids, 4)
        for level, c in enumerate(args.concurrency):
            pool = prompts(args.seed + level, 2 * args.requests, args.prompt_len)
            per = {f: {"ttft": [], "tokens": 0, "wall": 0.0} for f in FRONTS}
            rounds = args.requests // c
            for r in range(rounds):
                order = FRONTS if r % 4 in (0, 3) else FRONTS[::-1]  # ABBA
                for front in order:
                    batch = [pool.pop() for _ in range(c)]
                    t0 = time.perf_counter()
                    if front == "grpc":
                        done = await asyncio.gather(*(grpc_one(stub, ids, args.max_tokens) for ids in batch))
                    else:
                        done = await asyncio.gather(*(http_one(client, url, ids, args.max_tokens) for ids in batch))
                    per[front]["wall"] += time.perf_counter() - t0
                    per[front]["ttft"] += [t for t, _ in done]
                    per[front]["tokens"] += sum(n for _, n in done)
                print(f"  concurrency {c}: round {r + 1}/{rounds}", flush=True)
            results[c] = {
                f: {"ttft_p50_ms": 1000 * statistics.median(v["ttft"]),
                    "ttft_p90_ms": 1000 * statistics.quantiles(v["ttft"], n=10)[-1] if len(v["ttft"]) > 1 else float("nan"),
                    "tokens_per_s": v["tokens"] / v["wall"], "requests": len(v["ttft"]), "tokens": v["tokens"]}
                for f, v in per.items()
            }
    finally:
        await client.aclose()
        await channel.close()
    return results


def markdown(results: dict) -> str:
    rows = ["| concurrency | front | requests | TTFT p50 | TTFT p90 | tokens/s |", "|---:|---|---:|---:|---:|---:|"]
    for c, per in results.items():
        for f in FRONTS:
            r = per[f]
            rows.append(f"| {c} | {f} | {r['requests']} | {r['ttft_p50_ms']:.1f} ms | {r['ttft_p90_ms']:.1f} ms | {r['tokens_per_s']:.1f} |")
        g, h = per["grpc"], per["http"]
        rows.append(f"| {c} | **HTTP − gRPC** | | **{h['ttft_p50_ms'] - g['ttft_p50_ms']:+.1f} ms** | | "
                    f"**{100 * (h['tokens_per_s'] / g['tokens_per_s'] - 1):+.1f} %** |")
    return "\n".join(rows)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    width = 0.38
    for i, f in enumerate(FRONTS):
        xs = [j + (i - 0.5) * width for j in range(len(levels))]
        a.bar(xs, [results[c][f]["ttft_p50_ms"] for c in levels], width, label=f)
        b.bar(xs, [results[c][f]["tokens_per_s"] for c in levels], width, label=f)
    for ax, label in ((a, "TTFT p50 (ms)"), (b, "output tokens/s")):
        ax.set_xticks(range(len(levels)), [f"c={c}" for c in levels])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32, help="requests per front per concurrency level")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (router default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 8 requests per front, concurrency 1 and 2")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency = 8, [1, 2]
    http_port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        print("starting kvstore, worker (tiny, CPU) and router (gRPC + HTTP) ...", flush=True)
        suite = start_suite(Path(logs), [["--model", "tiny", "--spec-mode", "eagle3", "--num-blocks", "2048"]],
                            ["--model", "tiny", "--http-port", str(http_port), "--num-draft-tokens", str(args.k)])
        try:
            results = asyncio.run(run_levels(suite.router, f"http://127.0.0.1:{http_port}", args))
        finally:
            suite.stop()
    m = machine()
    print(markdown(results))
    out = {"machine": m, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "results": {str(c): v for c, v in results.items()}}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    if args.plot:
        plot(results, args.plot, f"HTTP vs gRPC front, tiny model on CPU ({m['nproc']} cores, {m['date']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
