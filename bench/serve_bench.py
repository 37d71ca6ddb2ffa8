"""Served-path benchmark (issue 7): Tandem served as processes vs its engine alone, same model, same batches.

A random Llama of ``--shape`` is built with transformers (seeded) and saved as a Hugging Face folder
(with a word-level ``tokenizer.json`` and no end-of-sequence id, so every request runs its full
``--max-new-tokens``); the worker gets a seeded random EAGLE-3 draft (``--draft-model random``, or
with ``--draft-vocab N`` a random head of N LM-head rows in the public layout). Then, in one run::

    served         closed-loop clients ──Router.Generate──▶ router ─▶ kvstore
                   (grpc.aio, token ids)                      └─────▶ worker (tandem worker ...)
    engine alone   the same Engine built in-process from the same WorkerSettings
                   (services/gpuworker/build.py) over a LocalBlockSource: no gRPC, no processes

Workload: prompts of ``--prompt-len`` token ids whose first half is one prefix shared by every
request (the kvstore serves it from cache after the first request; the engine-alone run shares
the same blocks) and whose second half is random per request; greedy, ``--max-new-tokens`` each.
Levels: concurrency N in ``--concurrency`` (N clients, each sending its next request when its
last one finished; max(rounds·N, min-requests) requests, no new ones after ``--level-max-s``),
for k = 0 and for k = ``--k`` with forced acceptance a in ``--accept`` (the benchmark-only worker
setting: exactly a drafts accepted per verify, so a + 1 tokens per step). One suite (kvstore +
worker + router) per a; the first one also runs k = 0 (``--k 0``: only that). Each level's
engine-alone twin runs right after it, in this process beside the idle suite, so the two sides of
a ratio are seconds apart: on the GPU box a host that slowed over minutes moved one run's ratios
by up to 0.12 when every alone level ran after every served one (``--no-interleave``, the order
before session 39). The host's speed still drifts within minutes on a virtual machine (session
41: the same box's c 64 k 3 alone ran 23.3k and 16.8k tok/s five minutes apart), so
``--repeats N`` runs every level (served, then alone) N times over and reports the median pair's
ratio beside every pair's; each level also records the share of the machine's CPU time the
hypervisor gave to others meanwhile (``steal_share``, /proc/stat). ``--pin-engine N`` pins the
worker's engine process to N CPUs of its own and everything else off them (a test of whether
the served suite's other processes slow the host-bound engine thread). ``--path-trace`` has the
suite stamp each request's way to its first token (``services/common/path_trace.py``) and
reports, per level, the median of every hop (router Match, Reserve, the call, the worker's
GetReservation, the pipe into the engine, prefill, the way back). Per level::

    tokens/s   generated tokens ÷ wall time of the level (first send to last answer)
    TTFT       send → first streamed message with tokens (client clock)
    ITL        gap between two messages ÷ tokens in the later one, once per token (a message
               carries 1 + accepted drafts under speculation), p50/p99 over tokens
    tok/msg    tokens per streamed message after the first (≈ a + 1: checks forced acceptance)
    cores      CPU each process used ÷ wall (router.1 .. router.N: its processes under --router-procs)
    router CPU µs/tok   CPU seconds of every router process together ÷ tokens (client: the same for this process)

``--router-procs N`` serves the router as N processes on one port (``tandem router --procs N``);
the kernel hands each TCP connection to one of them, so the clients spread over ``--client-channels``
C connections (client j on channel j mod C; default with several router processes: one per
client, with one: a single channel, the baseline of earlier runs). Pass the same C to both sides
of a procs comparison. The engine-alone side is unchanged.

Also: TTFT of the very first request after the worker said SERVING ÷ steady-state TTFT (p50 at
concurrency 1, k = 0); on CUDA the batch-1 bandwidth bound (weight bytes ÷ device-copy bandwidth
measured here) and the engine-alone plain decode rate at batch 1 as a fraction of it.

    python bench/serve_bench.py --device cpu --shape tiny-cpu --quick     # CPU smoke run, < 2 min
    python bench/serve_bench.py --device cpu --shape tiny-cpu --concurrency 64 --k 0 --router-procs 2   # the front door on CPU
    python3 bench/serve_bench.py --shape 1b --json serve_1b.json --plot serve_1b.png   # GPU box
    python3 bench/serve_bench.py --shape 8b --json serve_8b.json --plot serve_8b.png

On the GPU box keep FlashInfer's JIT cache (``FLASHINFER_WORKSPACE_BASE``). A level issues no new
request after ``--level-max-s``: at the goal speeds every level runs its full count (1b ≈ 2 min,
8b ≈ 4 min including build, loads and one suite start per a); a slower served path runs fewer
requests per level instead of running longer (≲ 6 and 8 min).
    python bench/serve_bench.py --from-json serve_1b.json --plot serve_1b.png          # anywhere
    python bench/serve_bench.py --compare-steps run1.json run2.json --plot steps.png   # c 64: served vs alone wall
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import (  # noqa: E402
    busy_processes, cpu_jiffies, free_port, gc_pauses_in, gpu_ms, grouped_bars, machine, pin_tasks, pyspy_binary, split_cpus, start_suite, steal_share,
)
from services.common import path_trace  # noqa: E402
from services.common.gc_tuning import tune_gc  # noqa: E402
from worker_bench import bench_config  # noqa: E402

from services.gpuworker.model.config import LlamaConfig  # noqa: E402
from services.gpuworker.settings import WorkerSettings  # noqa: E402
from services.client import DEFAULT_STREAM_WINDOW_BYTES  # noqa: E402

SHAPES = {
    "tiny-cpu": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                            num_kv_heads=2, head_dim=16, max_seq_len=2048),
    "1b": bench_config(),  # worker_bench's 1.27B model, so the two benchmarks compare
    "8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, max_seq_len=8192, rope_theta=500000.0),
}
BLOCK = WorkerSettings.model_fields["block_size"].default  # the suite runs with the worker's default
# the worker's ahead-of-need capacity (its runner extends between steps): the engine alone does the same
WATERMARK_BLOCKS = WorkerSettings.model_fields["extend_watermark_blocks"].default
CHUNK_BLOCKS = WorkerSettings.model_fields["extend_chunk_blocks"].default
GC_WARN_MS = 5  # the suite's processes log every garbage collection this long (their streams stall)
GC_ENV = {f"TANDEM_{service}_GC_WARN_MS": str(GC_WARN_MS) for service in ("KVSTORE", "WORKER", "ROUTER")}


# ------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Level:
    """One measured (or warm-up) batch: ``requests`` requests, ``concurrency`` in flight."""

    concurrency: int
    k: int
    a: int | None  # forced acceptance of the worker (None: k = 0, no drafts to accept)
    requests: int
    max_new_tokens: int
    tag: int = 0  # 0 measured, 1 warm-up, 2 first request: keeps every prompt distinct
    repeat: int = 0  # which run of the level (--repeats): new private halves, new request ids

    @property
    def name(self) -> str:
        return f"c{self.concurrency} k{self.k}" + (f" a{self.a}" if self.a is not None else "")

    def request_id(self, prefix: str, i: int) -> str:
        """Request ``i``'s id, one per level and run (``--path-trace`` tells levels apart by it)."""
        return f"{prefix}-{self.tag}-{self.name.replace(' ', '')}-{self.repeat}-{i}"


