"""Benchmark of the kvstore: Match alone and the full request cycle, in-process and over gRPC.

Workload (issue 2): 64 distinct 1,024-token system prompts; every request is one of them (chosen
at random) followed by 1,024 fresh tokens, 2,048 tokens in all; block size 16; EAGLE-3 workers
(span D = 1, so 63 of a system prompt's 64 blocks are reusable: its last block's keys reach
into the fresh tail); one worker × 8,192 blocks, and four workers × 8,192 blocks::

    request i:  | system prompt s(i): 1,024 tokens | fresh: 1,024 tokens |
                '---- 63 reusable blocks ----'  '-- never seen before, published by the cycle --'

Phases, each on freshly registered workers warmed by one cycle per system prompt and then 256
ordinary cycles (so the LRU cache is full and in its steady state when timing starts):

* ``match``   Match alone (read-only);
* ``reserve`` (gRPC only) Reserve alone: waves of 48 reservations routed by an untimed Match,
              each wave aborted untimed (the pool holds ~60 live reservations);
* ``cycle``   Match → pick the worker with the longest reusable prefix → Reserve (headroom 8) →
              Publish (every prompt position final) → Release.

In-process calls the ``KVStore`` directly, one call at a time. Over gRPC the kvstore runs in a
separate process (``python -m services.cli kvstore --port 0``) and a ``grpc.aio`` client keeps 8
RPCs (or cycles) in flight with packed tokens on the wire; the transport baseline is a bare
``grpc.aio`` echo of an 8 KB payload (``bench/echo_server.py``, also a separate process) measured
in the same run with the same client. Every configuration runs 3 times; the median is reported.

    python bench/kvstore_bench.py                       # full run (a few minutes on 2 cores)
    python bench/kvstore_bench.py --quick               # smoke run
    python bench/kvstore_bench.py --json out.json --plot docs/img/kvstore_bench.png
    python bench/kvstore_bench.py --skip-inprocess --workers 1 --tls both   # mTLS overhead (issue 8)

``--tls on`` runs the gRPC phases with mutual TLS as deployed: a throwaway CA, the kvstore with its
certificate, Match/Reserve over a channel with a router certificate and each worker's
RegisterWorker/Publish/Release/Abort over a channel with that worker's certificate (the roles the
kvstore enforces). ``--tls both`` runs plaintext and mTLS back to back in every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import machine  # noqa: E402
from services.common.spec import SpecMode  # noqa: E402
from services.common.gc_tuning import tune_gc  # noqa: E402
from services.kvstore import types as core  # noqa: E402
from services.kvstore.store import KVStore  # noqa: E402

NUM_SYSTEM_PROMPTS = 64
SYSTEM_LEN = 1024
FRESH_LEN = 1024
BLOCK_SIZE = 16
NUM_BLOCKS = 8192
VOCAB = 128_256
HEADROOM = 8  # k = 7 draft tokens + 1 bonus
IN_FLIGHT = 8
RESERVE_WAVE = 48  # live reservations per Reserve wave: 48 × 65 fresh blocks fit beside the cache
ECHO_PAYLOAD = 8192
RPCS_PER_CYCLE = 4  # Match, Reserve, Publish, Release
WARMUP_RANDOM = 256


# ------------------------------------------------------------------------------------------------
# Workload


class Workload:
    """The system prompts and a deterministic stream of requests (packed little-endian uint32)."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.system = rng.integers(0, VOCAB, size=(NUM_SYSTEM_PROMPTS, SYSTEM_LEN), dtype=np.uint32)
        self._warmup: list[tuple[int, bytes]] | None = None

    def requests(self, phase: str, count: int) -> list[tuple[int, bytes]]:
        """``count`` requests ``(system prompt index, packed tokens)`` whose fresh tails are unique
        to (seed, phase): phases never hit each other's tails."""
        rng = np.random.default_rng([self.seed, sum(phase.encode()), len(phase)])
        which = rng.integers(0, NUM_SYSTEM_PROMPTS, size=count)
        fresh = rng.integers(0, VOCAB, size=(count, FRESH_LEN), dtype=np.uint32)
        full = np.concatenate([self.system[which], fresh], axis=1).astype("<u4")
        return [(int(w), full[i].tobytes()) for i, w in enumerate(which)]

    def warmup(self) -> list[tuple[int, bytes]]:
        """One request per system prompt in order (publishes each once), then ``WARMUP_RANDOM``
        ordinary requests so the LRU cache is in its steady state when timing starts (the pool
        fills after ~64 cycles; from then on every cycle evicts)."""
        if self._warmup is None:
            rng = np.random.default_rng([self.seed, 1])
            fresh = rng.integers(0, VOCAB, size=(NUM_SYSTEM_PROMPTS, FRESH_LEN), dtype=np.uint32)
            full = np.concatenate([self.system, fresh], axis=1).astype("<u4")
            self._warmup = [(i, full[i].tobytes()) for i in range(NUM_SYSTEM_PROMPTS)]
            self._warmup += self.requests("warmup", WARMUP_RANDOM)
        return self._warmup


