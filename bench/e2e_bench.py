"""End-to-end benchmark (issue 4): a shared-prefix, multi-turn chat workload through the router,
kv-aware routing against a round-robin baseline, in one run, on the same workload and seed.

Workload: ``--systems`` system prompts (400–600 bytes; the tiny model's byte tokenizer makes one
token per byte), ``--users`` users, each bound to one system prompt and holding a ``--turns``-turn
conversation. Turn t+1's prompt is turn t's prompt + turn t's answer (the exact token ids the model
generated) + a new question, so every prompt extends the previous one of its user::

    turn 0   |BOS| system s(u) |User: q0 Assistant:|
    turn 1   |BOS| system s(u) |User: q0 Assistant:| a0 |User: q1 Assistant:|
    turn 2   |BOS| system s(u) |User: q0 Assistant:| a0 |User: q1 Assistant:| a1 |User: q2 ...|
             '-- shared by every user of s(u) --'  '----- private to user u, grows per turn -----'

Decoding is greedy, so the answers, and with them every prompt, are the same tokens under both
policies. ``--clients`` closed-loop clients pull (user, turn) items from one FIFO queue; a finished
turn puts the user's next turn at the back, so other users' requests come between two turns of
one user (as in a real chat service), and the queue starts in a seeded random order.

Per policy, a fresh suite is started as separate processes, as ``tandem up --workers 2`` does:
kvstore (memory backend), ``--workers`` gpuworkers (tiny model or ``--model`` folder, torch backend,
CPU, EAGLE-3, one torch thread each so each worker owns a core) and the router with
``--policy kv_aware|round_robin``. Measured from the client side: requests/s, output tokens/s,
TTFT (time to the first streamed token) and end-to-end latency p50/p99, cache hit rate
(usage.cached_tokens / usage.prompt_tokens) and the kvstore's Stats (reused / requested positions,
evictions), mean acceptance length (generated tokens per target forward, weighted by tokens), the
request split over workers; at the end the kvstore's invariant audit must pass. Each policy runs
``--repeats`` times in ABBA order (kv, rr, rr, kv), so drifting load from other processes hits both
alike; rates are the median over runs, distributions pool all runs. The CPU seconds each worker
process burned (``/proc``) per request is the figure that other load on the machine barely moves;
"worker CPU share" (CPU / wall per worker) shows how much of its core each worker actually got.

    python bench/e2e_bench.py                                     # both policies, ~5 min on 2 cores
    python bench/e2e_bench.py --quick                             # smoke run (~1 min)
    python bench/e2e_bench.py --distill --json e2e.json --plot docs/img/e2e_bench.png

``--distill`` first trains the tiny model's EAGLE-3 draft (``tandem distill-draft tiny``, a few
minutes on 2 busy cores; kept in ``--distill-dir``, by default where ``tandem up`` looks for it)
so the acceptance length is a trained one; without it the tiny model's draft is random and
accepts almost nothing (acceptance ≈ 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import Suite, machine  # noqa: E402
from _common import start_suite as start_suite_processes  # noqa: E402
from services.common.paths import distilled_tiny_dir  # noqa: E402
from services.common.tokenizer import TINY_BOS_ID, TINY_EOS_ID  # noqa: E402

POLICIES = ("kv_aware", "round_robin")
WORDS = (
    "the a model cache request token block worker router prefix answer question user system "
    "careful short precise friendly helpful expert assistant always never explain context reply "
    "memory latency throughput policy reuse draft target verify accept reject page pool store "
    "trie key hash tenant salt stream deadline retry queue batch prefill decode step speculative "
    "travel cooking history physics garden music weather finance health sports law poetry code"
).split()


# ------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Conversation:
    """One user's chat: its system prompt and the questions of its turns (bytes)."""

    user: int
    system: int
    questions: tuple[bytes, ...]


def _sentence_bytes(rng: random.Random, lo: int, hi: int) -> bytes:
    """Pseudo-English text of lo..hi bytes (seeded)."""
    target = rng.randint(lo, hi)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < target:
        words.append(rng.choice(WORDS))
    return " ".join(words).encode()[:target]


def build_workload(seed: int, systems: int, users: int, turns: int) -> tuple[list[bytes], list[Conversation]]:
    """System prompts (400–600 bytes) and conversations (questions 40–120 bytes). Pure (seeded)."""
    rng = random.Random(seed)
    prompts = [f"System prompt {i}: ".encode() + _sentence_bytes(rng, 380, 580) for i in range(systems)]
    convs = [
        Conversation(u, rng.randrange(systems), tuple(_sentence_bytes(rng, 40, 120) for _ in range(turns)))
        for u in range(users)
    ]
    return prompts, convs


