"""HTTP (OpenAI-compatible) front vs gRPC front of the same router, on the same run (issue 12).

One suite as processes (kvstore, one tiny-model worker on the torch backend, the router serving
gRPC and ``--http-port``, with ``--front-trace``). Every series gets the same kind of request, the
same token ids (OpenAI completions take a prompt as a list of ints, as gRPC's ``token_ids``):
``--prompt-len`` random printable bytes, unique per request (no prefix reuse), greedy,
``--max-tokens`` tokens, streamed. Three series: gRPC (``grpc.aio``); HTTP with ``httpx2``/``httpx``
(what the ``openai`` package uses underneath) reading the SSE lines; HTTP with a minimal client
(``RawHttp``: one write per request, the chunked answer parsed off the socket), which tells the
front's cost from a Python HTTP library's. Per concurrency level, rounds of ``concurrency``
simultaneous requests cycle through the series in all six orders, so drifting load hits each alike.

* TTFT: request sent → first streamed message carrying a token (gRPC: the first GenerateResponse;
  HTTP: the first SSE ``data:`` event, which the router sends with the first token);
* tokens/s: completion tokens / wall time of that series' rounds;
* stages, from the router's front trace and the client's times on one monotonic clock: client →
  front (client library, kernel, server parsing), front → dispatch (body, validation, job),
  dispatch → first event (dispatcher and worker: the same work for every series), first event →
  write (the front's first answer bytes), write → client;
* front overhead: TTFT less dispatch → first event, per request. It leaves the worker's prefill
  out, so its p50 resolves a fraction of a ms where TTFT's own p50 cannot; Δs come with a 95 %
  bootstrap interval.

    python bench/http_bench.py                                    # ~2-3 min on 2 busy cores
    python bench/http_bench.py --quick                            # smoke (~30 s)
    python bench/http_bench.py --requests 200 --concurrency 1 16 --prompt-len 32 --json http.json --plot docs/img/http_bench.png
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import free_port, machine, start_suite  # noqa: E402

from services.router.front_trace import STAMPS, prompt_key, read_trace  # noqa: E402

# the series: gRPC (grpc.aio); HTTP with httpx2/httpx, what the openai package uses underneath; HTTP
# with a minimal client (one write per request, the chunked SSE answer read off the socket), so
# that what the front adds can be told from what a Python HTTP client library adds
FRONTS = ("grpc", "http", "http-raw")
HTTP_SERIES = FRONTS[1:]


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` printable ASCII bytes (the byte tokenizer: 1 token each)."""
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(n)]


@dataclass
class Sent:
    """One request as the client saw it: ``time.monotonic()`` when sent and at its first token (the
    router's front trace uses the same clock), completion tokens, the prompt's trace key."""

    t_sent: float
    t_first: float
    tokens: int
    key: str

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_sent


async def grpc_one(stub, ids: list[int], max_tokens: int) -> Sent:
    from services.common.wire import tokens_to_proto
    from tandem.router.v1 import router_pb2

    req = router_pb2.GenerateRequest(token_ids=tokens_to_proto(ids), max_new_tokens=max_tokens, temperature=0.0)
    t0 = time.monotonic()
    first, tokens = None, 0
    async for msg in stub.Generate(req, timeout=120):
        if msg.token_ids and first is None:
            first = time.monotonic()
        tokens += len(msg.token_ids)
    return Sent(t0, first, tokens, prompt_key(ids))


