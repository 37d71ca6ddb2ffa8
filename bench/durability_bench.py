"""The kvstore's Redis backend under load and under fault injection.

    python bench/durability_bench.py [--kills 20] [--seconds 3] [--out docs/durability_bench.json]

1. cost: the request cycle (Reserve + Publish + Release of a 512-token prompt on a 256-block
   worker) in process, memory store vs journaled store on a real redis-server (appendfsync
   always), each verb awaited until durable, with 1 and 16 concurrent clients (group commit).
2. Match: gRPC Match throughput against an in-process kvstore on each backend, 16 concurrent
   clients, while one client runs request cycles (writes) in the same run.
3. failover: two `tandem kvstore --backend redis` processes (leader + standby) on one Redis,
   16 concurrent kvstore clients running request cycles (the worker's verb sequence, not real
   decoding), the leader SIGKILLed ``--kills`` times (the killed one restarts as the standby).
   Per kill: cycles that failed, the takeover time (kill -> first answer of the new leader), the
   time until throughput is back at 90 % of its pre-kill rate, and an audit: every Release the
   clients saw acknowledged is ended in the new leader (its reservation id is remembered there),
   every live reservation still extends, and CheckInvariants is clean.

Starts its own redis-server on a free port. Writes JSON and a PNG next to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402

from _common import free_port, machine  # noqa: E402
from services.common.channels import FAILOVER_OPTIONS, grpc_target  # noqa: E402
from services.common.spec import SpecMode  # noqa: E402
from services.common.wire import tokens_to_proto  # noqa: E402
from services.kvstore import KVStore, WorkerSpec  # noqa: E402
from tandem.kvstore.v1 import kvstore_pb2 as pb  # noqa: E402
from tandem.kvstore.v1 import kvstore_pb2_grpc  # noqa: E402
from tests.redis_server import RedisServer, unique_prefix  # noqa: E402

SPEC = WorkerSpec("w", "", "m", SpecMode.EAGLE3, 0, 16, 4096, 32000, 4096)
FLUSH_AT: int | None = None  # --flush-at: the cost runs' Committer(flush_at=...); None = its default
PROMPT_LEN = 512


def prompts(n: int, shared: int = 384):
    import numpy as np

    rng = np.random.default_rng(0)
    base = rng.integers(0, 32000, shared, dtype=np.uint32)
    return [np.concatenate([base, rng.integers(0, 32000, PROMPT_LEN - shared, dtype=np.uint32)]) for _ in range(n)]


# ------------------------------------------------------------------------------------------ cost
async def cycle_cost(store, durable, clients: int, cycles: int, toks, cpu: list | None = None) -> float:
    """Mean seconds per request cycle (wall time / cycles) with ``clients`` concurrent clients;
    with ``cpu``, also appends this process's CPU seconds per cycle (robust to a shared machine,
    where wall time includes waiting for a CPU; Redis's own CPU is not in it)."""
    inc = store.register_worker(SPEC).incarnation
    if durable:
        await durable()
    counter = iter(range(10**9))

    async def client(k: int):
        for i in range(cycles // clients):
            n = next(counter)
            r = store.reserve(worker_id="w", incarnation=inc, request_id=f"c{k}-{n}", tokens=toks[n % len(toks)],
                              headroom_positions=64)
            if durable:
                await durable()
            store.publish(reservation_id=r.reservation_id, incarnation=inc, final_positions=PROMPT_LEN - 1)
            if durable:
                await durable()
            store.release(reservation_id=r.reservation_id, incarnation=inc, final_positions=PROMPT_LEN - 1)
            if durable:
                await durable()
            await asyncio.sleep(0)

    start, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client(k) for k in range(clients)))
    n = cycles // clients * clients
    if cpu is not None:
        cpu.append((time.process_time() - cpu0) / n)
    return (time.perf_counter() - start) / n


async def redis_store(url: str):
    from services.kvstore.journal import JournaledStore
    from services.kvstore.redis_backend import Committer, RedisLog

    log = RedisLog(url, prefix=unique_prefix())
    log.try_acquire()
    holder = {}
    committer = Committer(log, lambda: holder["s"], **({} if FLUSH_AT is None else dict(flush_at=FLUSH_AT)))
    store = log.load(dict(lease_ttl_s=60.0, max_tokens=1 << 20, events_per_worker=0, epoch=1), committer.submit)
    holder["s"] = store
    store.waiter = committer.durable
    tasks = committer.start(store.seq)

    async def durable():
        pending = store.durable()
        if pending is not None:
            await pending

    async def close():
        for t in tasks:
            t.cancel()
        await committer.close()
        log.wipe()
        log.close()

    return store, durable, close, committer