def turn_suffix(question: bytes) -> list[int]:
    return list(b"\nUser: " + question + b"\nAssistant:")


# ------------------------------------------------------------------------------------ processes
def start_suite(policy: str, args, model: str, log_dir: Path) -> Suite:
    """kvstore + workers + router as processes, each SERVING (health) before this returns."""
    worker = ["--model", model, "--spec-mode", "eagle3", "--num-blocks", str(args.num_blocks),
              "--max-batch-tokens", str(args.max_batch_tokens)]
    router = ["--model", model, "--policy", policy, "--policy-seed", str(args.seed), "--num-draft-tokens", str(args.k)]
    # one torch thread per worker: each worker owns a core, as a GPU worker owns its GPU
    one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return start_suite_processes(log_dir, [worker] * args.workers, router, worker_env=one_thread)


# --------------------------------------------------------------------------------------- client
@dataclass
class Record:
    """One finished request, as the client saw it."""

    user: int
    turn: int
    start_s: float  # since the phase began
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    acceptance: float
    worker: str
    answer_crc: int  # crc32 of the generated token ids: greedy answers must match across policies


async def run_phase(policy: str, args, router: str, system_prompts, convs) -> tuple[list[Record], float, int]:
    """Drive the closed loop through ``router``; returns (records, wall seconds, failures)."""
    import grpc

    from services.common.wire import tokens_to_proto
    from tandem.router.v1 import router_pb2, router_pb2_grpc

    channel = grpc.aio.insecure_channel(router)
    stub = router_pb2_grpc.RouterStub(channel)
    order = list(range(len(convs)))
    random.Random(args.seed).shuffle(order)
    queue: asyncio.Queue = asyncio.Queue()
    for u in order:
        queue.put_nowait((u, 0))
    history: dict[int, list[int]] = {}  # user -> prompt + answer so far (token ids)
    total = len(convs) * args.turns
    records: list[Record] = []
    failures = skipped = 0  # skipped: later turns of a user whose turn failed
    t0 = time.monotonic()
    stop_at = t0 + args.max_seconds

    async def one(u: int, turn: int) -> None:
        nonlocal failures, skipped
        conv = convs[u]
        base = history.get(u) or [TINY_BOS_ID, *system_prompts[conv.system]]
        prompt = base + turn_suffix(conv.questions[turn])
        request = router_pb2.GenerateRequest(
            token_ids=tokens_to_proto(prompt),
            max_new_tokens=args.max_new_tokens, num_draft_tokens=args.k, request_id=f"{policy}-u{u}-t{turn}",
            temperature=0.0,
        )
        start = time.monotonic()
        first = None
        answer: list[int] = []
        usage = None
        try:
            async for msg in stub.Generate(request, timeout=120):
                if msg.token_ids and first is None:
                    first = time.monotonic()
                answer.extend(msg.token_ids)
                if msg.HasField("usage"):
                    usage = msg.usage
            if usage is None:
                raise RuntimeError("the stream ended without usage")
        except (grpc.aio.AioRpcError, RuntimeError) as err:
            failures += 1
            skipped += args.turns - turn - 1
            why = f"{err.code().name} {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else str(err)
            print(f"  {policy}: request u{u} t{turn} failed: {why}", flush=True)
            return
        end = time.monotonic()
        if answer and answer[-1] == TINY_EOS_ID:
            answer.pop()  # the stop token is never fed back to the model
        history[u] = prompt + answer
        records.append(Record(u, turn, start - t0, (first or end) - start, end - start, usage.prompt_tokens,
                              usage.cached_tokens, usage.completion_tokens, usage.mean_acceptance_length,
                              usage.worker_id, zlib.crc32(np.asarray(answer, dtype=np.uint32).tobytes())))
        if turn + 1 < args.turns:
            queue.put_nowait((u, turn + 1))

    async def client() -> None:
        while time.monotonic() < stop_at:
            try:
                u, turn = queue.get_nowait()
            except asyncio.QueueEmpty:
                if len(records) + failures + skipped >= total:
                    return
                await asyncio.sleep(0.01)  # another client's turn will enqueue the next one
                continue
            await one(u, turn)

    async def progress() -> None:
        while True:
            await asyncio.sleep(args.progress_s)
            el = time.monotonic() - t0
            print(f"  {policy}: {len(records)}/{total} requests in {el:5.1f} s "
                  f"({len(records) / el:.2f} req/s)", flush=True)

    reporter = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(client() for _ in range(args.clients)))
    finally:
        reporter.cancel()
        await channel.close()
    if len(records) + failures + skipped < total:
        print(f"  {policy}: stopped at --max-seconds with {len(records)} of {total} requests done", flush=True)
    return records, time.monotonic() - t0, failures