async def http_one(client, url: str, ids: list[int], max_tokens: int) -> Sent:
    """The same token ids as gRPC gets (OpenAI completions take a prompt as a list of ints)."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first, tokens = None, 0
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if first is None:
                first = time.monotonic()
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return Sent(t0, first, tokens, prompt_key(ids))


STAGES = {  # name: (from, to) over the client's times (t_sent, t_first) and the router's stamps
    "client → front": ("t_sent", "entry"),
    "front → dispatch": ("entry", "dispatch"),
    "dispatch → first event": ("dispatch", "first_event"),
    "first event → write": ("first_event", "first_write"),
    "write → client": ("first_write", "t_first"),
}
WORKER_STAGE = "dispatch → first event"  # the dispatcher, the worker's prefill: the same for both fronts


class RawHttp:
    """The least an HTTP client can add: keep-alive connections (one per request in flight), each
    request sent in one write, the chunked SSE answer parsed straight off the socket."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self._idle: list = []

    async def one(self, ids: list[int], max_tokens: int) -> Sent:
        body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        reader, writer = self._idle.pop() if self._idle else await asyncio.open_connection(self.host, self.port)
        t0 = time.monotonic()
        writer.write(head + body)
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP answer {status!r}")
        while await reader.readline() != b"\r\n":  # headers
            pass
        first, tokens = None, 0
        while True:
            size = int(await reader.readline(), 16)
            data = (await reader.readexactly(size + 2))[:-2]
            if size == 0:
                break
            for line in data.split(b"\n"):
                if not line.startswith(b"data: "):
                    continue
                first = first or time.monotonic()
                if line != b"data: [DONE]":
                    usage = json.loads(line[6:]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
        self._idle.append((reader, writer))
        return Sent(t0, first, tokens, prompt_key(ids))

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()


async def run_levels(router: str, http_url: str, args) -> dict[int, dict[str, list[Sent]]]:
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
    raw = RawHttp(http_url)
    calls = {"grpc": lambda ids, n: grpc_one(stub, ids, n), "http": lambda ids, n: http_one(client, url, ids, n),
             "http-raw": raw.one}
    orders = [(0, 1, 2), (2, 1, 0), (1, 2, 0), (0, 2, 1), (2, 0, 1), (1, 0, 2)]  # each series in each place alike
    sent: dict[int, dict[str, list[Sent]]] = {}
    try:
        # warm-up: every series (imports, first-step costs, connection set-up)
        for ids in prompts(args.seed + 99, args.warmup, args.prompt_len):
            for call in calls.values():
                await call(ids, 4)
        for level, c in enumerate(args.concurrency):
            pool = prompts(args.seed + level, len(FRONTS) * args.requests, args.prompt_len)
            per: dict[str, list[Sent]] = {f: [] for f in FRONTS}
            walls = {f: 0.0 for f in FRONTS}
            rounds = args.requests // c
            for r in range(rounds):
                for front in (FRONTS[i] for i in orders[r % len(orders)]):
                    batch = [pool.pop() for _ in range(c)]
                    t0 = time.perf_counter()
                    done = await asyncio.gather(*(calls[front](ids, args.max_tokens) for ids in batch))
                    walls[front] += time.perf_counter() - t0
                    per[front] += done
                if (r + 1) % max(1, rounds // 8) == 0 or r + 1 == rounds:
                    print(f"  concurrency {c}: round {r + 1}/{rounds}", flush=True)
            sent[c] = {f: (per[f], walls[f]) for f in FRONTS}
    finally:
        raw.close()
        await client.aclose()
        await channel.close()
    return sent


def p50_delta_ci(a: list[float], b: list[float], seed: int = 0, reps: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of median(b) − median(a) (the resolution of a Δ p50)."""
    rng = random.Random(seed)
    deltas = sorted(statistics.median(rng.choices(b, k=len(b))) - statistics.median(rng.choices(a, k=len(a)))
                    for _ in range(reps))
    return deltas[int(0.025 * reps)], deltas[int(0.975 * reps) - 1]


def stage_times(sent: list[Sent], trace: dict[str, dict]) -> dict[str, list[float]]:
    """Per stage, the seconds each traced request spent in it, and its front overhead: TTFT less the
    worker stage (what the front, its transport and its client library add)."""
    out: dict[str, list[float]] = {name: [] for name in STAGES} | {"front overhead": []}
    for s in sent:
        line = trace.get(s.key)
        if line is None or not all(k in line for k in STAMPS):
            continue
        t = line | {"t_sent": s.t_sent, "t_first": s.t_first}
        for name, (start, end) in STAGES.items():
            out[name].append(t[end] - t[start])
        out["front overhead"].append(s.ttft - out[WORKER_STAGE][-1])
    return out


def summarize(sent: dict, trace: dict[str, dict]) -> dict:
    """Per level: each front's TTFT, tokens/s and stage medians; HTTP − gRPC with 95 % intervals."""
    ms = 1000.0
    results = {}
    for c, per in sent.items():
        level, stages = {}, {}
        for f, (done, wall) in per.items():
            ttft = [s.ttft for s in done]
            stages[f] = stage_times(done, trace)
            level[f] = {"ttft_p50_ms": ms * statistics.median(ttft),
                        "ttft_p90_ms": ms * statistics.quantiles(ttft, n=10)[-1] if len(ttft) > 1 else float("nan"),
                        "tokens_per_s": sum(s.tokens for s in done) / wall, "requests": len(done),
                        "tokens": sum(s.tokens for s in done),
                        "traced": len(stages[f]["front overhead"]),
                        "stages_p50_ms": {k: ms * statistics.median(v) for k, v in stages[f].items() if v}}
        level["delta"] = {}
        for f in HTTP_SERIES:  # each HTTP series against gRPC
            g, h = per["grpc"][0], per[f][0]
            lo, hi = p50_delta_ci([s.ttft for s in g], [s.ttft for s in h])
            delta = {"ttft_p50_ms": level[f]["ttft_p50_ms"] - level["grpc"]["ttft_p50_ms"],
                     "ttft_p50_ci95_ms": [ms * lo, ms * hi],
                     "tokens_per_s_pct": 100 * (level[f]["tokens_per_s"] / level["grpc"]["tokens_per_s"] - 1)}
            go, ho = stages["grpc"]["front overhead"], stages[f]["front overhead"]
            if go and ho:
                lo, hi = p50_delta_ci(go, ho)
                delta |= {"front_overhead_p50_ms": ms * (statistics.median(ho) - statistics.median(go)),
                          "front_overhead_p50_ci95_ms": [ms * lo, ms * hi]}
            level["delta"][f] = delta
        results[c] = level
    return results


def markdown(results: dict) -> str:
    rows = ["| concurrency | front | requests | TTFT p50 | TTFT p90 | tokens/s | front overhead p50 |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for c, per in results.items():
        for f in FRONTS:
            r = per[f]
            over = r["stages_p50_ms"].get("front overhead")
            rows.append(f"| {c} | {f} | {r['requests']} | {r['ttft_p50_ms']:.2f} ms | {r['ttft_p90_ms']:.2f} ms | "
                        f"{r['tokens_per_s']:.1f} | {'' if over is None else f'{over:.2f} ms'} |")
        for f, d in per["delta"].items():
            lo, hi = d["ttft_p50_ci95_ms"]
            over = ""
            if "front_overhead_p50_ms" in d:
                olo, ohi = d["front_overhead_p50_ci95_ms"]
                over = f"**{d['front_overhead_p50_ms']:+.2f} ms** [{olo:+.2f}, {ohi:+.2f}]"
            rows.append(f"| {c} | **{f} − grpc** [95 % CI] | | **{d['ttft_p50_ms']:+.2f} ms** [{lo:+.2f}, {hi:+.2f}] | | "
                        f"**{d['tokens_per_s_pct']:+.1f} %** | {over} |")
    rows += ["", "Stage p50s (ms; client and router on one monotonic clock):", "",
             "| concurrency | front | " + " | ".join(STAGES) + " |", "|---:|---|" + "---:|" * len(STAGES)]
    for c, per in results.items():
        for f in FRONTS:
            st = per[f]["stages_p50_ms"]
            rows.append(f"| {c} | {f} | " + " | ".join(f"{st[k]:.3f}" if k in st else "" for k in STAGES) + " |")
    return "\n".join(rows)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    width = 0.8 / len(FRONTS)
    panels = (("TTFT p50 (ms)", lambda r: r["ttft_p50_ms"]), ("output tokens/s", lambda r: r["tokens_per_s"]),
              ("front overhead p50 (ms)\n(TTFT less dispatch → first event)",
               lambda r: r["stages_p50_ms"].get("front overhead", float("nan"))))
    for ax, (label, value) in zip(axes, panels):
        for i, f in enumerate(FRONTS):
            xs = [j + (i - (len(FRONTS) - 1) / 2) * width for j in range(len(levels))]
            ax.bar(xs, [value(results[c][f]) for c in levels], width, label=f)
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
    p.add_argument("--warmup", type=int, default=8, help="warm-up requests per front")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 requests per front, concurrency 1 and 2")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.warmup = 8, [1, 2], 2
    http_port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        print("starting kvstore, worker (tiny, CPU) and router (gRPC + HTTP) ...", flush=True)
        trace_path = Path(logs) / "front_trace.jsonl"
        suite = start_suite(Path(logs), [["--model", "tiny", "--spec-mode", "eagle3", "--num-blocks", "2048"]],
                            ["--model", "tiny", "--http-port", str(http_port), "--num-draft-tokens", str(args.k),
                             "--front-trace", str(trace_path)])
        try:
            sent = asyncio.run(run_levels(suite.router, f"http://127.0.0.1:{http_port}", args))
        finally:
            suite.stop()
        trace = {line["key"]: line for line in read_trace(trace_path)}
    results = summarize(sent, trace)
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