def worker_specs(num_workers: int) -> list[core.WorkerSpec]:
    return [
        core.WorkerSpec(
            worker_id=f"w{k}",
            address=f"127.0.0.1:{9000 + k}",
            model_id="bench-model",
            spec_mode=SpecMode.EAGLE3,
            mtp_depth=1,
            block_size=BLOCK_SIZE,
            num_blocks=NUM_BLOCKS,
            vocab_size=VOCAB,
            max_seq_len=8192,
        )
        for k in range(num_workers)
    ]


def pick(matches, i: int):
    """Router-like choice: longest reusable prefix, then fewest live reservations, then rotate."""
    n = len(matches)
    return max(
        enumerate(matches),
        key=lambda e: (e[1].reusable_positions, -e[1].live_reservations, -((e[0] - i) % n)),
    )[1]


# ------------------------------------------------------------------------------------------------
# Results


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """Wall time, this process's CPU time and optionally a server process's CPU time spent inside
    ``with meter:`` blocks (accumulates over several blocks). CPU time per operation barely moves
    when other programs load the machine; throughput does."""

    def __init__(self, server_pid: int | None = None):
        self.server_pid = server_pid
        self.wall = self.cpu = 0.0
        self.server_cpu: float | None = 0.0 if server_pid else None

    def __enter__(self) -> Meter:
        self._start = (time.perf_counter(), time.process_time(),
                       process_cpu_s(self.server_pid) if self.server_pid else 0.0)
        return self

    def __exit__(self, *exc) -> None:
        wall, cpu, server = self._start
        self.wall += time.perf_counter() - wall
        self.cpu += time.process_time() - cpu
        if self.server_pid:
            self.server_cpu += process_cpu_s(self.server_pid) - server


@dataclass
class PhaseResult:
    """One phase of one run: throughput, latency percentiles (ms), hit rate, CPU per operation."""

    name: str
    ops: int
    seconds: float
    p50_ms: float
    p99_ms: float
    hit_rate: float | None = None
    rpc_latency_ms: dict = field(default_factory=dict)  # gRPC cycle: per RPC kind (p50, p99)
    cpu_us: float = 0.0  # this (client or in-process) process's CPU µs per operation
    server_cpu_us: float | None = None  # the server process's CPU µs per operation (gRPC)

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds


def _percentiles(lat_ns: list[int]) -> tuple[float, float]:
    a = np.asarray(lat_ns, dtype=np.float64) / 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def _phase(name, ops, meter: Meter, lat_ns, hit_rate=None, rpc_lat=None) -> PhaseResult:
    p50, p99 = _percentiles(lat_ns)
    per_rpc = {k: _percentiles(v) for k, v in (rpc_lat or {}).items()}
    server = None if meter.server_cpu is None else meter.server_cpu / ops * 1e6
    return PhaseResult(name, ops, meter.wall, p50, p99, hit_rate, per_rpc, meter.cpu / ops * 1e6, server)


# ------------------------------------------------------------------------------------------------
# In-process