def kvstore_stats(address: str) -> dict:
    """Summed Stats counters and the invariant audit of the kvstore at ``address``."""
    import grpc

    from tandem.kvstore.v1 import kvstore_pb2 as kv_pb
    from tandem.kvstore.v1 import kvstore_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        stats = stub.Stats(kv_pb.StatsRequest(), timeout=10)
        audit = stub.CheckInvariants(kv_pb.CheckInvariantsRequest(), timeout=30)
    return {
        "requested_positions": sum(w.requested_positions for w in stats.workers),
        "reused_positions": sum(w.reused_positions for w in stats.workers),
        "evictions": sum(w.evictions for w in stats.workers),
        "published_blocks": sum(w.published_blocks for w in stats.workers),
        "invariants_ok": audit.ok,
        "violations": list(audit.violations)[:5],
    }


# -------------------------------------------------------------------------------------- summary
@dataclass
class Phase:
    """One policy's run on a fresh suite: what the client saw and what the kvstore counted."""

    policy: str
    repeat: int
    records: list[Record]
    wall_s: float
    failures: int
    kv: dict  # summed kvstore Stats counters + invariant audit
    cpu_s: dict[str, float]  # CPU seconds per process during the phase
    load_1m: float  # machine load average when the phase started (other users of the machine)


def summarize(policy: str, phases: list[Phase]) -> dict:
    """Figures of one policy over its phases (pure): rates are the median over phases (each phase
    is one whole workload), distributions and ratios pool every request of every phase."""
    records = [r for ph in phases for r in ph.records]
    ttft = np.array([r.ttft_s for r in records]) * 1e3
    lat = np.array([r.latency_s for r in records]) * 1e3
    out_tokens = sum(r.completion_tokens for r in records)
    # tokens per target forward over every decode step: Σ tokens / Σ (tokens / acceptance)
    steps = sum(r.completion_tokens / r.acceptance for r in records if r.acceptance > 0)
    prompt = sum(r.prompt_tokens for r in records)
    kv = {key: sum(ph.kv[key] for ph in phases) for key in ("requested_positions", "reused_positions", "evictions")}
    worker_cpu = sum(v for ph in phases for k, v in ph.cpu_s.items() if k.startswith("worker"))
    n_workers = max(1, len([k for k in phases[0].cpu_s if k.startswith("worker")]))
    by_turn = {}
    for t in sorted({r.turn for r in records}):
        rs = [r for r in records if r.turn == t]
        by_turn[str(t)] = {  # str keys: the same in memory and in the JSON file
            "requests": len(rs),
            "ttft_p50_ms": float(np.percentile([r.ttft_s * 1e3 for r in rs], 50)),
            "hit_rate": sum(r.cached_tokens for r in rs) / max(1, sum(r.prompt_tokens for r in rs)),
        }
    return {
        "policy": policy,
        "phases": len(phases),
        "requests_per_phase": len(records) / len(phases),
        "failures": sum(ph.failures for ph in phases),
        "wall_s": [round(ph.wall_s, 2) for ph in phases],
        "load_1m": [round(ph.load_1m, 2) for ph in phases],
        "requests_per_s": float(np.median([len(ph.records) / ph.wall_s for ph in phases])),
        "output_tokens_per_s": float(np.median([sum(r.completion_tokens for r in ph.records) / ph.wall_s
                                                for ph in phases])),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "latency_p50_ms": float(np.percentile(lat, 50)),
        "latency_p99_ms": float(np.percentile(lat, 99)),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in records),
        "hit_rate": sum(r.cached_tokens for r in records) / max(1, prompt),
        "kv_hit_rate": kv["reused_positions"] / max(1, kv["requested_positions"]),
        "evictions_per_phase": kv["evictions"] / len(phases),
        "acceptance": out_tokens / steps if steps else float("nan"),
        # CPU the workers burned per request: robust to other load on the machine, unlike rates
        "worker_cpu_ms_per_request": 1e3 * worker_cpu / max(1, len(records)),
        # share of their cores the workers got: well below 1 = starved by other processes
        "worker_cpu_share": worker_cpu / max(1e-9, n_workers * sum(ph.wall_s for ph in phases)),
        "workers": dict(sorted(Counter(r.worker for r in records).items())),
        "by_turn": by_turn,
        "invariants_ok": all(ph.kv["invariants_ok"] for ph in phases),
        "per_phase": [{"repeat": ph.repeat, "wall_s": ph.wall_s, "requests": len(ph.records),
                       "load_1m": ph.load_1m, "cpu_s": ph.cpu_s, "kvstore": ph.kv} for ph in phases],
    }


