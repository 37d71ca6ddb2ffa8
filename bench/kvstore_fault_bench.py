"""Fault injection on the served path: SIGKILL of the kvstore under streaming load.

    python bench/kvstore_fault_bench.py --mode redis  --kills 20   # leader + standby on Redis
    python bench/kvstore_fault_bench.py --mode memory --kills 5    # memory kvstore, restarted in place

The suite runs as processes: kvstore(s), 2 workers (tiny model, CPU, EAGLE-3, one torch thread
each), a router; 16 closed-loop client streams through the router's Generate, prompts sharing a
long prefix (so the cache hit rate means something). Every ``--period-s`` the kvstore leader is
SIGKILLed:

* redis: the standby takes over (workers and router were given both addresses); the killed one
  is restarted as the next standby once the recovery was measured, and the next kill comes
  ``--standby-start-s`` after it reached Redis.
* memory: the same process is restarted on the same port (what a supervisor does); workers
  re-register by themselves.

Per kill: streams that failed (any error the client saw) in the window after it, the takeover
time (kill -> the kvstore answers again), the time until streamed-token throughput (1 s windows) is back at
90 % of its rate in the 3 s before the kill, the hit rate (cached / prompt tokens of requests that finished) before
and after, and an audit of the new kvstore: CheckInvariants clean, and per worker incarnation the
acknowledged counters (published blocks, requested positions) no lower than read before the kill
(a lost acknowledged Publish/Release would lower them). Writes JSON + PNG next to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402

from _common import Suite, free_port, machine  # noqa: E402
from services.launcher import wait_serving  # noqa: E402
from tandem.kvstore.v1 import kvstore_pb2 as kv_pb  # noqa: E402
from tandem.kvstore.v1 import kvstore_pb2_grpc  # noqa: E402
from tandem.router.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from tests.redis_server import RedisServer, unique_prefix  # noqa: E402

PREFIX = "In a quiet valley between two rivers there was a village that kept a library of old maps. " * 3


def listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Deployment:
    def __init__(self, mode: str, log_dir: Path, redis_url: str = ""):
        self.mode, self.log_dir, self.redis_url = mode, log_dir, redis_url
        self.suite = Suite()
        self.kv_ports = [free_port(), free_port()] if mode == "redis" else [free_port()]
        self.prefix = unique_prefix()
        self.kv_procs: dict[int, object] = {}
        self.addresses = ",".join(f"127.0.0.1:{p}" for p in self.kv_ports)
        self.restarts = 0

    def spawn_kvstore(self, port: int) -> None:
        argv = ["kvstore", "--port", str(port), "--lease-ttl-s", "10"]
        if self.mode == "redis":
            argv += ["--backend", "redis", "--redis-url", self.redis_url, "--redis-prefix", self.prefix,
                     "--redis-lease-ms", "1000"]
        self.restarts += 1
        self.suite.spawn(f"kvstore-{port}-{self.restarts}", argv, self.log_dir)
        self.kv_procs[port] = self.suite.procs[-1][1]

    def start(self, num_blocks: int) -> None:
        for p in self.kv_ports:
            self.spawn_kvstore(p)
        deadline = time.monotonic() + 120
        while not any(listening(p) for p in self.kv_ports):
            assert time.monotonic() < deadline, "no kvstore came up"
            time.sleep(0.1)
        one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        for i in range(2):
            port = free_port()
            self.suite.workers.append(f"127.0.0.1:{port}")
            self.suite.spawn(f"worker{i}", ["worker", "--port", str(port), "--kvstore", self.addresses, "--worker-id",
                                            f"worker{i}", "--model", "tiny", "--spec-mode", "eagle3", "--num-blocks",
                                            str(num_blocks), "--heartbeat-s", "0.5"], self.log_dir, one_thread)
        r_port = free_port()
        self.suite.router = f"127.0.0.1:{r_port}"
        self.suite.spawn("router", ["router", "--port", str(r_port), "--kvstore", self.addresses, "--model", "tiny",
                                    "--registry-ttl-s", "0.5"], self.log_dir)
        for addr, (_, proc) in zip([*self.suite.workers, self.suite.router], self.suite.procs[len(self.kv_ports):]):
            wait_serving(addr, deadline, proc)

    def wait_standby(self, port: int, timeout_s: float = 120.0) -> None:
        """Until the kvstore just spawned on ``port`` talks to Redis (it names its connection
        after its node id, which holds its pid): a standby still importing on this loaded 2-core
        VM is no standby, and a kill then waited out the whole lease."""
        import redis as redis_py

        from services.kvstore.redis_backend import NODE_NAME_PREFIX

        pid = self.kv_procs[port].pid
        client = redis_py.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while not any(c.get("name", "").startswith(NODE_NAME_PREFIX) and f"-{pid}-" in c.get("name", "")
                          for c in client.client_list()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the kvstore restarted on port {port} never reached Redis")
                time.sleep(0.1)
        finally:
            client.close()

    def leader_port(self) -> int:
        return next(p for p in self.kv_ports if listening(p))

    def kill_leader(self) -> int:
        port = self.leader_port()
        proc = self.kv_procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return port

    def stop(self) -> None:
        self.suite.stop()


async def audit(stub, before) -> dict:
    """Invariants and acknowledged counters after a restart (see the module docstring)."""
    stats = await stub.Stats(kv_pb.StatsRequest(), timeout=5)
    inv = await stub.CheckInvariants(kv_pb.CheckInvariantsRequest(), timeout=5)
    lower = []
    now = {w.worker_id: w for w in stats.workers}
    for w in before.workers:
        a = now.get(w.worker_id)
        if a is None:
            continue
        if a.published_blocks < w.published_blocks or a.requested_positions < w.requested_positions:
            lower.append(w.worker_id)
    return dict(invariants_ok=inv.ok, counters_lower=lower, workers_after=len(stats.workers))


async def run(args) -> dict:
    redis = RedisServer(appendfsync=args.appendfsync) if args.mode == "redis" else None
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    dep = Deployment(args.mode, log_dir, redis.url if redis else "")
    try:
        dep.start(args.num_blocks)
        if args.mode == "redis":
            for port in dep.kv_ports:
                dep.wait_standby(port)
        from services.common.channels import FAILOVER_OPTIONS, grpc_target

        router = router_pb2_grpc.RouterStub(grpc.aio.insecure_channel(dep.suite.router))
        kv_channel = grpc.aio.insecure_channel(grpc_target(dep.addresses), options=FAILOVER_OPTIONS)
        kv = kvstore_pb2_grpc.KVStoreStub(kv_channel)
        done: list[tuple[float, int, int, int]] = []  # (end time, completion tokens, prompt, cached)
        streamed: list[tuple[float, int]] = []  # (arrival time, tokens) of every streamed message
        failures: list[tuple[float, str]] = []
        stop = asyncio.Event()
        rng = random.Random(0)

        async def stream(k: int):
            n = 0
            while not stop.is_set():
                n += 1
                text = PREFIX + f"Question {rng.randrange(40)} from reader {k}: where does the road go?"
                req = router_pb2.GenerateRequest(text=text, max_new_tokens=args.max_new_tokens, request_id=f"s{k}-{n}",
                                                  temperature=0.0)
                try:
                    usage = None
                    async for msg in router.Generate(req, timeout=60):
                        if msg.token_ids:
                            streamed.append((time.monotonic(), len(msg.token_ids)))
                        if msg.HasField("usage"):
                            usage = msg.usage
                    if usage is None:
                        raise RuntimeError("no usage")
                    done.append((time.monotonic(), usage.completion_tokens, usage.prompt_tokens, usage.cached_tokens))
                except (grpc.aio.AioRpcError, RuntimeError) as exc:
                    why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                    failures.append((time.monotonic(), why))
                    print(f"  stream {k} failed: {why}", flush=True)

        def rate(t0: float, t1: float) -> float:
            """Tokens/s streamed to the clients in [t0, t1) (as they arrive, not when requests end:
            completions of 24-token requests come in bursts that made 1 s windows read 0)."""
            return sum(n for t, n in streamed if t0 <= t < t1) / max(t1 - t0, 1e-9)

        def hit_rate(t0: float, t1: float) -> float | None:
            rows = [(p, c) for t, _, p, c in done if t0 <= t < t1]
            return sum(c for _, c in rows) / sum(p for p, _ in rows) if rows else None

        tasks = [asyncio.ensure_future(stream(k)) for k in range(args.streams)]
        await asyncio.sleep(args.warmup_s)
        kills = []
        for i in range(args.kills):
            before = await kv.Stats(kv_pb.StatsRequest(), timeout=5)
            t_kill = time.monotonic()
            pre_rate = rate(t_kill - args.baseline_s, t_kill)
            pre_hit = hit_rate(t_kill - args.window_s, t_kill)
            nfail = len(failures)
            port = dep.kill_leader()
            if args.mode == "memory":
                dep.spawn_kvstore(port)  # the supervisor brings it back on the same port
            while True:
                try:
                    await kv.Stats(kv_pb.StatsRequest(), timeout=0.5)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
                    if time.monotonic() - t_kill > 30:
                        raise RuntimeError("the kvstore never came back")
            takeover = time.monotonic() - t_kill
            result = await audit(kv, before) if args.mode == "redis" else {}
            await asyncio.sleep(args.period_s)
            back = None
            step = 0.25
            t = t_kill
            while t + args.window_s <= time.monotonic():
                if rate(t, t + args.window_s) >= 0.9 * pre_rate:
                    back = t + args.window_s - t_kill
                    break
                t += step
            hits_back = None
            t = t_kill
            while pre_hit and t + args.window_s <= time.monotonic():
                h = hit_rate(t, t + args.window_s)
                if h is not None and h >= 0.9 * pre_hit:
                    hits_back = t + args.window_s - t_kill
                    break
                t += step
            # the streamed rate in windows starting every 0.25 s from the kill (where a slow
            # recovery's time went)
            series = [round(rate(t_kill + j * step, t_kill + j * step + args.window_s), 1)
                      for j in range(int((time.monotonic() - t_kill - args.window_s) / step) + 1)]
            row = dict(kill=i, takeover_s=round(takeover, 3), failed_streams=len(failures) - nfail,
                       pre_kill_tokens_per_s=round(pre_rate, 1), throughput_back_s=back, tokens_per_s_after=series,
                       pre_kill_hit_rate=pre_hit, hit_rate_back_s=hits_back, **result)
            kills.append(row)
            print(f"kill {i}: {row}", flush=True)
            if args.mode == "redis":
                # The next standby starts only now: on this 2-core machine its interpreter start-up
                # would otherwise eat the CPU the recovery is measured on (elsewhere it runs on
                # another machine).
                dep.spawn_kvstore(port)
                await asyncio.to_thread(dep.wait_standby, port)
                await asyncio.sleep(args.standby_start_s)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await kv_channel.close()
        return dict(mode=args.mode, machine=machine(), command=" ".join(sys.argv), streams=args.streams, workers=2,
                    appendfsync=args.appendfsync if redis else None, kills=kills,
                    total_failed_streams=len(failures), finished_streams=len(done),
                    failure_examples=[w for _, w in failures[:5]])
    finally:
        dep.stop()
        if redis:
            redis.stop()


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for r in results:
        ks = [k["kill"] for k in r["kills"]]
        axes[0].plot(ks, [k["takeover_s"] for k in r["kills"]], "o-", label=f"{r['mode']}: kvstore answers again")
        axes[0].plot(ks, [k["throughput_back_s"] if k["throughput_back_s"] is not None else float("nan")
                          for k in r["kills"]], "s--", label=f"{r['mode']}: 90 % tokens/s back")
        axes[1].bar([f"{r['mode']}\nfailed"], [r["total_failed_streams"]])
        axes[1].bar([f"{r['mode']}\nfinished"], [r["finished_streams"]])
    axes[0].axhline(3, color="grey", lw=0.8, ls=":")
    axes[0].set_xlabel("SIGKILL #")
    axes[0].set_ylabel("seconds after the kill")
    axes[0].legend(fontsize=7)
    axes[1].set_ylabel("client streams")
    axes[1].set_title("streams over the whole run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["redis", "memory"], default="redis")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--period-s", type=float, default=5.0, help="seconds after a takeover before the next kill")
    ap.add_argument("--standby-start-s", type=float, default=2.0,
                    help="time given a restarted standby once it reached Redis (to build its warm copy)")
    ap.add_argument("--window-s", type=float, default=1.0, help="window of the throughput / hit-rate rates")
    ap.add_argument("--baseline-s", type=float, default=3.0, help="window of the pre-kill throughput baseline")
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--appendfsync", default="everysec", choices=["always", "everysec"])
    ap.add_argument("--log-dir", default="/tmp/tandem-fault-bench")
    ap.add_argument("--out", default=str(ROOT / "docs" / "kvstore_fault_bench.json"))
    args = ap.parse_args()
    result = asyncio.run(run(args))
    out = Path(args.out)
    existing = json.loads(out.read_text()) if out.exists() else {}
    existing[args.mode] = result
    out.write_text(json.dumps(existing, indent=1))
    plot(list(existing.values()), out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