def warmed_store(work: Workload, num_workers: int) -> KVStore:
    """A fresh store whose workers went through the warm-up cycles (see ``Workload.warmup``)."""
    store = KVStore(lease_ttl_s=3600.0)
    for spec in worker_specs(num_workers):
        store.register_worker(spec)
    for i, (_, toks) in enumerate(work.warmup()):
        _cycle_inprocess(store, toks, f"warm-{i}", i)
    tune_gc()  # as `tandem kvstore` does after start-up
    return store


def run_inprocess(work: Workload, num_workers: int, n_match: int, n_cycle: int) -> list[PhaseResult]:
    """Drive a ``KVStore`` directly, one call at a time: Match alone, then full cycles, each on a
    freshly warmed store."""
    total = SYSTEM_LEN + FRESH_LEN
    perf = time.perf_counter_ns

    store = warmed_store(work, num_workers)
    reqs = [t for _, t in work.requests("match", n_match)]  # packed bytes: the store's fast path
    lat, hits = [], 0
    with Meter() as meter:
        for toks in reqs:
            s = perf()
            m = store.match(toks)
            lat.append(perf() - s)
            hits += max(x.reusable_positions for x in m)
    match = _phase("match", len(reqs), meter, lat, hits / (len(reqs) * total))

    store = warmed_store(work, num_workers)
    reqs = [t for _, t in work.requests("cycle", n_cycle)]
    lat, hits = [], 0
    with Meter() as meter:
        for i, toks in enumerate(reqs):
            s = perf()
            hits += _cycle_inprocess(store, toks, f"c-{i}", i)
            lat.append(perf() - s)
    cycle = _phase("cycle", len(reqs), meter, lat, hits / (len(reqs) * total))

    problems = store.check_invariants()
    if problems:
        raise RuntimeError(f"invariants violated after the in-process run: {problems[:5]}")
    return [match, cycle]