def identical_answers(records: dict[str, list[Record]]) -> float | None:
    """Fraction of (user, turn) pairs whose answer is the same under every policy and repeat
    (None with a single run). Below 1 only if batching changed a float32 argmax somewhere."""
    answers: dict[tuple[int, int], list[int]] = {}
    for recs in records.values():
        for r in recs:
            answers.setdefault((r.user, r.turn), []).append(r.answer_crc)
    seen_twice = [v for v in answers.values() if len(v) > 1]
    if not seen_twice:
        return None
    return sum(len(set(v)) == 1 for v in seen_twice) / len(seen_twice)


def markdown_table(results: list[dict]) -> str:
    cols = [
        ("policy", lambda r: r["policy"]),
        ("requests", lambda r: f"{r['phases']} × {r['requests_per_phase']:.0f}" + (f" ({r['failures']} failed)" if r["failures"] else "")),
        ("req/s", lambda r: f"{r['requests_per_s']:.2f}"),
        ("out tok/s", lambda r: f"{r['output_tokens_per_s']:.1f}"),
        ("TTFT p50 / p99 (ms)", lambda r: f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}"),
        ("latency p50 / p99 (ms)", lambda r: f"{r['latency_p50_ms']:.0f} / {r['latency_p99_ms']:.0f}"),
        ("hit rate (usage)", lambda r: f"{100 * r['hit_rate']:.1f} %"),
        ("hit rate (kvstore)", lambda r: f"{100 * r['kv_hit_rate']:.1f} %"),
        ("evictions / run", lambda r: f"{r['evictions_per_phase']:.0f}"),
        ("acceptance", lambda r: f"{r['acceptance']:.2f}"),
        ("worker CPU ms / req", lambda r: f"{r['worker_cpu_ms_per_request']:.0f}"),
        ("worker CPU share", lambda r: f"{100 * r['worker_cpu_share']:.0f} %"),
        ("requests per worker", lambda r: " / ".join(str(v) for v in r["workers"].values())),
    ]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in results]
    return "\n".join(lines)