def cpu_ns(pid: int) -> int:
    """CPU time (ns) process ``pid`` has run so far (Linux ``schedstat``; 0 elsewhere)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


async def bench_cost(url: str, cycles: int, reps: int, redis_pid: int = 0) -> dict:
    """Memory and Redis runs alternate (``reps`` of each, a fresh store every run), so a burst
    of load from another process on this shared machine hits both alike; the ratios are of the
    fastest runs (min) and of the medians."""
    toks = prompts(64)
    out = {}
    for clients in (1, 16):
        mwall: list[float] = []
        mcpu: list[float] = []
        rwall: list[float] = []
        rcpu: list[float] = []
        server_cpu: list[float] = []  # redis-server's own CPU per cycle (another process)
        for _ in range(reps):
            mwall.append(await cycle_cost(KVStore(lease_ttl_s=60.0, epoch=1), None, clients, cycles, toks, mcpu))
            store, durable, close, committer = await redis_store(url)
            before = cpu_ns(redis_pid)
            rwall.append(await cycle_cost(store, durable, clients, cycles, toks, rcpu))
            server_cpu.append((cpu_ns(redis_pid) - before) / 1e9 / (cycles // clients * clients))
            entries, batches = store.seq, committer.batches
            await close()
        med = statistics.median
        m, best, mc, rc = min(mwall), min(rwall), min(mcpu), min(rcpu)
        out[f"{clients}_clients"] = dict(memory_us=m * 1e6, redis_us=best * 1e6, ratio=best / m,
                                         memory_cpu_us=mc * 1e6, redis_cpu_us=rc * 1e6, ratio_cpu=rc / mc,
                                         ratio_median=med(rwall) / med(mwall), ratio_cpu_median=med(rcpu) / med(mcpu),
                                         memory_cpu_us_runs=[round(x * 1e6, 1) for x in mcpu],
                                         redis_cpu_us_runs=[round(x * 1e6, 1) for x in rcpu],
                                         memory_us_runs=[round(x * 1e6, 1) for x in mwall],
                                         redis_us_runs=[round(x * 1e6, 1) for x in rwall],
                                         redis_server_cpu_us=min(server_cpu) * 1e6,
                                         entries_per_batch=entries / max(batches, 1))
        print(f"cost, {clients} clients: memory {m*1e6:.0f} us/cycle, redis {best*1e6:.0f} us/cycle, "
              f"ratio {best/m:.2f} (medians {med(rwall)/med(mwall):.2f}; {entries / max(batches, 1):.1f} entries per "
              f"Redis call); CPU of this process: memory {mc*1e6:.0f} us, redis {rc*1e6:.0f} us, ratio {rc/mc:.2f} "
              f"(medians {med(rcpu)/med(mcpu):.2f}); redis-server {min(server_cpu)*1e6:.0f} us", flush=True)
    # snapshot cost on a filled store
    store, durable, close, _ = await redis_store(url)
    await cycle_cost(store, durable, 16, 2000, toks)
    t = time.perf_counter()
    blob = store.snapshot()
    out["snapshot"] = dict(seconds=time.perf_counter() - t, bytes=len(blob), entries=store.seq,
                           trie_blocks=store.stats().trie_nodes)
    await close()
    return out


# ------------------------------------------------------------------------------------------ snapshots
async def bench_snapshot(url: str, blocks_per_worker: int = 16_384) -> dict:
    """How long a snapshot holds the leader's event loop on a store whose trie holds ~2 x
    ``blocks_per_worker`` blocks: the in-process pickle (what the leader did before) against the
    largest loop stall while the snapshot process (``services/kvstore/snapshotter``) runs."""
    import numpy as np

    store, durable, close, committer = await redis_store(url)
    rng = np.random.default_rng(1)
    for wid in ("a", "b"):
        spec = WorkerSpec(wid, "", "m", SpecMode.EAGLE3, 0, 16, blocks_per_worker, 32000, 4096)
        inc = store.register_worker(spec).incarnation
        for n in range(blocks_per_worker // 32 - 1):  # 512-token prompts: 31 published blocks each
            toks = rng.integers(0, 32000, PROMPT_LEN, dtype=np.uint32)
            r = store.reserve(worker_id=wid, incarnation=inc, request_id=f"{wid}{n}", tokens=toks)
            store.release(reservation_id=r.reservation_id, incarnation=inc, final_positions=PROMPT_LEN - 1)
            if n % 16 == 0:
                await durable()  # lets the lease keeper run too
    await durable()
    t = time.perf_counter()
    blob = store.snapshot()
    inline_s = time.perf_counter() - t
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker():
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.3)
    idle_max = max(lags)
    lags.clear()
    t = time.perf_counter()
    await committer._snapshot_now()
    await committer._snapshotting
    process_s = time.perf_counter() - t
    stop.set()
    await tick
    out = dict(trie_blocks=store.stats().trie_nodes, bytes=len(blob), inline_pickle_ms=inline_s * 1e3,
               process_wall_s=process_s, loop_max_stall_ms_during=max(lags) * 1e3,
               loop_max_stall_ms_idle=idle_max * 1e3, snapshots_written=committer.snapshots)
    print(f"snapshot of {out['trie_blocks']} trie blocks: inline pickle {out['inline_pickle_ms']:.0f} ms; "
          f"snapshot process {process_s:.2f} s, loop stall max {out['loop_max_stall_ms_during']:.1f} ms "
          f"(idle {out['loop_max_stall_ms_idle']:.1f} ms)", flush=True)
    await close()
    return out


# ------------------------------------------------------------------------------------------ Match
async def bench_match(url: str, seconds: float) -> dict:
    from services.kvstore.server import start_kvstore
    from services.kvstore.settings import KVStoreSettings

    toks = prompts(64)
    out = {}
    for backend in ("memory", "redis"):
        settings = KVStoreSettings(host="127.0.0.1", port=0, grace_s=0, backend=backend, redis_url=url,
                                   redis_prefix=unique_prefix())
        lead = None
        if backend == "redis":
            from services.kvstore.leader import Leadership

            async def serve(s, st):
                return (await start_kvstore(s, store=st))[0]

            lead = Leadership(settings, start_server=serve)
            task = asyncio.get_running_loop().create_task(lead.run())
            await lead.leading.wait()
            server = lead.server
        else:
            server, _ = await start_kvstore(settings)
        channel = grpc.aio.insecure_channel(server.address)
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        w = (await stub.RegisterWorker(pb.RegisterWorkerRequest(
            worker_id="w", address="x", model_id="m", spec_mode=2, block_size=16, num_blocks=4096,
            vocab_size=32000, max_seq_len=4096))).worker
        reqs = [pb.MatchRequest(tokens=tokens_to_proto(t)) for t in toks]
        done = asyncio.Event()
        counts = {"match": 0, "cycles": 0}

        async def writer():
            n = 0
            while not done.is_set():
                n += 1
                r = (await stub.Reserve(pb.ReserveRequest(worker_id="w", incarnation=w.incarnation, request_id=f"x{n}",
                                                          tokens=reqs[n % 64].tokens, headroom_positions=64))).reservation
                await stub.Release(pb.ReleaseRequest(reservation_id=r.reservation_id, incarnation=w.incarnation,
                                                     final_positions=PROMPT_LEN - 1))
                counts["cycles"] += 1

        async def matcher(k):
            i = k
            while not done.is_set():
                await stub.Match(reqs[i % 64])
                counts["match"] += 1
                i += 1

        tasks = [asyncio.ensure_future(writer())] + [asyncio.ensure_future(matcher(k)) for k in range(16)]
        await asyncio.sleep(0.5)
        counts["match"] = counts["cycles"] = 0
        await asyncio.sleep(seconds)
        done.set()
        m, c = counts["match"], counts["cycles"]
        await asyncio.gather(*tasks, return_exceptions=True)
        await channel.close()
        if lead:
            lead.stop.set()
            await task
        else:
            await server.stop(0)
        out[backend] = dict(match_per_s=m / seconds, cycles_per_s=c / seconds)
        print(f"Match, {backend}: {m/seconds:.0f}/s with {c/seconds:.0f} write cycles/s beside", flush=True)
    out["ratio"] = out["redis"]["match_per_s"] / out["memory"]["match_per_s"]
    return out


# ------------------------------------------------------------------------------------------ failover
def kvstore_proc(url: str, prefix: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "kvstore", "--backend", "redis", "--redis-url", url, "--redis-prefix",
         prefix, "--redis-lease-ms", "1000", "--port", str(port), "--lease-ttl-s", "30"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def bench_failover(url: str, kills: int, streams: int = 16) -> dict:
    prefix, ports = unique_prefix(), [free_port(), free_port()]
    procs = [kvstore_proc(url, prefix, p) for p in ports]
    channel = grpc.aio.insecure_channel(grpc_target(",".join(f"127.0.0.1:{p}" for p in ports)), options=FAILOVER_OPTIONS)
    stub = kvstore_pb2_grpc.KVStoreStub(channel)
    toks = [tokens_to_proto(t) for t in prompts(64)]

    async def retry(fn, deadline_s=10.0):
        """What the worker's courier does: resend through UNAVAILABLE until a deadline."""
        end = time.monotonic() + deadline_s
        delay = 0.02
        while True:
            try:
                return await fn()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or time.monotonic() > end:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.2)

    w = (await retry(lambda: stub.RegisterWorker(pb.RegisterWorkerRequest(
        worker_id="w", address="x", model_id="m", spec_mode=2, block_size=16, num_blocks=4096, vocab_size=32000,
        max_seq_len=4096), timeout=1), 30)).worker
    inc = w.incarnation
    done = asyncio.Event()
    stamps: list[float] = []
    failed = [0]
    released: list[str] = []  # acknowledged Releases
    live: dict[int, str] = {}

    async def stream(k):
        n = 0
        while not done.is_set():
            n += 1
            try:
                # Reserve is idempotent per request id, Release only resent when undelivered: here
                # a resend after an ambiguous cut may find it ended (FAILED_PRECONDITION) = done.
                r = (await retry(lambda: stub.Reserve(pb.ReserveRequest(
                    worker_id="w", incarnation=inc, request_id=f"s{k}-{n}", tokens=toks[(k * 7 + n) % 64],
                    headroom_positions=64), timeout=1))).reservation
                live[k] = r.reservation_id
                await asyncio.sleep(0.005)  # "decoding"
                try:
                    await retry(lambda: stub.Release(pb.ReleaseRequest(
                        reservation_id=r.reservation_id, incarnation=inc, final_positions=PROMPT_LEN - 1), timeout=1))
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                live.pop(k, None)
                released.append(r.reservation_id)
                stamps.append(time.monotonic())
            except grpc.aio.AioRpcError as exc:
                failed[0] += 1
                print("stream failed:", exc.code(), exc.details(), flush=True)

    tasks = [asyncio.ensure_future(stream(k)) for k in range(streams)]
    await asyncio.sleep(3)
    results = []
    for kill in range(kills):
        t0 = time.monotonic()
        before = sum(1 for s in stamps if t0 - 2 <= s < t0) / 2  # cycles/s over the last 2 s
        leader = next(i for i, p in enumerate(ports) if listening(p))
        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait()
        killed = time.monotonic()
        fails_before = failed[0]
        acked = list(released)
        await retry(lambda: stub.Stats(pb.StatsRequest(), timeout=0.5), 20)
        takeover = time.monotonic() - killed
        procs[leader] = kvstore_proc(url, prefix, ports[leader])  # the next standby
        # Throughput back: first 0.5 s window after the kill at >= 90 % of the pre-kill rate.
        back = None
        while back is None and time.monotonic() - killed < 15:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for start in [killed + 0.25 * i for i in range(int((now - 0.5 - killed) / 0.25) + 1)]:
                rate = sum(1 for s in stamps if start <= s < start + 0.5) / 0.5
                if rate >= 0.9 * before:
                    back = start + 0.5 - killed
                    break
        # Audit: every acknowledged Release is ended in the new leader; live ones extend.
        lost = 0
        for rid in acked[-200:]:
            try:
                ok = (await stub.Abort(pb.AbortRequest(reservation_id=rid, incarnation=inc), timeout=2)).aborted
                lost += ok  # True = it was still live: the Release was lost
            except grpc.aio.AioRpcError as exc:
                lost += exc.code() == grpc.StatusCode.NOT_FOUND
        inv = await stub.CheckInvariants(pb.CheckInvariantsRequest(), timeout=2)
        results.append(dict(kill=kill, takeover_s=takeover, throughput_back_s=back, pre_kill_cycles_per_s=before,
                            failed_streams=failed[0] - fails_before, acked_releases_lost=lost, audited=min(200, len(acked)),
                            invariants_ok=inv.ok))
        print(f"kill {kill}: takeover {takeover:.2f} s, throughput back {back} s, failed {failed[0]-fails_before}, "
              f"lost {lost}/{min(200, len(acked))}, invariants {inv.ok}", flush=True)
        t = time.monotonic()
        while not listening(ports[leader]) and time.monotonic() - t < 0.1:
            break
        await asyncio.sleep(2.5)  # let the restarted process become a standby
    done.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await channel.close()
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(10)
    return dict(streams=streams, kills=results)