class Prompts:
    """Token-id prompts: one shared prefix + a private random half per (level, index). Pure."""

    def __init__(self, seed: int, prompt_len: int, vocab: int):
        self.seed, self.vocab = seed, vocab
        self.shared = np.random.default_rng([seed, 99]).integers(0, vocab, prompt_len // 2).tolist()
        self.private_len = prompt_len - len(self.shared)

    def get(self, level: Level, i: int) -> list[int]:
        key = [self.seed, level.tag, level.concurrency, level.k, 0 if level.a is None else level.a + 1, i]
        key += [level.repeat] if level.repeat else []  # a level run again must not find its prompts cached
        return self.shared + np.random.default_rng(key).integers(0, self.vocab, self.private_len).tolist()


@dataclass
class Trace:
    """One request as its caller saw it: send time, (time, tokens) per message, end."""

    start: float
    events: list[tuple[float, int]] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


def level_stats(traces: list[Trace], wall_s: float) -> dict:
    """Figures of one level (pure; see the module docstring for the definitions)."""
    ok = [t for t in traces if not t.error and t.events]
    tokens = sum(n for t in ok for _, n in t.events)
    ttft = [(t.events[0][0] - t.start) * 1e3 for t in ok]
    itl: list[float] = []
    later_msgs = later_tokens = 0
    for t in ok:
        for (t0, _), (t1, n) in zip(t.events, t.events[1:]):
            itl += [(t1 - t0) * 1e3 / n] * n
            later_msgs += 1
            later_tokens += n

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else float("nan")

    return {
        "requests": len(traces), "failed": len(traces) - len(ok), "tokens": tokens, "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else float("nan"),
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
        "tokens_per_msg": later_tokens / later_msgs if later_msgs else float("nan"),
        # decode-only rate of one stream: tokens after the first ÷ time after the first
        "decode_tokens_per_s": later_tokens / sum(t.events[-1][0] - t.events[0][0] for t in ok)
        if later_msgs else float("nan"),
        "hit_rate": sum(t.cached_tokens for t in ok) / max(1, sum(t.prompt_tokens for t in ok)),
        "errors": sorted({t.error for t in traces if t.error})[:3],
        "timeline_ms": (spans := timeline(ok)),
        **decode_gaps(spans),
    }


def timeline(traces: list[Trace]) -> list[list[float]]:
    """Each request's (send, first token, end) in ms from the level's first send, in send order
    (pure): shows whether the closed loop's requests move in waves and how long a slot stays
    empty between one request's end and its client's next first token."""
    if not traces:
        return []
    t0 = min(t.start for t in traces)
    return sorted([round((t.start - t0) * 1e3, 2), round((t.events[0][0] - t0) * 1e3, 2), round((t.end - t0) * 1e3, 2)]
                  for t in traces)


def decode_gaps(timeline_ms: list[list[float]]) -> dict:
    """Stretches of a level, after its first token, with no request between its first token and
    its end (pure): the closed loop's requests move in waves, and between one wave's last end and
    the next wave's first token nothing decodes. The engine alone refills a slot at once; served,
    a slot waits for the client, the router and the worker, so these stretches grow by the
    served path's turnaround::

        wave 1  ═══════════╗                       ═ decoding (first token .. end)
                 ══════════╣   gap                 · sent, no token yet
        wave 2             ╚··········═══════════
    """
    spans = sorted((first, end) for _, first, end in timeline_ms)
    gaps, reach = [], None
    for first, end in spans:
        if reach is not None and first > reach:
            gaps.append(first - reach)
        reach = end if reach is None else max(reach, end)
    return {"decode_gaps": len(gaps), "decode_gap_ms_total": round(sum(gaps), 2),
            "decode_gap_ms_max": round(max(gaps), 2) if gaps else 0.0}


# ---------------------------------------------------------------------------------------- model
def build_model(shape: str, folder: Path, device: str, seed: int) -> dict:
    """A seeded random Llama of ``shape`` built by transformers on ``device`` (bf16 on CUDA,
    float32 on CPU), saved with ``save_pretrained`` plus a word-level tokenizer. Returns facts."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = SHAPES[shape]
    hf = {k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type")}
    # no BOS/EOS: a random model must not stop early on transformers' default ids 1 and 2
    config = transformers.LlamaConfig(**hf, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialize in the final dtype: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return {"shape": shape, "config": hf, "params": params, "weight_bytes": weight_bytes,
            "dtype": str(dtype), "build_s": time.perf_counter() - t0}


def write_reduced_draft(shape: str, folder: Path, draft_vocab: int, device: str, seed: int) -> dict:
    """``--draft-vocab N``: a seeded random EAGLE-3 head with an N-row LM head (the published heads
    of Llama-3 models keep 32,000 of 128,256 ids), written in the public layout to ``folder``;
    the worker loads it with ``--draft-model folder``. Draft id j is target id j."""
    import torch

    from services.common.spec import SpecMode
    from services.gpuworker.model import eagle3_format
    from services.gpuworker.model.config import DraftConfig
    from services.gpuworker.model.draft import Eagle3Draft
    from services.gpuworker.model.layers import init_weights
    from services.gpuworker.model.llama import TargetModel

    cfg = SHAPES[shape]
    config = dataclasses.replace(DraftConfig.default_for(cfg, SpecMode.EAGLE3), draft_vocab_size=draft_vocab)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device("meta"):
        target = TargetModel(cfg)  # only its shape: the draft shares nothing it writes
    draft = Eagle3Draft(target, config).to_empty(device=device)
    init_weights(draft, torch.Generator().manual_seed(seed + 1))  # CPU draws, as the loader's random drafts
    draft.set_vocab_map(torch.arange(draft_vocab))
    eagle3_format.save(draft, folder, dtype=dtype)
    return {"draft_vocab_size": draft_vocab, "draft_dir": str(folder)}


def copy_bandwidth_GBps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (reads + writes every byte) of a big torch copy."""
    import torch

    def timed() -> float:  # the buffers die with this frame, before empty_cache
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return gpu_ms(lambda: dst.copy_(src), reps=20)

    ms = timed()
    torch.cuda.empty_cache()
    return 2 * nbytes / ms / 1e6


# ------------------------------------------------------------------------------------- settings
def worker_settings(args, model_dir: Path, a: int | None):
    """The one WorkerSettings both the served worker (as flags) and the engine alone use."""
    gpu = args.device.startswith("cuda")
    draft = str(model_dir / "eagle3") if args.draft_vocab else "random"
    kw = dict(model=str(model_dir), spec_mode="eagle3", draft_model=draft, device=args.device,
              backend="flashinfer" if gpu else "torch", dtype="bfloat16" if gpu else "float32",
              num_blocks=kv_blocks(args), forced_acceptance=a)
    for name in ("cuda_graphs", "overlap_steps", "fused_spec_steps", "fused_spec_graphs", "max_batch_tokens", "chunk_size", "gil_switch_interval_ms", "engine_process",
                 "kvstore_carrier", "prefill_wait_steps", "prefill_batch", "stream_interval"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return WorkerSettings(**kw)


def kv_blocks(args) -> int:
    """Room for every request of the largest level at full length, plus the shared prefix."""
    per_request = -(-(args.prompt_len + args.max_new_tokens + args.k + 1) // BLOCK)
    return max(args.concurrency) * per_request + -(-args.prompt_len // BLOCK)


def settings_flags(settings) -> list[str]:
    """``tandem worker`` flags for the fields set explicitly on ``settings``."""
    flags = []
    for name in sorted(settings.model_fields_set):
        value, flag = getattr(settings, name), "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def levels_of(args, a: int) -> list[Level]:
    """The measured levels a suite with forced acceptance ``a`` runs (the first also k = 0), all
    of them ``--repeats`` times over (each time in the same order)."""
    out = []
    combos = ([(0, None)] if a == args.accept[0] else []) + ([(args.k, a)] if args.k else [])
    for k, acc in combos:
        for c in args.concurrency:
            out.append(Level(c, k, acc, max(args.rounds * c, args.min_requests), args.max_new_tokens))
    return [dataclasses.replace(level, repeat=r) for r in range(args.repeats) for level in out]


def warmup_of(args, k: int, a: int | None) -> Level:
    """A short unmeasured batch at the largest concurrency (compiles kernels, fills the cache)."""
    return Level(max(args.concurrency), k, a, max(args.concurrency), min(8, args.max_new_tokens), tag=1)


# ---------------------------------------------------------------------------------------- served
async def served_request(stub, prompt: list[int], level: Level, rid: str) -> Trace:
    import grpc

    from services.common.wire import tokens_to_proto
    from tandem.router.v1 import router_pb2

    request = router_pb2.GenerateRequest(token_ids=tokens_to_proto(prompt), max_new_tokens=level.max_new_tokens,
                                         num_draft_tokens=level.k, request_id=rid, temperature=0.0)
    trace = Trace(start=time.monotonic(), prompt_tokens=len(prompt))
    try:
        async for msg in stub.Generate(request, timeout=600):
            if msg.token_ids:
                trace.events.append((time.monotonic(), len(msg.token_ids)))
            if msg.HasField("usage"):
                trace.cached_tokens = msg.usage.cached_tokens
    except grpc.aio.AioRpcError as err:
        trace.error = f"{err.code().name}: {err.details()}"
    trace.end = time.monotonic()
    return trace


async def closed_loop(stubs: list, level: Level, indices, clients: int, prompts: Prompts, max_s: float, prefix: str,
                      t0: float) -> list[Trace]:
    """``clients`` clients, each sending its next request (the next of ``indices``) when its last
    ended, none after ``max_s`` from ``t0``; client j always uses ``stubs[j % len(stubs)]``."""
    traces: list[Trace] = []
    todo = iter(indices)  # shared: each index is taken by one client

    async def client(stub) -> None:
        for i in todo:
            if time.monotonic() - t0 >= max_s:
                return
            traces.append(await served_request(stub, prompts.get(level, i), level, level.request_id(prefix, i)))

    await asyncio.gather(*(client(stubs[j % len(stubs)]) for j in range(clients)))
    return traces


async def served_level(stubs: list, level: Level, prompts: Prompts, max_s: float, prefix: str) -> tuple[list[Trace], float]:
    """Closed loop in this process: ``concurrency`` clients over the level's requests (one
    connection per stub: see ``open_channels``). Returns the traces and the wall time."""
    t0 = time.monotonic()
    traces = await closed_loop(stubs, level, range(level.requests), level.concurrency, prompts, max_s, prefix, t0)
    return traces, time.monotonic() - t0


class ClientProcs:
    """``--client-procs N``: the served clients of the warm-ups and measured levels in N processes
    of their own, so that the load generator is not what limits the served figures (one Python
    process streaming 64 requests used ~0.9 of a core at c 64 k 0 on the H200 box, where every
    token it parses delays the next request a client sends). The processes split the level's
    client slots and requests (``client_shares``); all start from the same ``t0``
    (``time.monotonic`` is system-wide), and the wall is until the last ends. One measured run
    (H100, c 64) with 4 processes: client CPU 0.9 → 1.2 cores in all, TTFT and throughput level
    with one process, i.e. the client was not the limit there."""

    def __init__(self, n: int, address: str, channels_each: int, prompts: Prompts, window_bytes: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.cpu_s = 0.0  # the children's CPU seconds so far (os.times of each, all threads)
        self._conns, self._procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_proc_main, daemon=True,
                               args=(child, address, channels_each, window_bytes, prompts.seed,
                                     len(prompts.shared) + prompts.private_len, prompts.vocab))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for conn in self._conns:
            if conn.recv() != "ready":
                raise RuntimeError("a client process did not start")

    async def level(self, level: Level, max_s: float, prefix: str) -> tuple[list[Trace], float]:
        t0 = time.monotonic()
        busy = []
        for conn, (clients, indices) in zip(self._conns, client_shares(level, len(self._conns))):
            if clients:
                conn.send((level, indices, clients, max_s, prefix, t0))
                busy.append(conn)
        answers = await asyncio.gather(*(asyncio.to_thread(conn.recv) for conn in busy))
        wall = time.monotonic() - t0
        traces = []
        for rows, cpu_s in answers:
            traces += [Trace(*row) for row in rows]
            self.cpu_s += cpu_s
        return traces, wall

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def client_shares(level: Level, n: int) -> list[tuple[int, list[int]]]:
    """(clients, request indices) of each of ``n`` client processes (pure): process p runs the
    client slots s < concurrency with s mod n = p, over the requests i with (i mod concurrency)
    mod n = p, so each request is sent once and the processes share the load as the slots do."""
    return [(sum(1 for slot in range(level.concurrency) if slot % n == p),
             [i for i in range(level.requests) if (i % level.concurrency) % n == p]) for p in range(n)]


def client_proc_main(conn, address: str, channels_each: int, window_bytes: int, seed: int, prompt_len: int,
                     vocab: int) -> None:
    """A client process of :class:`ClientProcs`: one event loop and its channels for all levels."""
    from tandem.router.v1 import router_pb2_grpc

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def open_stubs():
        return [router_pb2_grpc.RouterStub(c) for c in open_channels(address, channels_each, window_bytes)]

    stubs = loop.run_until_complete(open_stubs())
    prompts = Prompts(seed, prompt_len, vocab)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        level, indices, clients, max_s, prefix, t0 = job
        cpu0 = sum(os.times()[:2])
        traces = loop.run_until_complete(closed_loop(stubs, level, indices, clients, prompts, max_s, prefix, t0))
        conn.send(([dataclasses.astuple(t) for t in traces], sum(os.times()[:2]) - cpu0))


NO_STEPS = {"steps": 0.0, "step_s": 0.0, "tokens": 0.0, "prefill_steps": 0.0, "prefill_step_s": 0.0,  # before the first step
            "decode_wait_s": 0.0, "prefill_wait_s": 0.0}


WORKER_COUNTERS = {"tandem_worker_step_duration_seconds_count": "steps", "tandem_worker_step_duration_seconds_sum": "step_s",
                   "tandem_worker_generated_tokens_total": "tokens", "tandem_worker_between_steps_seconds_total": "between_s",
                   "tandem_worker_idle_seconds_total": "idle_s",
                   "tandem_worker_prefill_step_duration_seconds_count": "prefill_steps",
                   "tandem_worker_prefill_step_duration_seconds_sum": "prefill_step_s",
                   'tandem_worker_device_wait_seconds_total{step="decode"}': "decode_wait_s",
                   'tandem_worker_device_wait_seconds_total{step="prefill"}': "prefill_wait_s",
                   "tandem_worker_time_to_first_token_seconds_sum": "worker_ttft_s",
                   "tandem_worker_time_to_first_token_seconds_count": "worker_ttft_n",
                   "tandem_worker_request_queue_time_seconds_sum": "queue_ttft_s",
                   "tandem_worker_request_queue_time_seconds_count": "queue_ttft_n"}
ROUTER_COUNTERS = {"tandem_router_ttft_seconds_sum": "router_ttft_s", "tandem_router_ttft_seconds_count": "router_ttft_n"}


def scrape(urls: list[str], names: dict[str, str]) -> dict[str, float]:
    """The named samples of Prometheus endpoints, summed over ``urls`` (unreachable ones skipped)."""
    import urllib.request

    out: dict[str, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in names:
                out[names[name]] = out.get(names[name], 0.0) + float(value)
    return out


def worker_steps(metrics_url: str, router_urls: list[str] = ()) -> dict[str, float]:
    """The worker's engine-step counters from its Prometheus endpoint: steps, seconds in steps
    and tokens generated, and the engine thread's work between steps — what ``step_stats`` turns
    into per-step figures — and the worker's and router's TTFT sums (``ttft_split``)."""
    return {**scrape([metrics_url], WORKER_COUNTERS), **scrape(list(router_urls), ROUTER_COUNTERS)}


def ttft_split(before: dict, after: dict) -> dict:
    """Mean TTFT of a level's requests as the router and the worker timed them (pure): the
    worker's is its arrival to the engine's first token (``queue`` of it: until the engine
    admitted the request), the router's its arrival to the first token it got; the client's mean
    minus the router's is the client and its connection."""
    out = {}
    for who in ("router", "worker", "queue"):
        n = after.get(f"{who}_ttft_n", 0.0) - before.get(f"{who}_ttft_n", 0.0)
        if n > 0:
            out[f"ttft_mean_{who}_ms"] = 1e3 * (after[f"{who}_ttft_s"] - before.get(f"{who}_ttft_s", 0.0)) / n
    return out


def step_stats(before: dict, after: dict, wall_s: float) -> dict:
    """Engine steps of a level (pure): how many, mean host time of ``Engine.step`` (the call, as
    the worker's step histogram times it), tokens per step (≈ batch occupancy × tokens a step
    gives a request), the share of the level's wall time spent inside steps, the share the
    engine thread spent working between steps (admitting, applying results, kvstore verbs,
    shipping events) and the rest: waiting with nothing to step (the served path not feeding it)."""
    if not before or not after:
        return {}
    steps = after["steps"] - before["steps"]
    busy = after["step_s"] - before["step_s"]
    return {"steps": int(steps), "step_ms_mean": 1e3 * busy / steps if steps else float("nan"),
            "tokens_per_step": (after["tokens"] - before["tokens"]) / steps if steps else float("nan"),
            "in_step_share": busy / wall_s if wall_s > 0 else float("nan"),
            **prefill_stats(before, after, steps, busy), **between_stats(before, after, busy, wall_s)}


def prefill_stats(before: dict, after: dict, steps: float, busy_s: float) -> dict:
    """The steps that computed prompt positions (eager prefill / mixed) against the decode steps
    (graph replays), with the mean time of each (pure)."""
    if "prefill_steps" not in after:
        return {}
    n = after["prefill_steps"] - before.get("prefill_steps", 0.0)
    prefill_s = after["prefill_step_s"] - before.get("prefill_step_s", 0.0)
    nan = float("nan")
    out = {"prefill_steps": int(n), "prefill_step_ms_mean": 1e3 * prefill_s / n if n else nan,
           "decode_step_ms_mean": 1e3 * (busy_s - prefill_s) / (steps - n) if steps > n else nan}
    if "decode_wait_s" in after:  # of each decode step, the wait for the device (~0: host-bound)
        wait_s = after["decode_wait_s"] - before.get("decode_wait_s", 0.0)
        out["decode_wait_ms_mean"] = 1e3 * wait_s / (steps - n) if steps > n else nan
    return out


def steps_line(stats: dict) -> str:
    """A level's step figures in words (both suites print them alike)."""
    if not stats.get("steps"):
        return ""
    line = (f"; {stats['steps']} steps of {stats['step_ms_mean']:.1f} ms, {stats['tokens_per_step']:.1f} tok/step, "
            f"{100 * stats['in_step_share']:.0f} % of the wall in steps")
    if "prefill_steps" in stats:
        wait = f", {stats['decode_wait_ms_mean']:.2f} of it waiting for the device" if "decode_wait_ms_mean" in stats else ""
        line += (f" ({stats['prefill_steps']} with prompts, {stats['prefill_step_ms_mean']:.1f} ms each; "
                 f"decode {stats['decode_step_ms_mean']:.2f} ms{wait})")
    return line


def gaps_line(stats: dict, who: str = "") -> str:
    """A level's stretches with nothing decoding (``decode_gaps``), in words (``who``: whose)."""
    if not stats.get("decode_gaps"):
        return ""
    return (f"; {who + ' ' if who else ''}nothing decoding {stats['decode_gap_ms_total']:.0f} ms in "
            f"{stats['decode_gaps']} gaps (longest {stats['decode_gap_ms_max']:.0f})")


def between_stats(before: dict, after: dict, busy_s: float, wall_s: float) -> dict:
    """Shares of the wall between steps: the engine thread's own work, and its waits (pure); of
    the waits, ``idle_share`` had no request to step (the served path not feeding the engine: a
    level's edges and slots refilled late), the rest stalled on the kvstore or fell outside the
    worker's turns."""
    if "between_s" not in after or wall_s <= 0:
        return {}
    between = after["between_s"] - before.get("between_s", 0.0)
    out = {"between_share": between / wall_s, "waiting_share": max(0.0, 1.0 - (busy_s + between) / wall_s)}
    if "idle_s" in after:
        out["idle_share"] = (after["idle_s"] - before.get("idle_s", 0.0)) / wall_s
    return out


def client_channels(args) -> int:
    """Channels (TCP connections) the served clients spread over: ``--client-channels``, or by
    default one when one router process serves and one per client of the largest level when
    several do (the kernel hands each *connection* to one of them, by a hash)."""
    if args.client_channels:
        return args.client_channels
    return 1 if args.router_procs == 1 else max(args.concurrency)


def open_channels(address: str, n: int, window_bytes: int) -> list:
    """``n`` grpc.aio channels to ``address`` on ``n`` connections: gRPC Python channels with the
    same target and options share one connection through the global subchannel pool unless each
    has a local pool (one channel keeps the pool: the single-connection baseline as before).
    ``window_bytes``: each stream's unread bytes gRPC buffers, as Tandem's client sets it
    (``--client-window-bytes``; 0 = gRPC's auto-tuned window)."""
    import grpc

    from services.common.channels import stream_window_options

    options = [("grpc.use_local_subchannel_pool", 1)] if n > 1 else []
    options += stream_window_options(window_bytes)
    return [grpc.aio.insecure_channel(address, options=options) for _ in range(n)]


def router_cpu(cpu: dict[str, float]) -> float:
    """CPU seconds of the router: the process itself plus its children (``--router-procs N``:
    the parent supervises, ``router.1`` .. ``router.N`` serve)."""
    return sum(v for k, v in cpu.items() if k == "router" or k.startswith("router."))


def cpu_now(suite, pool: ClientProcs | None = None) -> dict[str, float]:
    """CPU seconds used so far by each suite process and by the clients (this process and, with
    ``--client-procs``, its client processes)."""
    return {**suite.cpu_seconds(), "client": sum(os.times()[:2]) + (pool.cpu_s if pool else 0.0)}


def profiled(args, level: Level) -> bool:
    """Whether ``--profile`` names ``level`` (spaces ignored: "c64 k0" or "c64k0")."""
    wanted = {name.replace(" ", "") for name in (args.profile or "").split(",")}
    return level.name.replace(" ", "") in wanted


def profile_level(args, suite, level: Level, out_dir: Path | None) -> list[subprocess.Popen]:
    """``--profile LEVEL``: py-spy records the worker and router while the named level runs, as
    collapsed stacks in ``out_dir``: every thread including where it waits (``--idle``: why the
    engine thread is not stepping), and the GIL holder only (``_gil``: where the host time goes)."""
    if not profiled(args, level) or out_dir is None:
        return []
    pyspy = pyspy_binary()
    procs = []
    for name, pid in suite.pids():
        if name.startswith("kvstore"):
            continue
        for gil in (False, True):
            dest = out_dir / f"pyspy_{name}_{level.name.replace(' ', '')}{'_gil' if gil else ''}.txt"
            cmd = [pyspy, "record", "--pid", str(pid), "--duration",
                   str(max(1, int(args.level_max_s) - 1)), "--rate", "200", "--format", "raw", "--threads",
                   "--nonblocking", "-o", str(dest)] + (["--gil"] if gil else ["--idle"])
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def profile_alone(args, level: Level, out_dir: Path | None) -> subprocess.Popen | None:
    """``--profile LEVEL`` for the engine alone: py-spy records this process (GIL holders only)
    until ``stop_profile``; the engine alone's level is the served one's baseline."""
    if not profiled(args, level) or out_dir is None:
        return None
    dest = out_dir / f"pyspy_alone_{level.name.replace(' ', '')}_gil.txt"
    proc = subprocess.Popen([pyspy_binary(), "record", "--pid", str(os.getpid()), "--rate", "200", "--format", "raw",
                             "--threads", "--nonblocking", "--gil", "-o", str(dest)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches before the level starts
    return proc


def stop_profile(proc: subprocess.Popen | None) -> None:
    """End a ``profile_alone`` recording; py-spy writes its file on SIGINT."""
    if proc is not None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


async def served_suite(args, suite, a: int, prompts: Prompts, log, metrics_url: str, router_urls: list[str] = (),
                       twin: Callable[[dict], None] | None = None, path_prefix: Path | None = None) -> dict:
    """First request right after SERVING, a warm-up per k, then every measured level, each
    followed by ``twin(its stats)`` if given (the engine alone's run of the same level).
    ``path_prefix``: the suite's path trace (``--path-trace``), read after each level."""
    from tandem.router.v1 import router_pb2_grpc

    out = {"levels": []}
    channels = open_channels(suite.router, client_channels(args), args.client_window_bytes)
    pool: ClientProcs | None = None
    try:
        stubs = [router_pb2_grpc.RouterStub(channel) for channel in channels]
        levels = levels_of(args, a)
        first = Level(1, levels[0].k, levels[0].a, 1, args.max_new_tokens, tag=2)
        (trace,), _ = await served_level(stubs, first, prompts, 1e9, f"a{a}")
        out["first_ttft_ms"] = (trace.events[0][0] - trace.start) * 1e3 if trace.events else float("nan")
        out["first_error"] = trace.error
        log(f"  first request after SERVING: TTFT {out['first_ttft_ms']:.0f} ms {trace.error}")
        if args.client_procs > 1:
            pool = ClientProcs(args.client_procs, suite.router, -(-client_channels(args) // args.client_procs), prompts,
                               args.client_window_bytes)

            async def run_level(level: Level):
                return await pool.level(level, args.level_max_s, f"a{a}")
        else:
            async def run_level(level: Level):
                return await served_level(stubs, level, prompts, args.level_max_s, f"a{a}")
        warmed = set()
        for level in levels:
            if level.k not in warmed:
                warm = warmup_of(args, level.k, level.a)
                traces, wall = await run_level(warm)
                log(f"  warm-up {warm.name}: {len(traces)} requests in {wall:.1f} s")
                warmed.add(level.k)
            cpu0, steps0 = cpu_now(suite, pool), worker_steps(metrics_url, router_urls)
            profilers = profile_level(args, suite, level, args.json.parent if args.json else None)
            jiffies0 = cpu_jiffies()
            traces, wall = await run_level(level)
            jiffies1 = cpu_jiffies()
            cpu1, steps1 = cpu_now(suite, pool), worker_steps(metrics_url, router_urls)
            for p in profilers:
                p.wait(timeout=30)
            stats = {**asdict(level), **level_stats(traces, wall), **step_stats(steps0, steps1, wall),
                     **ttft_split(steps0, steps1)}
            # share of one core each process used during the level (1.0 = a core busy)
            stats["cpu_cores"] = {k: round((cpu1[k] - cpu0.get(k, 0.0)) / wall, 2) for k in cpu1} if wall > 0 else {}
            # router CPU per streamed token, all its processes together (what --router-procs spreads)
            stats["router_cpu_us_per_token"] = (1e6 * (router_cpu(cpu1) - router_cpu(cpu0)) / stats["tokens"]
                                                if stats["tokens"] else float("nan"))
            stats["client_cpu_us_per_token"] = (1e6 * (cpu1["client"] - cpu0["client"]) / stats["tokens"]
                                                if stats["tokens"] else float("nan"))
            stats["ended_at"] = time.time()  # when the level ended (epoch s): shows the order served/alone ran in
            stats["steal_share"] = steal_share(jiffies0, jiffies1)
            if path_prefix is not None:
                stats["path_ms"] = path_split(path_prefix, {level.request_id(f"a{a}", i) for i in range(level.requests)})
            out["levels"].append(stats)
            log(f"  served {level.name}: {stats['requests']} requests, {stats['tokens_per_s']:.1f} tok/s, "
                f"TTFT p50 {stats['ttft_p50_ms']:.0f} ms, ITL p50 {stats['itl_p50_ms']:.1f} ms, "
                f"{stats['tokens_per_msg']:.2f} tok/msg, hit {100 * stats['hit_rate']:.0f} %, cores "
                + " ".join(f"{k} {v:.2f}" for k, v in stats["cpu_cores"].items())
                + f", router {stats['router_cpu_us_per_token']:.0f} µs CPU/token, client {stats['client_cpu_us_per_token']:.0f}"
                + f", CPU stolen by the hypervisor {100 * stats['steal_share']:.1f} %"
                + (f", {stats['failed']} failed: {stats['errors']}" if stats["failed"] else "")
                + steps_line(stats)
                + (f", {100 * stats['between_share']:.0f} % working between them, {100 * stats['waiting_share']:.0f} % "
                   "waiting" if "between_share" in stats else "")
                + (f" ({100 * stats['idle_share']:.0f} % with no request)" if "idle_share" in stats else "")
                + gaps_line(stats)
                + (f"; TTFT mean client {stats['ttft_mean_ms']:.0f} / router {stats['ttft_mean_router_ms']:.0f} / worker "
                   f"{stats['ttft_mean_worker_ms']:.0f} (queued {stats.get('ttft_mean_queue_ms', float('nan')):.0f}) ms"
                   if "ttft_mean_worker_ms" in stats and "ttft_mean_router_ms" in stats else ""))
            if stats.get("path_ms"):
                log("    way to the first token, ms (p50 over its requests): "
                    + ", ".join(f"{hop} {ms:.2f}" for hop, ms in stats["path_ms"].items()))
            if twin is not None:
                twin(stats)
    finally:
        if pool is not None:
            pool.close()
        await asyncio.gather(*(channel.close() for channel in channels))
    return out


def run_served(args, model_dir: Path, prompts: Prompts, log_root: Path, log, alone_out: list | None = None) -> list[dict]:
    """One suite per forced acceptance a. With ``alone_out`` (``--interleave``), the engine alone
    is built in this process before each suite starts and runs each level right after its served
    twin, its rows appended there: both sides of a ratio then run within seconds of each other,
    where a host that speeds up or slows down over minutes would otherwise tilt it."""
    router = ["--model", str(model_dir), "--num-draft-tokens", str(args.k),
              *(["--procs", str(args.router_procs)] if args.router_procs > 1 else []),
              *(["--worker-stream-window-bytes", str(args.router_window_bytes)] if args.router_window_bytes is not None else [])]
    suites = []
    models = None
    for a in args.accept:
        alone = None
        if alone_out is not None:
            alone = AloneEngine(args, model_dir, prompts, a, log, models)
            models = alone.models
        settings = worker_settings(args, model_dir, a)
        log_dir = log_root / f"a{a}"
        log_dir.mkdir()
        log(f"[served a={a}] starting kvstore + worker ({' '.join(settings_flags(settings))}) + router ...")
        t0 = time.monotonic()
        metrics_port, router_metrics = free_port(), free_port()
        # process i of a router group (0..N-1) serves its metrics on router_metrics + i
        router_urls = [f"http://127.0.0.1:{router_metrics + i}/metrics" for i in range(args.router_procs)]
        path_prefix = log_dir / "path" if args.path_trace else None  # --path-trace: the suite's stamps
        try:
            suite = start_suite(log_dir, [settings_flags(settings) + ["--metrics-port", str(metrics_port)]],
                                router + ["--metrics-port", str(router_metrics)], timeout_s=args.startup_timeout_s,
                                env={**GC_ENV, **({path_trace.ENV: str(path_prefix)} if path_prefix else {})})
        except Exception:
            print_logs(log_dir)
            if alone is not None:
                alone.close()  # its device memory, before the error ends the run
            raise
        log(f"[served a={a}] all SERVING after {time.monotonic() - t0:.1f} s")
        if args.pin_engine:
            pin_engine(suite, args.pin_engine, log)
        twin = None if alone is None else (lambda row: alone_out.append(alone.run(row)))
        try:
            result = asyncio.run(served_suite(args, suite, a, prompts, log, f"http://127.0.0.1:{metrics_port}/metrics",
                                              router_urls, twin, path_prefix))
        finally:
            suite.stop()
            if alone is not None:
                alone.close()
        if result["first_error"] or any(r["failed"] for r in result["levels"]):
            print_logs(log_dir)  # the folder is temporary: show why while it exists
        # every collection of GC_WARN_MS or more each process logged (see main): they stall its streams
        result["gc_pauses"], _ = gc_pauses_in(log_dir)
        log(f"[served a={a}] garbage collections >= {GC_WARN_MS} ms: " + (", ".join(
            f"{who} {sum(p['by_generation'])} (longest {p['longest_ms']} ms)" for who, p in sorted(result["gc_pauses"].items())) or "none"))
        suites.append({"a": a, "startup_s": time.monotonic() - t0, **result})
    return suites


def pin_engine(suite, n: int, log) -> None:
    """``--pin-engine N``: the worker's engine process (the child of a worker that has used the
    most CPU: it built and warmed up the engine) on the last ``N`` CPUs, and everything else —
    this process (clients, the engine alone), the suite, the engine process's own children —
    on the others, off those CPUs' SMT siblings: the host-bound engine thread then never shares
    a core or waits for a CPU."""
    own, rest = split_cpus(n)
    cpu = suite.cpu_seconds()
    engine = max((name for name in cpu if name.startswith("worker") and "." in name), key=cpu.get)
    pid = dict(suite.pids())[engine]
    others = pin_tasks(os.getpid(), rest)
    mine = pin_tasks(pid, own, descendants=False)
    log(f"  pinned {engine} (pid {pid}, {mine} threads) to CPUs {sorted(own)}, {others - mine} other threads to "
        f"{len(rest)} CPUs off them and their SMT siblings")


def path_split(prefix: Path, request_ids: set[str]) -> dict[str, float]:
    """p50 of each hop of the way to the first token (``services/common/path_trace.py``) over the
    requests of ``request_ids`` the trace saw, in ms, in the order of the way."""
    per_hop: dict[str, list[float]] = {}
    for rid, path in path_trace.read_paths(prefix).items():
        if rid in request_ids:
            for hop, s in path_trace.hops(path).items():
                per_hop.setdefault(hop, []).append(s * 1e3)
    return {hop: float(np.median(v)) for hop, v in per_hop.items()}


def print_logs(log_dir: Path) -> None:
    for f in sorted(log_dir.iterdir()):
        print(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}", file=sys.stderr)


# ---------------------------------------------------------------------------------- engine alone
def engine_level(setup, level: Level, prompts: Prompts, prefix_blocks: list[int], reused: int,
                 max_s: float) -> tuple[list[Trace], float, dict]:
    """Closed loop on the engine itself: keep ``concurrency`` requests admitted, top up between
    steps (where the worker's engine thread admits too), until ``requests`` were issued.
    Returns the traces, the wall time and the level's ``step_stats``."""
    import torch

    from services.gpuworker.engine.local import submit

    engine, source = setup.engine, setup.source
    gpu = engine.device.type == "cuda"
    pending = deque(range(level.requests))
    traces: dict[str, Trace] = {}
    if gpu:
        torch.cuda.synchronize()
    t0 = time.monotonic()
    steps = dict(NO_STEPS)
    # bounded: each step prefills at least one position or emits at least one token of a request
    for _ in range(level.requests * (len(prompts.shared) + prompts.private_len + level.max_new_tokens) + 100):
        while pending and len(engine.request_ids()) < level.concurrency and time.monotonic() - t0 < max_s:
            i = pending.popleft()
            rid = f"{level.tag}-{level.name}-{i}"
            prompt = prompts.get(level, i)
            traces[rid] = Trace(start=time.monotonic(), prompt_tokens=len(prompt), cached_tokens=reused)
            submit(setup, rid, prompt, max_new_tokens=level.max_new_tokens, k=level.k, prefix_blocks=prefix_blocks,
                   reused_positions=reused, headroom=level.k + 1)
        if not engine.has_work():
            break
        # capacity ahead of need, as the served worker's runner asks for it (there off the step, by
        # RPC): without it every request extends inside a step every few steps, and a fused step
        # is then scheduled, not launched from the last verdict
        wants = engine.capacity_wants(WATERMARK_BLOCKS, CHUNK_BLOCKS)
        for rid, table in (source.extend(wants) if wants else {}).items():
            if not isinstance(table, Exception):
                engine.adopt_table(rid, table)
        started = time.perf_counter()
        report = engine.step()
        elapsed = time.perf_counter() - started
        steps["step_s"] += elapsed
        steps["steps"] += 1
        if any(r.prefill_tokens for r in report.results.values()):
            steps["prefill_steps"] += 1
            steps["prefill_step_s"] += elapsed
            steps["prefill_wait_s"] += report.device_wait_s
        else:
            steps["decode_wait_s"] += report.device_wait_s
        now = time.monotonic()
        for rid, r in report.results.items():
            if r.new_token_ids:
                steps["tokens"] += len(r.new_token_ids)
                traces[rid].events.append((now, len(r.new_token_ids)))
            if r.error is not None and r.finished:
                traces[rid].error = repr(r.error)
            if r.finished:
                traces[rid].end = now
                source.release(rid)
    else:
        raise RuntimeError(f"engine level {level.name} did not finish")
    if gpu:
        torch.cuda.synchronize()
    wall = time.monotonic() - t0
    return list(traces.values()), wall, step_stats(NO_STEPS, steps, wall)


def loaded_level(args, setup, level: Level, prompts: Prompts, prefix_blocks: list[int], reused: int, log) -> dict:
    """``--alone-busy-procs N``: the engine alone's level again with N busy processes beside it,
    to tell the served run's own costs from what its other processes cost the host's speed."""
    with busy_processes([None] * args.alone_busy_procs):
        traces, wall, steps = engine_level(setup, level, prompts, prefix_blocks, reused, 1e9)
    stats = {**level_stats(traces, wall), **steps}
    log(f"  alone  {level.name} beside {args.alone_busy_procs} busy processes: {stats['tokens_per_s']:.1f} tok/s"
        + steps_line(stats))
    return stats


class AloneEngine:
    """The engine alone for one forced acceptance ``a``: built as the worker builds it and warmed
    up, the shared prefix computed once and kept; ``run(row)`` runs the level of a served row
    (its concurrency, k and finished request count) in this process, without gRPC."""

    def __init__(self, args, model_dir: Path, prompts: Prompts, a: int, log, models=None):
        from services.gpuworker.build import build_engine
        from services.gpuworker.engine.capacity import LocalBlockSource
        from services.gpuworker.engine.local import LocalSetup, run_until_done, submit

        self.args, self.prompts, self.log = args, prompts, log
        settings = worker_settings(args, model_dir, a)
        t0 = time.monotonic()
        built = build_engine(settings, lambda n: LocalBlockSource(n, settings.block_size), models=models)
        self.models = (built.target, built.draft)
        graphs = built.engine.warmup()  # what the worker does before it says SERVING
        tune_gc()  # and then (gc_freeze, the services' default): the start-up heap out of the collector's reach
        self.setup = LocalSetup(built.engine, built.source, built.target, built.draft)
        log(f"[engine alone a={a}] built and warmed up in {time.monotonic() - t0:.1f} s "
            f"({built.num_blocks} blocks, {graphs} CUDA graphs)")
        span = built.draft.span if built.draft is not None else 0
        # what the kvstore can reuse of the shared prefix: whole blocks whose keys it knows
        bs = settings.block_size
        self.reused = (len(prompts.shared) - span) // bs * bs
        submit(self.setup, "prefix", prompts.shared, max_new_tokens=1)
        self.prefix_blocks = run_until_done(self.setup, keep=("prefix",))["prefix"].block_table[: self.reused // bs]
        self.warmed: set[int] = set()

    def run(self, row: dict) -> dict:
        """The engine alone's twin of served level ``row`` (a warm-up first, once per k)."""
        args, setup = self.args, self.setup
        level = Level(row["concurrency"], row["k"], row["a"], row["requests"], row["max_new_tokens"],
                      repeat=row.get("repeat", 0))
        if level.k not in self.warmed:
            engine_level(setup, warmup_of(args, level.k, level.a), self.prompts, self.prefix_blocks, self.reused,
                         args.level_max_s)
            self.warmed.add(level.k)
        profiler = profile_alone(args, level, args.json.parent if args.json else None)
        jiffies0 = cpu_jiffies()
        try:
            traces, wall, steps = engine_level(setup, level, self.prompts, self.prefix_blocks, self.reused, 1e9)
        finally:
            stop_profile(profiler)
        stats = {**asdict(level), **level_stats(traces, wall), **steps, "ended_at": time.time(),
                 "steal_share": steal_share(jiffies0, cpu_jiffies())}
        if args.alone_busy_procs:
            stats["busy"] = loaded_level(args, setup, level, self.prompts, self.prefix_blocks, self.reused, self.log)
        self.log(f"  alone  {level.name}: {stats['requests']} requests, {stats['tokens_per_s']:.1f} tok/s, "
                 f"TTFT p50 {stats['ttft_p50_ms']:.0f} ms, ITL p50 {stats['itl_p50_ms']:.1f} ms "
                 f"(served ÷ alone {row['tokens_per_s'] / stats['tokens_per_s']:.2f}), CPU stolen "
                 f"{100 * stats['steal_share']:.1f} %" + steps_line(stats) + gaps_line(stats))
        return stats

    def close(self) -> None:
        """Free the engine's device memory (its models stay in ``models`` for the next a)."""
        import torch

        del self.setup
        if self.args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def run_engine_alone(args, model_dir: Path, prompts: Prompts, served: list[dict], log) -> list[dict]:
    """Per a: the engine alone (``AloneEngine``), then each level with the request count its
    served twin finished."""
    models = None
    out = []
    for suite in served:
        alone = AloneEngine(args, model_dir, prompts, suite["a"], log, models)
        models = alone.models
        out += [alone.run(row) for row in suite["levels"]]
        alone.close()
    return out


# --------------------------------------------------------------------------------------- report
def combine(res: dict) -> list[dict]:
    """One row per (concurrency, k, a): served and engine-alone figures side by side. A level run
    several times (``--repeats``) pairs its i-th served run with its i-th alone run; the row is
    the pair whose ratio is the median (the lower one of an even count), and ``ratios`` holds
    every pair's."""
    def key(r: dict) -> tuple:
        return r["concurrency"], r["k"], r["a"]

    alone: dict[tuple, list[dict]] = {}
    for r in res["engine_alone"]:
        alone.setdefault(key(r), []).append(r)
    pairs: dict[tuple, list[dict]] = {}
    for suite in res["served"]:
        for s in suite["levels"]:
            runs = alone.get(key(s), [])
            i = len(pairs.get(key(s), []))
            e = runs[i] if i < len(runs) else (runs[-1] if runs else {})
            ratio = s["tokens_per_s"] / e["tokens_per_s"] if e.get("tokens_per_s") else float("nan")
            pairs.setdefault(key(s), []).append({"served": s, "alone": e, "served_over_alone": ratio})
    rows = []
    for runs in pairs.values():
        ranked = sorted(runs, key=lambda r: r["served_over_alone"])
        rows.append({**ranked[(len(ranked) - 1) // 2], "ratios": [r["served_over_alone"] for r in runs]})
    rows.sort(key=lambda r: (r["served"]["k"], -1 if r["served"]["a"] is None else r["served"]["a"],
                             r["served"]["concurrency"]))
    return rows


def headline(res: dict) -> dict:
    """TTFT after SERVING vs steady state; bandwidth bound and batch-1 engine decode vs it."""
    rows = combine(res)
    base = [r for r in rows if r["served"]["k"] == 0 and r["served"]["concurrency"] == 1]
    steady = base[0]["served"]["ttft_p50_ms"] if base else float("nan")
    first = res["served"][0]["first_ttft_ms"]
    out = {"first_ttft_ms": first, "steady_ttft_ms": steady, "first_over_steady": first / steady}
    bw = res.get("copy_GBps")
    if bw and base and base[0]["alone"]:
        bound = bw * 1e9 / res["model"]["weight_bytes"]
        out.update(bound_tokens_per_s=bound, alone_decode_b1_tokens_per_s=base[0]["alone"]["decode_tokens_per_s"],
                   alone_decode_b1_of_bound=base[0]["alone"]["decode_tokens_per_s"] / bound)
    spec = [r for r in rows if r["served"]["k"] > 0 and r["served"]["concurrency"] == 1]
    if base and spec:
        best = max(spec, key=lambda r: r["served"]["a"])
        out[f"served_c1_k{best['served']['k']}_a{best['served']['a']}_over_k0"] = (
            best["served"]["tokens_per_s"] / base[0]["served"]["tokens_per_s"])
    return out


def ratio_cell(row: dict) -> str:
    """served/alone; over several pairs the median and (every pair's ratio)."""
    ratios = row.get("ratios", [])
    return f"{row['served_over_alone']:.2f}" + (f" ({', '.join(f'{v:.2f}' for v in ratios)})" if len(ratios) > 1 else "")


def table(res: dict) -> str:
    cols = ["conc", "k", "a", "served tok/s", "alone tok/s", "served/alone", "TTFT p50/p99 ms", "ITL p50/p99 ms",
            "tok/msg", "hit", "router CPU µs/tok", "reqs"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for r in combine(res):
        s, e = r["served"], r["alone"]
        lines.append("| " + " | ".join([
            str(s["concurrency"]), str(s["k"]), "-" if s["a"] is None else str(s["a"]),
            f"{s['tokens_per_s']:.1f}", f"{e.get('tokens_per_s', float('nan')):.1f}", ratio_cell(r),
            f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f}", f"{s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f}",
            f"{s['tokens_per_msg']:.2f}", f"{100 * s['hit_rate']:.0f} %", f"{s.get('router_cpu_us_per_token', float('nan')):.0f}",
            str(s["requests"]) + (f" ({s['failed']} failed)" if s["failed"] else ""),
        ]) + " |")
    h = headline(res)
    lines.append(f"\nfirst request after SERVING: TTFT {h['first_ttft_ms']:.0f} ms; steady state (p50, c=1, k=0) "
                 f"{h['steady_ttft_ms']:.0f} ms; ratio {h['first_over_steady']:.2f}")
    if "bound_tokens_per_s" in h:
        lines.append(f"batch-1 bound {h['bound_tokens_per_s']:.0f} tok/s ({res['model']['weight_bytes'] / 1e9:.2f} GB "
                     f"of weights at {res['copy_GBps']:.0f} GB/s copy); engine-alone plain decode batch 1 "
                     f"{h['alone_decode_b1_tokens_per_s']:.0f} tok/s = {100 * h['alone_decode_b1_of_bound']:.1f} % of it")
    for key, v in h.items():
        if key.startswith("served_c1_k"):
            lines.append(f"{key}: {v:.2f}x")
    for r in combine(res):
        if "busy" in r["alone"]:
            s, busy = r["served"], r["alone"]["busy"]
            name = f"c {s['concurrency']} k {s['k']}" + ("" if s["a"] is None else f" a {s['a']}")
            lines.append(f"{name}: alone beside busy processes "
                         f"{busy['tokens_per_s']:.1f} tok/s, served ÷ that {s['tokens_per_s'] / busy['tokens_per_s']:.2f}")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    """Tokens/s served (bars) and engine alone (markers), TTFT and ITL, per concurrency and k/a."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = combine(res)
    concs = sorted({r["served"]["concurrency"] for r in rows})
    combos = sorted({(r["served"]["k"], r["served"]["a"]) for r in rows}, key=lambda c: (c[0], c[1] or 0))

    def series(get):
        out = []
        for k, a in combos:
            by_c = {r["served"]["concurrency"]: r for r in rows if (r["served"]["k"], r["served"]["a"]) == (k, a)}
            out.append((f"k={k}" + (f" a={a}" if a is not None else ""),
                        [get(by_c[c]) if c in by_c else float("nan") for c in concs]))
        return out

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    groups = [f"c={c}" for c in concs]
    ax = axes[0]
    centres = grouped_bars(ax, groups, series(lambda r: r["served"]["tokens_per_s"]))
    for xs, (_, vals) in zip(centres, series(lambda r: r["alone"].get("tokens_per_s", float("nan")))):
        ax.plot(xs, vals, "k_", markersize=14, markeredgewidth=2)
    ax.plot([], [], "k_", markersize=14, markeredgewidth=2, label="engine alone")
    ax.set_yscale("log")
    ax.set_ylabel("output tokens/s (log)")
    ax.set_title("served (bars) vs engine alone (—)")
    ax.legend(fontsize=7)
    for ax, key, title in ((axes[1], "ttft", "TTFT, client side"), (axes[2], "itl", "inter-token latency")):
        centres = grouped_bars(ax, groups, series(lambda r, key=key: r["served"][f"{key}_p50_ms"]))
        for xs, (_, vals) in zip(centres, series(lambda r, key=key: r["served"][f"{key}_p99_ms"])):
            ax.plot(xs, vals, "rv", markersize=5)
        ax.plot([], [], "rv", label="p99")
        ax.set_yscale("log")
        ax.set_ylabel("ms (log); bars p50")
        ax.set_title(title)
        ax.legend(fontsize=7)
    m = res["model"]
    size = f"{m['params'] / 1e9:.2f}B" if m["params"] >= 1e8 else f"{m['params'] / 1e6:.1f}M"
    fig.suptitle(f"{m['shape']} ({size} params, {res['args']['device']}), prompt {res['args']['prompt_len']} "
                 f"(half shared), {res['args']['max_new_tokens']} new tokens; {res['meta']['date']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def wall_split(stats: dict) -> dict[str, float]:
    """A level's wall in seconds: in decode steps, in steps with prompts, working between steps,
    waiting (the engine alone's loop counts its own work outside steps as "between")."""
    wall = stats["tokens"] / stats["tokens_per_s"]
    prefill = stats["prefill_steps"] * stats["prefill_step_ms_mean"] / 1e3
    decode = (stats["steps"] - stats["prefill_steps"]) * stats["decode_step_ms_mean"] / 1e3
    between = stats.get("between_share", 1.0 - stats["in_step_share"]) * wall
    return {"decode steps": decode, "steps with prompts": prefill, "between steps": between,
            "waiting": max(0.0, wall - decode - prefill - between)}


def plot_steps(runs: list[tuple[str, dict]], path: Path, concurrency: int = 64) -> None:
    """``--compare-steps``: where each run's level of ``concurrency`` spent its wall, served and
    alone side by side (stacked seconds), and the decode step's mean time of each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []  # (label, served split, alone split, served decode ms, alone decode ms)
    for name, res in runs:
        for r in combine(res):
            s, e = r["served"], r["alone"]
            if s["concurrency"] != concurrency or "prefill_steps" not in s or "prefill_steps" not in e:
                continue
            label = f"{name}\nk={s['k']}" + ("" if s["a"] is None else f" a={s['a']}")
            bars.append((label, wall_split(s), wall_split(e), s["decode_step_ms_mean"], e["decode_step_ms_mean"]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(bars) + 4), 4.8), gridspec_kw={"width_ratios": [3, 2]})
    colors = {"decode steps": "tab:blue", "steps with prompts": "tab:orange", "between steps": "tab:red", "waiting": "tab:gray"}
    for i, (_, served, alone, _, _) in enumerate(bars):
        for x, split, hatch in ((i - 0.2, served, ""), (i + 0.2, alone, "//")):
            bottom = 0.0
            for part, secs in split.items():
                ax.bar(x, secs, 0.38, bottom=bottom, color=colors[part], hatch=hatch, edgecolor="white",
                       label=part if i == 0 and not hatch else None)
                bottom += secs
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.set_ylabel("seconds of the level's wall")
    ax.set_title(f"c {concurrency}: served (left, plain) vs engine alone (right, hatched)")
    ax.legend(fontsize=7)
    xs = np.arange(len(bars))
    ax2.bar(xs - 0.2, [b[3] for b in bars], 0.38, label="served")
    ax2.bar(xs + 0.2, [b[4] for b in bars], 0.38, label="alone", hatch="//")
    ax2.set_xticks(xs, [b[0] for b in bars], fontsize=7)
    ax2.set_ylabel("ms")
    ax2.set_title("mean decode step (host-bound)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def meta(args) -> dict:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    import torch

    info = {**machine(), "command": " ".join([sys.executable, *sys.argv]), "git_commit": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain")), "torch": torch.__version__,
            "transformers": version("transformers"), "flashinfer": version("flashinfer-python")}
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return info


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="cuda:0", help="cuda:N (flashinfer, bf16) or cpu (torch backend, float32)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated levels")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step of the speculative levels (0 = k = 0 levels only)")
    p.add_argument("--accept", default="0,1,2,3", help="forced acceptance values (one suite each)")
    p.add_argument("--rounds", type=int, default=2, help="requests per level = max(rounds x concurrency, min-requests)")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--level-max-s", type=float, default=6.0,
                   help="no new requests of a level after this (the engine alone then runs as many as were served)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="a random EAGLE-3 head with this many LM-head rows (public layout, loaded with "
                        "--draft-model); 0 = the seeded random draft over the whole vocabulary")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="worker setting cuda_graphs (default: the worker's)")
    p.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=None,
                   help="worker setting overlap_steps (default: the worker's)")
    p.add_argument("--fused-spec-steps", action=argparse.BooleanOptionalAction, default=None,
                   help="worker setting fused_spec_steps (default: the worker's)")
    p.add_argument("--fused-spec-graphs", choices=("one", "split"),
                   help="worker setting fused_spec_graphs (default: the worker's)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="worker setting engine_process (default: the worker's: own process on CUDA)")
    p.add_argument("--kvstore-carrier", choices=("process", "thread"),
                   help="worker setting kvstore_carrier (default: the worker's: a process beside an engine process)")
    p.add_argument("--max-batch-tokens", type=int, help="worker setting (default: the worker's)")
    p.add_argument("--chunk-size", type=int, help="worker setting (default: the worker's)")
    p.add_argument("--prefill-wait-steps", type=int,
                   help="worker setting: hold new prompts up to this many steps to prefill several at once (default: off)")
    p.add_argument("--prefill-batch", type=int, help="worker setting: release held prompts once this many wait")
    p.add_argument("--gil-switch-interval-ms", type=float, help="worker setting (default: Python's)")
    p.add_argument("--stream-interval", type=int,
                   help="worker setting: tokens a streamed message waits for after the first (served only; default 1)")
    p.add_argument("--router-window-bytes", type=int,
                   help="router setting worker_stream_window_bytes (default: the router's; 0 = gRPC's auto-tuned window)")
    p.add_argument("--client-window-bytes", type=int, default=DEFAULT_STREAM_WINDOW_BYTES,
                   help="each served client stream's unread bytes gRPC buffers (default: Tandem's client's, "
                        f"{DEFAULT_STREAM_WINDOW_BYTES}; 0 = gRPC's auto-tuned window)")
    p.add_argument("--router-procs", type=int, default=1,
                   help="router processes on the router's port (tandem router --procs; the engine alone is unaffected)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="processes the served clients run in (warm-ups and measured levels; the first request "
                        "after SERVING stays in this one): more than 1 keeps the load generator from being the limit")
    p.add_argument("--client-channels", type=int, default=0,
                   help="connections the served clients spread over, client j on channel j mod N (0 = 1 with one "
                        "router process, else one per client of the largest level)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0, help="load + warm-up before SERVING")
    p.add_argument("--model-dir", type=Path, help="where to save the model (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: c 1,4; a 0,3; prompt 64; 16 new tokens")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="run each level's engine-alone twin right after it, in this process beside the idle suite "
                        "(default); --no-interleave: every served level first, then every alone level (before session 39)")
    p.add_argument("--alone-busy-procs", type=int, default=0,
                   help="run each engine-alone level again beside this many busy processes (the host load of a served run)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every level (served, then alone with --interleave) this many times over; the ratio "
                        "reported is the median pair's")
    p.add_argument("--path-trace", action="store_true",
                   help="the suite stamps each request's way to its first token (TANDEM_PATH_TRACE); each level "
                        "reports the median of every hop")
    p.add_argument("--pin-engine", type=int, default=0, metavar="N",
                   help="pin the worker's engine process to N CPUs of its own and every other process off them "
                        "and their SMT siblings (0 = off)")
    p.add_argument("--profile", help="levels to profile with py-spy, served and alone, e.g. 'c64 k0,c64 k3 a3' (files beside --json)")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--plot", type=Path, help="write the PNG here")
    p.add_argument("--compare-steps", nargs="+", metavar="JSON",
                   help="no run: where the c 64 levels of earlier --json files spent their wall, served vs alone (with --plot)")
    p.add_argument("--from-json", type=Path, help="no run: table and --plot from an earlier --json")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.accept, args.prompt_len, args.max_new_tokens = "1,4", "0,3", 64, 16
        args.rounds, args.min_requests = 2, 4
    args.concurrency = [int(x) for x in str(args.concurrency).split(",")]
    args.accept = [int(x) for x in str(args.accept).split(",")]
    if args.k == 0:
        args.accept = [0]  # one suite: its k = 0 levels
    if args.k < 0 or any(not 0 <= a <= args.k for a in args.accept):
        p.error("--k must be >= 0 and forced acceptance values in [0, k]")
    if (args.router_procs < 1 or args.client_channels < 0 or args.client_procs < 1 or args.client_window_bytes < 0
            or (args.router_window_bytes or 0) < 0):
        p.error("--router-procs and --client-procs must be >= 1; --client-channels and the window sizes >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare_steps:
        stems = [Path(f).stem for f in args.compare_steps]
        common = os.path.commonprefix(stems) if len(stems) > 1 else ""
        runs = [(stem[len(common):] or stem, json.loads(Path(f).read_text())) for stem, f in zip(stems, args.compare_steps)]
        for name, res in runs:
            for r in combine(res):
                if "prefill_steps" in r["served"] and "prefill_steps" in r["alone"]:
                    sv, al = wall_split(r["served"]), wall_split(r["alone"])
                    print(f"{name} c{r['served']['concurrency']} k{r['served']['k']}: served "
                          + ", ".join(f"{k} {v:.2f}" for k, v in sv.items()) + " s; alone "
                          + ", ".join(f"{k} {v:.2f}" for k, v in al.items()) + " s"
                          + gaps_line(r["served"], "served") + gaps_line(r["alone"], "alone"))
        if args.plot:
            plot_steps(runs, args.plot)
        return 0
    if args.from_json:
        res = json.loads(args.from_json.read_text())
        print(table(res))
        if args.plot:
            plot(res, args.plot)
        return 0

    t_start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", flush=True)

    if args.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(args.device)  # the model build and the copy timing use the current device
        if not os.environ.get("FLASHINFER_WORKSPACE_BASE"):
            log("FLASHINFER_WORKSPACE_BASE is unset: kernels compiled now (1-2.5 min) are not kept for the next run")
    res: dict = {"meta": meta(args), "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    log(f"{json.dumps(res['meta'])}")
    with tempfile.TemporaryDirectory(prefix="tandem_serve_") as tmp:
        model_dir = args.model_dir or Path(tmp) / "model"
        model_dir.mkdir(parents=True, exist_ok=True)
        log(f"building a random {args.shape} Llama with transformers into {model_dir} ...")
        res["model"] = build_model(args.shape, model_dir, args.device, args.seed)
        if args.draft_vocab:
            res["model"]["draft"] = write_reduced_draft(args.shape, model_dir / "eagle3", args.draft_vocab,
                                                        args.device, args.seed)
        log(f"model: {res['model']['params'] / 1e6:.1f}M params, {res['model']['weight_bytes'] / 1e6:.1f} MB, "
            f"built and saved in {res['model']['build_s']:.1f} s")
        if args.device.startswith("cuda"):
            res["copy_GBps"] = copy_bandwidth_GBps()
            log(f"device copy: {res['copy_GBps']:.0f} GB/s")
        prompts = Prompts(args.seed, args.prompt_len, SHAPES[args.shape].vocab_size)
        log_root = Path(tmp) / "logs"
        log_root.mkdir()
        if args.interleave:
            res["engine_alone"] = []
            res["served"] = run_served(args, model_dir, prompts, log_root, log, res["engine_alone"])
        else:
            res["served"] = run_served(args, model_dir, prompts, log_root, log)
            res["engine_alone"] = run_engine_alone(args, model_dir, prompts, res["served"], log)
    res["headline"] = headline(res)
    res["total_s"] = time.monotonic() - t_start
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print("\n" + table(res))
    if args.plot:
        plot(res, args.plot)
        print(f"plot: {args.plot}")
    log("done")
    failed = sum(r["failed"] for s in res["served"] for r in s["levels"]) + sum(r["failed"] for r in res["engine_alone"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