def _cycle_inprocess(store: KVStore, tokens: bytes, request_id: str, i: int) -> int:
    w = pick(store.match(tokens), i)
    r = store.reserve(
        worker_id=w.worker_id,
        incarnation=w.incarnation,
        request_id=request_id,
        tokens=tokens,
        headroom_positions=HEADROOM,
    )
    store.publish(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=len(tokens) // 4)
    store.release(reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=0)
    return r.reused_positions


# ------------------------------------------------------------------------------------------------
# Separate server processes


class ServerProcess:
    """A server in a child process; its address comes from a line it writes (stdout or log file)."""

    def __init__(self, argv: list[str], pattern: str, *, address_format: str = "{}", timeout_s: float = 30.0):
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        deadline = time.monotonic() + timeout_s
        while True:
            text = Path(self._log.name).read_text()
            m = re.search(pattern, text)
            if m:
                self.address = address_format.format(m.group(1))
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {argv} did not start:\n{text}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        os.unlink(self._log.name)


def start_kvstore_process(certs: dict | None = None) -> ServerProcess:
    argv = [sys.executable, "-m", "services.cli", "--log-level", "INFO", "kvstore", "--port", "0",
            "--lease-ttl-s", "3600"]
    if certs is not None:
        kv = certs["kvstore"]
        argv += ["--tls-cert", kv.cert, "--tls-key", kv.key, "--tls-ca", kv.ca]
    return ServerProcess(argv, r"kvstore serving on (\S+)")


def make_certs(directory: str, num_workers: int) -> dict:
    """A throwaway CA: the kvstore's, a router's and one certificate per benchmark worker."""
    from services.common.certs import LocalCA

    ca = LocalCA(days=1)
    certs = {"kvstore": ca.write(directory, "kvstore", "kvstore"), "router": ca.write(directory, "router", "bench")}
    for spec in worker_specs(num_workers):
        certs[spec.worker_id] = ca.write(directory, "worker", spec.worker_id)
    return certs


def open_channels(address: str, certs: dict | None, num_workers: int):
    """(router channel, {worker id: channel}): one plaintext channel for all, or one mTLS
    channel per identity."""
    import grpc

    if certs is None:
        ch = grpc.aio.insecure_channel(address)
        return ch, {spec.worker_id: ch for spec in worker_specs(num_workers)}
    from services.common.auth import load_channel_credentials

    def secure(files):
        return grpc.aio.secure_channel(address, load_channel_credentials(files.ca, files.cert, files.key))

    return secure(certs["router"]), {spec.worker_id: secure(certs[spec.worker_id]) for spec in worker_specs(num_workers)}


def start_echo_process(certs: dict | None = None) -> ServerProcess:
    argv = [sys.executable, str(ROOT / "bench" / "echo_server.py"), "--port", "0"]
    if certs is not None:
        kv = certs["kvstore"]
        argv += ["--tls-cert", kv.cert, "--tls-key", kv.key, "--tls-ca", kv.ca]
    return ServerProcess(argv, r"PORT (\d+)", address_format="127.0.0.1:{}")


# ------------------------------------------------------------------------------------------------
# gRPC client


async def _closed_loop(jobs, fn, in_flight: int) -> list[int]:
    """Run ``await fn(job)`` for every job with ``in_flight`` workers; return the latencies (ns)."""
    it = iter(jobs)
    lat: list[int] = []
    perf = time.perf_counter_ns

    async def worker():
        for job in it:
            s = perf()
            await fn(job)
            lat.append(perf() - s)

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return lat


async def bench_echo(address: str, n: int, server_pid: int, certs: dict | None = None) -> PhaseResult:
    payload = os.urandom(ECHO_PAYLOAD)
    ch, _ = open_channels(address, certs, 0)
    async with ch:
        echo = ch.unary_unary("/tandem.bench.Echo/Echo", request_serializer=None, response_deserializer=None)

        async def one(_):
            await echo(payload, timeout=10)

        await _closed_loop(range(200), one, IN_FLIGHT)  # warm-up
        with Meter(server_pid) as meter:
            lat = await _closed_loop(range(n), one, IN_FLIGHT)
    return _phase("echo", n, meter, lat)


class GrpcKV:
    """The benchmark's kvstore client: one ``grpc.aio`` channel, packed tokens, per-RPC latencies."""

    def __init__(self, channel, num_workers: int, worker_channels: dict | None = None):
        from tandem.common.v1 import common_pb2
        from tandem.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

        self.pb, self.common = kvstore_pb2, common_pb2
        self.stub = kvstore_pb2_grpc.KVStoreStub(channel)  # as the router: Match, Reserve, Stats
        # as each worker: RegisterWorker, Publish, Release, Abort (the owner's calls)
        self.worker_stubs = {wid: kvstore_pb2_grpc.KVStoreStub(ch) for wid, ch in (worker_channels or {}).items()}
        self.num_workers = num_workers
        self.rpc_lat: dict[str, list[int]] = {"Match": [], "Reserve": [], "Publish": [], "Release": []}

    async def register(self) -> None:
        """(Re-)register every worker: a new incarnation starts from an empty pool (mutates)."""
        pb = self.pb
        for spec in worker_specs(self.num_workers):
            await self.worker(spec.worker_id).RegisterWorker(
                pb.RegisterWorkerRequest(
                    worker_id=spec.worker_id, address=spec.address, model_id=spec.model_id,
                    spec_mode=spec.spec_mode.value, block_size=spec.block_size, num_blocks=spec.num_blocks,
                    vocab_size=spec.vocab_size, max_seq_len=spec.max_seq_len,
                ),
                timeout=10,
            )

    def worker(self, worker_id: str):
        return self.worker_stubs.get(worker_id, self.stub)

    async def warm(self, work: Workload) -> None:
        await self.register()
        await _closed_loop([(i, f"warm-{i}", t) for i, (_, t) in enumerate(work.warmup())], self.cycle, 1)
        for v in self.rpc_lat.values():
            v.clear()

    async def _timed(self, kind, call, req):
        s = time.perf_counter_ns()
        resp = await call(req, timeout=10)
        self.rpc_lat[kind].append(time.perf_counter_ns() - s)
        return resp

    async def cycle(self, job) -> int:
        """Match → pick → Reserve → Publish → Release; returns the reused positions."""
        i, rid, toks = job
        pb, stub = self.pb, self.stub
        tok = self.common.TokenIds(packed=toks)
        m = await self._timed("Match", stub.Match, pb.MatchRequest(tokens=tok))
        w = pick(m.workers, i)
        r = (await self._timed("Reserve", stub.Reserve, pb.ReserveRequest(
            worker_id=w.worker_id, incarnation=w.incarnation, request_id=rid, tokens=tok,
            headroom_positions=HEADROOM))).reservation
        owner = self.worker(w.worker_id)
        await self._timed("Publish", owner.Publish, pb.PublishRequest(
            reservation_id=r.reservation_id, incarnation=r.incarnation, final_positions=len(toks) // 4))
        await self._timed("Release", owner.Release, pb.ReleaseRequest(
            reservation_id=r.reservation_id, incarnation=r.incarnation))
        return r.reused_positions

    async def check(self) -> None:
        """Fail loudly if the run broke an invariant or leaked a reservation."""
        check = await self.stub.CheckInvariants(self.pb.CheckInvariantsRequest(), timeout=30)
        if not check.ok:
            raise RuntimeError(f"invariants violated after the gRPC run: {list(check.violations)[:5]}")
        stats = await self.stub.Stats(self.pb.StatsRequest(), timeout=10)
        if stats.live_reservations:
            raise RuntimeError(f"{stats.live_reservations} reservations leaked")


async def bench_kvstore_grpc(work: Workload, address: str, server_pid: int, num_workers: int, n_match: int,
                             n_reserve: int, n_cycle: int, certs: dict | None = None,
                             phases: tuple[str, ...] = ("match", "reserve", "cycle")) -> list[PhaseResult]:
    """Match alone, Reserve alone and full cycles against a kvstore at ``address`` (mTLS with
    ``certs``)."""
    total = SYSTEM_LEN + FRESH_LEN
    ch, worker_channels = open_channels(address, certs, num_workers)
    try:
        return await _bench_kvstore_grpc(work, ch, worker_channels, server_pid, num_workers, n_match, n_reserve, n_cycle, total,
                                         phases)
    finally:
        for c in {id(c): c for c in [ch, *worker_channels.values()]}.values():
            await c.close()


async def _bench_kvstore_grpc(work, ch, worker_channels, server_pid, num_workers, n_match, n_reserve, n_cycle, total, phases):
    kv = GrpcKV(ch, num_workers, worker_channels)
    pb, common, stub = kv.pb, kv.common, kv.stub

    results: list[PhaseResult] = []
    if "match" in phases:  # Match alone.
        await kv.warm(work)
        hits = 0
        match_reqs = [pb.MatchRequest(tokens=common.TokenIds(packed=t)) for _, t in work.requests("match", n_match)]

        async def match(req):
            nonlocal hits
            resp = await stub.Match(req, timeout=10)
            hits += max(w.reusable_positions for w in resp.workers)

        with Meter(server_pid) as meter:
            lat = await _closed_loop(match_reqs, match, IN_FLIGHT)
        results.append(_phase("match", n_match, meter, lat, hits / (n_match * total)))

    if "reserve" in phases:  # Reserve alone: timed waves of RESERVE_WAVE reservations, each wave aborted untimed.
        await kv.warm(work)
        reqs = work.requests("reserve", n_reserve)
        hits, lat, meter = 0, [], Meter(server_pid)
        for start in range(0, n_reserve, RESERVE_WAVE):
            wave = []
            for j in range(start, min(start + RESERVE_WAVE, n_reserve)):
                tok = common.TokenIds(packed=reqs[j][1])
                # untimed: route like a router would, to the worker holding the prefix
                w = pick((await stub.Match(pb.MatchRequest(tokens=tok), timeout=10)).workers, j)
                wave.append(pb.ReserveRequest(worker_id=w.worker_id, incarnation=w.incarnation, request_id=f"rv-{j}",
                                              tokens=tok, headroom_positions=HEADROOM))
            live = []

            async def reserve(req):
                nonlocal hits
                r = (await stub.Reserve(req, timeout=10)).reservation
                hits += r.reused_positions
                live.append(r)

            with meter:
                lat += await _closed_loop(wave, reserve, IN_FLIGHT)
            # the owning worker's Abort (from anyone else it would only mark them ending)
            await asyncio.gather(*(kv.worker(r.worker_id).Abort(pb.AbortRequest(
                reservation_id=r.reservation_id, incarnation=r.incarnation, worker_id=r.worker_id), timeout=10)
                for r in live))
        results.append(_phase("reserve", n_reserve, meter, lat, hits / (n_reserve * total)))

    if "cycle" in phases:  # Full cycles, IN_FLIGHT at a time.
        await kv.warm(work)
        hits = 0
        jobs = [(i, f"c-{i}", t) for i, (_, t) in enumerate(work.requests("cycle", n_cycle))]

        async def counted_cycle(job):
            nonlocal hits
            reused = await kv.cycle(job)  # not `hits += await ...`: that reads hits before awaiting
            hits += reused

        with Meter(server_pid) as meter:
            lat = await _closed_loop(jobs, counted_cycle, IN_FLIGHT)
        results.append(_phase("cycle", n_cycle, meter, lat, hits / (n_cycle * total), kv.rpc_lat))
    await kv.check()
    return results


# ------------------------------------------------------------------------------------------------
# Driver


def _median_phase(runs: list[PhaseResult]) -> dict:
    """Median over runs of every number; ``runs_ops_per_s`` keeps each run's throughput."""
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = {
        "ops_per_s": med([r.ops_per_s for r in runs]),
        "runs_ops_per_s": [round(r.ops_per_s, 1) for r in runs],
        "p50_ms": med([r.p50_ms for r in runs]),
        "p99_ms": med([r.p99_ms for r in runs]),
        "ops": runs[0].ops,
        "cpu_us": med([r.cpu_us for r in runs]),
    }
    if runs[0].server_cpu_us is not None:
        out["server_cpu_us"] = med([r.server_cpu_us for r in runs])
    if runs[0].hit_rate is not None:
        out["hit_rate"] = med([r.hit_rate for r in runs])
    if runs[0].rpc_latency_ms:
        out["rpc_latency_ms"] = {
            k: [med([r.rpc_latency_ms[k][0] for r in runs]), med([r.rpc_latency_ms[k][1] for r in runs])]
            for k in runs[0].rpc_latency_ms
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="few operations, one run (smoke test)")
    parser.add_argument("--skip-grpc", action="store_true")
    parser.add_argument("--skip-inprocess", action="store_true")
    parser.add_argument("--workers", default="1,4", help="comma-separated worker counts")
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--plot", type=Path, help="write a PNG chart here")
    parser.add_argument("--quiet-load", type=float, default=0.0,
                        help="before each run wait (up to --quiet-wait-s) until the 1-min load average is below this")
    parser.add_argument("--quiet-wait-s", type=float, default=300.0)
    parser.add_argument("--phases", default="match,reserve,cycle", help="gRPC phases to run (comma-separated)")
    parser.add_argument("--tls", choices=("off", "on", "both"), default="off",
                        help="gRPC phases over mTLS (on), plaintext (off) or both, back to back")
    args = parser.parse_args(argv)

    scale = 0.05 if args.quick else 1.0
    runs = 1 if args.quick else args.runs
    n = lambda x: max(IN_FLIGHT * 4, int(x * scale))  # noqa: E731
    n_inp_match, n_inp_cycle = n(8192), n(4096)
    n_rpc_match, n_rpc_reserve, n_rpc_cycle, n_echo = n(6144), n(RESERVE_WAVE * 96), n(2048), n(6144)
    worker_counts = [int(x) for x in args.workers.split(",")]
    work = Workload(seed=0)
    raw: dict[str, list[PhaseResult]] = {}

    def record(prefix: str, results: list[PhaseResult]) -> None:
        for r in results:
            raw.setdefault(f"{prefix}/{r.name}", []).append(r)
            extra = f" hit {r.hit_rate:.1%}" if r.hit_rate is not None else ""
            extra += f" server CPU {r.server_cpu_us:.0f} us/op" if r.server_cpu_us is not None else ""
            print(f"  {prefix}/{r.name:8s} {r.ops_per_s:10.0f} ops/s  p50 {r.p50_ms:.3f} ms"
                  f"  p99 {r.p99_ms:.3f} ms  CPU {r.cpu_us:.0f} us/op{extra}", flush=True)

    loads = []
    for run in range(runs):
        waited = time.monotonic()
        while args.quiet_load and os.getloadavg()[0] > args.quiet_load and time.monotonic() - waited < args.quiet_wait_s:
            time.sleep(5)
        loads.append(os.getloadavg()[0])
        print(f"== run {run + 1}/{runs} (1-min load average {loads[-1]:.2f})", flush=True)
        if not args.skip_inprocess:
            for nw in worker_counts:
                print(f"-- in-process, {nw} worker(s)", flush=True)
                record(f"inproc/{nw}w", run_inprocess(work, nw, n_inp_match, n_inp_cycle))
        if not args.skip_grpc:
            modes = {"off": [False], "on": [True], "both": [False, True]}[args.tls]
            for mtls in modes:
                print(f"-- gRPC echo baseline (separate process){', mTLS' if mtls else ''}", flush=True)
                with tempfile.TemporaryDirectory() as certs_dir:
                    certs = make_certs(certs_dir, 0) if mtls else None
                    echo = start_echo_process(certs)
                    try:
                        record("grpc-mtls" if mtls else "grpc", [asyncio.run(bench_echo(echo.address, n_echo, echo.proc.pid, certs))])
                    finally:
                        echo.stop()
            for nw in worker_counts:
                for mtls in modes:
                    print(f"-- gRPC kvstore (separate process), {nw} worker(s){', mTLS' if mtls else ''}", flush=True)
                    with tempfile.TemporaryDirectory() as certs_dir:
                        certs = make_certs(certs_dir, nw) if mtls else None
                        server = start_kvstore_process(certs)
                        try:
                            record(f"grpc{'-mtls' if mtls else ''}/{nw}w", asyncio.run(bench_kvstore_grpc(
                                work, server.address, server.proc.pid, nw, n_rpc_match, n_rpc_reserve, n_rpc_cycle, certs,
                                tuple(args.phases.split(",")))))
                        finally:
                            server.stop()

    summary = {k: _median_phase(v) for k, v in raw.items()}
    echoes = {"grpc": summary.get("grpc/echo", {}), "grpc-mtls": summary.get("grpc-mtls/echo", {})}
    echo = echoes["grpc"]
    print(f"\n== median of {runs} run(s); a gRPC cycle is {RPCS_PER_CYCLE} RPCs: its 'x echo' compares RPC/s")
    print(f"{'config':18s} {'ops/s':>8s} {'x echo':>7s} {'p50 ms':>7s} {'p99 ms':>7s} {'hit':>6s}"
          f" {'CPU us/op':>9s} {'srv us/op':>9s} {'srv x echo':>10s}")
    for k, s in summary.items():
        rpcs = RPCS_PER_CYCLE if k.startswith("grpc") and k.endswith("/cycle") else 1
        echo = echoes.get(k.split("/", 1)[0], {})  # an mTLS phase against the mTLS echo
        if echo and k.startswith("grpc"):
            # throughput ratio, and the same ratio from server CPU per RPC (robust to machine load)
            s["x_echo"] = s["ops_per_s"] * rpcs / echo["ops_per_s"]
            s["x_echo_server_cpu"] = echo["server_cpu_us"] / (s["server_cpu_us"] / rpcs)
        ratio = f"{s['x_echo']:.2f}" if "x_echo" in s else "-"
        cpu_ratio = f"{s['x_echo_server_cpu']:.2f}" if "x_echo_server_cpu" in s else "-"
        hit = f"{s['hit_rate']:.1%}" if "hit_rate" in s else "-"
        srv = f"{s['server_cpu_us']:.0f}" if "server_cpu_us" in s else "-"
        print(f"{k:18s} {s['ops_per_s']:8.0f} {ratio:>7s} {s['p50_ms']:7.3f} {s['p99_ms']:7.3f} {hit:>6s}"
              f" {s['cpu_us']:9.0f} {srv:>9s} {cpu_ratio:>10s}")
    for k, s in summary.items():
        for rpc, (p50, p99) in s.get("rpc_latency_ms", {}).items():
            print(f"  {k} {rpc:8s} p50 {p50:.3f} ms  p99 {p99:.3f} ms")

    info = machine()
    info["load_avg_1min_at_run_start"] = loads
    info["load_avg_1min_at_end"] = os.getloadavg()[0]
    command = "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])])
    print(f"\nmachine: {info}\ncommand: {command}\n")
    print(markdown_table(summary))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "command": command, "runs": runs,
                                         "summary": summary,
                                         "raw": {k: [asdict(r) for r in v] for k, v in raw.items()}}, indent=1))
    if args.plot:
        plot(summary, args.plot, info)
    return 0