async def main_async(args) -> dict:
    server = RedisServer(appendfsync="always")
    try:
        out = dict(machine=machine(), command=" ".join(sys.argv), flush_at=FLUSH_AT, gc=args.gc,
                   redis="redis-server (real), appendonly yes, appendfsync always, loopback")
        out["load_average_start"] = os.getloadavg()
        out["cost"] = await bench_cost(server.url, args.cycles, args.reps, server.proc.pid)
        relaxed = RedisServer(appendfsync="everysec")
        try:
            print("-- appendfsync everysec:", flush=True)
            out["cost_everysec"] = await bench_cost(relaxed.url, args.cycles, args.reps, relaxed.proc.pid)
        finally:
            relaxed.stop()
        out["load_average_after_cost"] = os.getloadavg()
        if args.only_cost:
            return out
        out["snapshot"] = await bench_snapshot(server.url)
        out["match"] = await bench_match(server.url, args.seconds)
        if args.kills:
            out["failover"] = await bench_failover(server.url, args.kills)
        return out
    finally:
        server.stop()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if "failover" in result else 2, figsize=(13, 3.8))
    # the goal's measure: appendfsync everysec, CPU of the kvstore process per cycle
    c = result.get("cost_everysec", result["cost"])
    names = ["1_clients", "16_clients"]
    x = range(len(names))
    axes[0].bar([i - 0.2 for i in x], [c[n]["memory_cpu_us"] for n in names], 0.4, label="memory")
    axes[0].bar([i + 0.2 for i in x], [c[n]["redis_cpu_us"] for n in names], 0.4, label="redis (durable)")
    for i, n in enumerate(names):  # the goal reads the wall ratio; the CPU one moves less with the load
        axes[0].annotate(f"CPU {c[n]['ratio_cpu']:.2f}×\nwall {c[n]['ratio']:.2f}×", (i + 0.2, c[n]["redis_cpu_us"]),
                         ha="center", va="bottom")
    axes[0].set_ylim(0, 1.25 * max(c[n]["redis_cpu_us"] for n in names))  # room for the labels
    axes[0].set_xticks(list(x), ["1 client", "16 clients"])
    axes[0].set_ylabel("kvstore CPU µs per request cycle")
    axes[0].set_title("in-process cycle cost (appendfsync everysec)")
    axes[0].legend()
    if "match" not in result:
        axes[1].set_visible(False)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    m = result["match"]
    axes[1].bar(["memory", "redis"], [m["memory"]["match_per_s"], m["redis"]["match_per_s"]])
    axes[1].set_ylabel("gRPC Match / s (16 clients + writer)")
    axes[1].set_title(f"Match throughput (ratio {m['ratio']:.2f})")
    if "failover" in result:
        kills = result["failover"]["kills"]
        axes[2].plot([k["kill"] for k in kills], [k["takeover_s"] for k in kills], "o-", label="takeover")
        axes[2].plot([k["kill"] for k in kills], [k["throughput_back_s"] or 15 for k in kills], "s-", label="90 % throughput back")
        axes[2].axhline(3, color="grey", ls="--", lw=0.8)
        axes[2].set_xlabel("SIGKILL #")
        axes[2].set_ylabel("seconds after the kill")
        axes[2].set_title("leader SIGKILL, standby on")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--cycles", type=int, default=3200)
    ap.add_argument("--reps", type=int, default=5, help="memory/redis runs of the cost measure (alternating)")
    ap.add_argument("--only-cost", action="store_true", help="the cost measure alone (no snapshot, Match, failover)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "durability_bench.json"))
    ap.add_argument("--gc", choices=("service", "default"), default="service",
                    help="the collector as `tandem kvstore` runs it (start-up heap frozen: services/common/gc_tuning.py) "
                         "or as CPython starts it")
    ap.add_argument("--flush-at", type=int, default=None,
                    help="the cost runs' group commit sends a batch once it holds this many entries while nothing is "
                         "in flight (0: once per loop turn; default: the Committer's)")
    args = ap.parse_args()
    global FLUSH_AT
    FLUSH_AT = args.flush_at
    if args.gc == "service":
        from services.common.gc_tuning import tune_gc

        tune_gc()  # what `tandem kvstore` does once it serves (either backend)
    result = asyncio.run(main_async(args))
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
