"""Garbage-collector pauses in the served suite: CPython's defaults against ``gc_freeze`` (on by
default since session 28; ``services/common/gc_tuning.py``).

Per mode, kvstore + worker + router run as processes (``bench/_common.start_suite``, a random
Llama of ``--shape``), ``--concurrency`` clients stream ``Router.Generate`` (``--prompt-len``
random tokens, ``--max-new-tokens``, greedy, a new request as soon as one ends) for ``--seconds``:

    default   TANDEM_<SERVICE>_GC_FREEZE=false: CPython's collector as the process starts it
    frozen    the default now: each process freezes its start-up heap once it is ready

Every process logs each collection that stalls it 1 ms or more (``TANDEM_<SERVICE>_GC_WARN_MS=1``);
the script reads those lines back. Reported per mode: tokens/s, the clients' inter-token gaps
(p50 / p99 / max), and per process the collections of 5 ms or more, their total and the longest.
A full collection traverses every tracked object, so before the freeze it costs in proportion to
the start-up heap (~380,000 objects in a worker: torch, the model, gRPC, protobuf), and the step
loop or the event loop stands still meanwhile: every stream of that process waits.

    python bench/gc_bench.py --out docs/gc_bench.json --png docs/img/gc_bench.png      # CPU, ~3 min
    python bench/gc_bench.py --from-json docs/gc_bench.json --png docs/img/gc_bench.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import GC_VISIBLE_MS, gc_pauses_in, grouped_bars, machine, start_suite  # noqa: E402

MODES = {"default": "false", "frozen": "true"}
SERVICES = ("KVSTORE", "WORKER", "ROUTER")


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def drive(router: str, args) -> dict:
    """``args.concurrency`` closed-loop clients for ``args.seconds``: tokens and inter-token gaps."""
    import grpc

    from services.common.wire import tokens_to_proto
    from tandem.router.v1 import router_pb2, router_pb2_grpc

    rng = random.Random(0)
    gaps: list[float] = []
    counts = {"tokens": 0, "requests": 0}
    end = time.monotonic() + args.seconds
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def client() -> None:
            while time.monotonic() < end:
                prompt = [rng.randrange(args.vocab) for _ in range(args.prompt_len)]
                request = router_pb2.GenerateRequest(token_ids=tokens_to_proto(prompt), max_new_tokens=args.max_new_tokens,
                                                     temperature=0.0)
                last = None
                async for msg in stub.Generate(request, timeout=300):
                    if msg.token_ids:
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        counts["tokens"] += len(msg.token_ids)
                counts["requests"] += 1

        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - started
    return {"tokens_per_s": counts["tokens"] / elapsed, "requests": counts["requests"],
            "gap_ms": {"p50": percentile(gaps, 0.5) * 1e3, "p99": percentile(gaps, 0.99) * 1e3,
                       "p999": percentile(gaps, 0.999) * 1e3, "max": max(gaps) * 1e3 if gaps else float("nan")}}


def run_mode(mode: str, args, model_dir: Path, log_root: Path) -> dict:
    log_dir = log_root / mode
    log_dir.mkdir()
    # every collection of 1 ms or more logged; INFO: the freeze's own line counts each start-up heap
    env = {f"TANDEM_{s}_GC_{x}": v for s in SERVICES for x, v in (("FREEZE", MODES[mode]), ("WARN_MS", "1"))}
    worker = ["--model", str(model_dir), "--device", args.device, "--num-blocks", str(args.num_blocks), "--spec-mode", "none"]
    suite = start_suite(log_dir, [worker], ["--model", str(model_dir)], timeout_s=args.startup_timeout_s,
                        env=env, log_level="INFO")
    try:
        row = asyncio.run(drive(suite.router, args))
    finally:
        suite.stop()
    row["mode"] = mode
    row["pauses"], row["frozen_objects"] = gc_pauses_in(log_dir)
    return row


def plot(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["modes"]
    several = res["args"].get("rounds", 1) > 1

    def label(r: dict) -> str:
        return f"{r['mode']} #{r['round']}" if several else r["mode"]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    qs = ("p50", "p99", "p999", "max")
    grouped_bars(ax1, list(qs), [(label(r), [r["gap_ms"][q] for q in qs]) for r in rows])
    ax1.set_yscale("log")
    ax1.set_ylabel("ms between a stream's messages (log)")
    a = res["args"]
    ax1.set_title(f"inter-token gaps: {a['concurrency']} streams, {a['shape']} on {a['device']}, {a['seconds']:.0f} s")
    ax1.legend()
    procs = sorted({p for r in rows for p in r["pauses"]})
    grouped_bars(ax2, procs, [(label(r), [r["pauses"].get(p, {}).get("longest_ms", 0) for p in procs]) for r in rows])
    for i, r in enumerate(rows):
        n = sum(p["visible"] for p in r["pauses"].values())
        total = sum(p["visible_ms"] for p in r["pauses"].values())
        ax2.text(0.02, 0.95 - 0.07 * i, f"{label(r)}: {n} collections of {GC_VISIBLE_MS} ms or more, {total} ms in all",
                 transform=ax2.transAxes, fontsize=8, va="top")
    ax2.set_ylabel("longest collection, ms")
    ax2.set_title("garbage-collector pauses per process")
    ax2.legend(loc="center right")
    fig.suptitle(f"{res['machine'].get('cpu', '')} ({res['machine'].get('nproc')} cores) — {res['machine'].get('date', '')}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny-cpu")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=60.0, help="load per mode")
    ap.add_argument("--rounds", type=int, default=1, help="modes run alternately this many times")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--startup-timeout-s", type=float, default=180.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--from-json", type=Path)
    args = ap.parse_args()
    if args.from_json:
        res = json.loads(args.from_json.read_text())
    else:
        from serve_bench import SHAPES, build_model

        args.vocab = SHAPES[args.shape].vocab_size
        rows = []
        with tempfile.TemporaryDirectory(prefix="tandem_gc_") as tmp:
            model_dir = Path(tmp) / "model"
            model_dir.mkdir()
            build_model(args.shape, model_dir, args.device, 0)
            for r in range(args.rounds):
                for mode in args.modes.split(","):
                    print(f"-- {mode} (round {r + 1}): suite up, {args.concurrency} streams for {args.seconds:.0f} s ...", flush=True)
                    log_root = Path(tmp) / f"logs{r}"
                    log_root.mkdir(exist_ok=True)
                    row = run_mode(mode, args, model_dir, log_root)
                    row["round"] = r + 1
                    rows.append(row)
                    g = row["gap_ms"]
                    print(f"   {row['tokens_per_s']:.0f} tok/s, {row['requests']} requests; gaps p50 {g['p50']:.1f} / p99 "
                          f"{g['p99']:.1f} / p99.9 {g['p999']:.1f} / max {g['max']:.1f} ms", flush=True)
                    if row["frozen_objects"]:
                        print(f"   start-up heaps frozen: {row['frozen_objects']}", flush=True)
                    for who, p in sorted(row["pauses"].items()):
                        print(f"   {who}: {p['visible']} collections >= {GC_VISIBLE_MS} ms ({p['visible_ms']} ms), "
                              f"longest {p['longest_ms']} ms; >= 1 ms by generation {p['by_generation']}", flush=True)
        res = {"machine": machine(), "command": " ".join(["python", "bench/gc_bench.py", *sys.argv[1:]]),
               "args": {k: v for k, v in vars(args).items() if k in ("device", "shape", "concurrency", "prompt_len",
                                                                    "max_new_tokens", "seconds", "rounds")},
               "modes": rows}
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))
    if args.png:
        plot(res, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