def markdown_table(summary: dict) -> str:
    """The summary as the Markdown table of docs/benchmarks.md."""
    lines = [
        "| config | ops/s (runs) | × echo | p50 ms | p99 ms | hit rate | client/in-process CPU µs/op"
        " | server CPU µs/op | × echo by server CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, s in summary.items():
        runs = ", ".join(f"{x:,.0f}" for x in s["runs_ops_per_s"])
        lines.append(
            f"| {k} | **{s['ops_per_s']:,.0f}** ({runs}) | {s['x_echo']:.2f} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | "
            if "x_echo" in s else
            f"| {k} | **{s['ops_per_s']:,.0f}** ({runs}) | – | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | "
        )
        lines[-1] += (f"{s['hit_rate']:.1%} | " if "hit_rate" in s else "– | ") + f"{s['cpu_us']:.0f} | "
        lines[-1] += (f"{s['server_cpu_us']:.0f} | " if "server_cpu_us" in s else "– | ")
        lines[-1] += (f"{s['x_echo_server_cpu']:.2f} |" if "x_echo_server_cpu" in s else "– |")
    return "\n".join(lines)


def plot(summary: dict, path: Path, info: dict) -> None:
    """Three panels: in-process throughput against the goals; gRPC RPCs/s against the echo (a
    cycle counts its 4 RPCs); server CPU per RPC against the echo's (the load-robust view)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.4))
    inp = {k.removeprefix("inproc/"): v["ops_per_s"] for k, v in summary.items() if k.startswith("inproc/")}
    if inp:
        a.bar(list(inp), list(inp.values()), color=["#4c72b0" if "match" in k else "#dd8452" for k in inp])
        a.axhline(25_000, ls="--", c="#4c72b0", lw=1, label="goal Match 25,000/s")
        a.axhline(5_000, ls="--", c="#dd8452", lw=1, label="goal cycle 5,000/s")
        a.set_title("in-process, one call at a time")
        a.set_ylabel("operations / s")
        a.legend(fontsize=8)
    else:
        a.set_axis_off()
        a.text(0.5, 0.5, "in-process phases not run", ha="center", va="center", transform=a.transAxes)
    rpc = {k.removeprefix("grpc/"): v for k, v in summary.items() if k.startswith("grpc")}
    if rpc:
        per = {k: RPCS_PER_CYCLE if k.endswith("cycle") else 1 for k in rpc}
        names = [f"{k} (×{per[k]})" if per[k] > 1 else k for k in rpc]
        colors = ["#999999" if k.endswith("echo") else "#8172b2" if k.startswith("grpc-mtls") else "#55a868" for k in rpc]
        b.bar(names, [v["ops_per_s"] * per[k] for k, v in rpc.items()], color=colors)
        c.bar(names, [v["server_cpu_us"] / per[k] for k, v in rpc.items()], color=colors)
        if "echo" in rpc:
            b.axhline(0.75 * rpc["echo"]["ops_per_s"], ls="--", c="k", lw=1, label="goal 0.75 × echo")
            c.axhline(rpc["echo"]["server_cpu_us"] / 0.75, ls="--", c="k", lw=1, label="echo / 0.75")
            b.legend(fontsize=8)
            c.legend(fontsize=8)
        b.set_title(f"gRPC, separate processes, {IN_FLIGHT} in flight")
        b.set_ylabel("RPCs / s (cycle: 4 RPCs each)")
        c.set_title("server CPU per RPC (lower is better)")
        c.set_ylabel("µs of server CPU / RPC")
    for ax in (a, b, c):
        ax.tick_params(axis="x", labelrotation=25, labelsize=8)
    fig.suptitle(f"kvstore benchmark — {info['cpu']}, {info['nproc']} cores, Python {info['python']}, "
                 f"{info['date'][:10]} (median of runs)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