def plot(results: list[dict], records: dict[str, list[Record]], path: Path, title: str = "") -> None:
    """TTFT distribution (CDF) and hit rate per turn, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        ttft = np.sort([x.ttft_s * 1e3 for x in records[r["policy"]]])
        a.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=f"{r['policy']} (p50 {r['ttft_p50_ms']:.0f} ms)")
    a.set_xscale("log")
    a.set_xlabel("time to first token, client side (ms, log)")
    a.set_ylabel("fraction of requests")
    a.set_title("TTFT distribution")
    a.grid(alpha=0.3)
    a.legend()
    turns = sorted({int(t) for r in results for t in r["by_turn"]})
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        xs = [t + (i - (len(results) - 1) / 2) * width for t in turns]
        b.bar(xs, [100 * r["by_turn"][str(t)]["hit_rate"] for t in turns], width,
              label=f"{r['policy']} (all: {100 * r['hit_rate']:.0f} %)")
    b.set_xticks(turns)
    b.set_xlabel("turn")
    b.set_ylabel("prompt tokens served from cache (%)")
    b.set_title("cache hit rate per turn")
    b.set_ylim(0, 100)
    b.grid(axis="y", alpha=0.3)
    b.legend()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def distilled_model(out_dir: Path, k: int) -> str:
    """The tiny model with a trained EAGLE-3 draft (distilled once, then reused from disk)."""
    if (out_dir / "config.json").exists():
        return str(out_dir)
    print(f"distilling the tiny model's EAGLE-3 draft into {out_dir} (a few minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "services.cli", "distill-draft", "tiny", "--out", str(out_dir), "--k", str(k)],
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, stdout=subprocess.DEVNULL)
    return str(out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, run in this order")
    p.add_argument("--systems", type=int, default=16)
    p.add_argument("--users", type=int, default=96)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--clients", type=int, default=8, help="closed-loop concurrency")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=1024,
                   help="paired KV blocks per worker, 16 positions each (default: tandem up's)")
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--max-seconds", type=float, default=170.0, help="stop issuing requests after this, per policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny", help="model folder or 'tiny'")
    p.add_argument("--distill", action="store_true", help="use the tiny model with a distilled draft")
    p.add_argument("--distill-dir", type=Path, default=distilled_tiny_dir("eagle3"),
                   help="where the distilled tiny model is (made there when missing; default: where tandem up looks)")
    p.add_argument("--repeats", type=int, default=2, help="runs per policy, in ABBA order")
    p.add_argument("--quiet-load", type=float, default=0.0,
                   help="before each run wait (up to --quiet-wait-s) until the 1-min load average is below this")
    p.add_argument("--quiet-wait-s", type=float, default=120.0)
    p.add_argument("--progress-s", type=float, default=10.0)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 systems, 8 users, 2 turns")
    p.add_argument("--json", type=Path, help="write every figure and request here")
    p.add_argument("--plot", type=Path, help="write the PNG here (e.g. docs/img/e2e_bench.png)")
    p.add_argument("--from-json", type=Path, help="no run: table and --plot from an earlier --json")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        records = {k: [Record(**r) for r in v] for k, v in saved["records"].items()}
        print(markdown_table(saved["results"]))
        if args.plot:
            plot(saved["results"], records, args.plot, saved.get("title", ""))
        return 0
    if args.quick:
        args.systems, args.users, args.turns, args.max_seconds, args.repeats = 4, 8, 2, 60.0, 1
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [x for x in policies if x not in POLICIES]
    if bad:
        p.error(f"unknown policies {bad}; choose from {POLICIES}")

    model = distilled_model(args.distill_dir, args.k) if args.distill else args.model
    system_prompts, convs = build_workload(args.seed, args.systems, args.users, args.turns)
    info = machine()
    print(f"machine: {info}")
    print(f"workload: {args.systems} system prompts ({min(map(len, system_prompts))}–"
          f"{max(map(len, system_prompts))} tokens), {args.users} users × {args.turns} turns, "
          f"{args.clients} clients, {args.max_new_tokens} new tokens, k={args.k}, model {model}, "
          f"{args.workers} workers × {args.num_blocks} blocks", flush=True)
    # ABBA order over repeats, so a drift in the machine's other load hits both policies alike
    order = [(rep, pol) for rep in range(args.repeats)
             for pol in (policies if rep % 2 == 0 else list(reversed(policies)))]
    phases: dict[str, list[Phase]] = {pol: [] for pol in policies}
    with tempfile.TemporaryDirectory(prefix="tandem_e2e_") as tmp:
        for rep, policy in order:
            waited = time.monotonic()
            while args.quiet_load and os.getloadavg()[0] > args.quiet_load and time.monotonic() - waited < args.quiet_wait_s:
                time.sleep(5)
            load = os.getloadavg()[0]
            log_dir = Path(tmp) / f"{policy}{rep}"
            log_dir.mkdir()
            print(f"[{policy} #{rep + 1}] starting kvstore, {args.workers} workers, router "
                  f"(1-min load average {load:.2f}) ...", flush=True)
            suite = start_suite(policy, args, model, log_dir)
            try:
                cpu0 = suite.cpu_seconds()
                recs, wall, failures = asyncio.run(run_phase(policy, args, suite.router, system_prompts, convs))
                cpu = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in suite.cpu_seconds().items()}
                kv = kvstore_stats(suite.kvstore)
            finally:
                suite.stop()
            if not recs:
                print(f"[{policy}] no request finished; logs:\n" + "\n".join(
                    (log_dir / f).read_text()[-2000:] for f in sorted(os.listdir(log_dir))), file=sys.stderr)
                return 1
            if not kv["invariants_ok"]:
                print(f"[{policy}] kvstore invariant violations: {kv['violations']}", file=sys.stderr)
            print(f"[{policy} #{rep + 1}] done: {len(recs)} requests in {wall:.1f} s, "
                  f"{len(recs) / wall:.2f} req/s, CPU s {cpu}", flush=True)
            phases[policy].append(Phase(policy, rep, recs, wall, failures, kv, cpu, load))
    results = [summarize(pol, phases[pol]) for pol in policies]
    title = (f"{args.users} users × {args.turns} turns over {args.systems} system prompts, {args.clients} clients, "
             f"{args.workers} workers × {args.num_blocks} blocks, k={args.k}, {info['nproc']} CPU cores")
    records = {pol: [r for ph in phases[pol] for r in ph.records] for pol in policies}
    table = markdown_table(results)
    print("\n" + table)
    same = identical_answers(records)
    if same is not None:
        print(f"\ngreedy answers identical across policies for {100 * same:.1f} % of (user, turn) pairs")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "model": model, "title": title,
            "results": results, "records": {k: [asdict(r) for r in v] for k, v in records.items()},
        }, indent=1))
    if args.plot:
        plot(results, records, args.plot, title)
        print(f"plot: {args.plot}")
    return 0 if all(r["invariants_ok"] and not r["failures"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
