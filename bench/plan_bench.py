"""Attention planning micro-benchmark (CPU): host cost of ``BatchLayout`` and ``plan()``.

A speculative step plans four forwards (verify, draft fill, two draft chain steps) and the GPU
waits for each plan, so the host time measured here sits on the critical path of every step.
Per batch size (default 1, 16, 64), every request holds a 4,096-token context in pages of 16
(256 pages + 1 page of headroom, shuffled block ids), GQA 32/8, head_dim 128:

    layout (lists)    BatchLayout(block_tables=list of lists, cached_lens=[...], query_lens=[...])
    layout (arrays)   the same from a 2-D numpy table and numpy lengths ("n/a" where unsupported)
    plan DECODE       backend.plan(layout, DECODE)        1 query token per request
    plan VERIFY       backend.plan(layout, VERIFY)        4 query tokens per request (k = 3)
    spec step         4 x layout (lists) + 2 x plan DECODE + 2 x plan VERIFY

The backend is a planning-only subclass of ``AttentionBackend`` on the CPU: validation plus the
shared planner plus the staging copies, i.e. what every backend pays before its own planning
(FlashInfer's ``wrapper.plan`` comes on top on the GPU; ``bench/worker_bench.py`` measures it).

Times are thread CPU time per call, best of ``--repeats`` rounds: robust to other processes on a
shared machine (wall time there includes waiting for a core), and what the host spends per plan.

Run:   python bench/plan_bench.py                 # Markdown table
       python bench/plan_bench.py --profile 64    # plus a cProfile of plan(DECODE) at batch 64
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from services.gpuworker.attention.base import (  # noqa: E402
    AttentionBackend,
    AttentionGeometry,
    AttentionKind,
    BatchLayout,
)

BLOCK = 16
GEOM = AttentionGeometry(num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=BLOCK)


class PlanOnlyBackend(AttentionBackend):
    """The shared planning path only (no kernels): what every backend pays per plan."""

    name = "plan-only"

    def _write_kv(self, plan, kv_layer, k, v) -> None:
        raise NotImplementedError("planning benchmark only")

    def _attend(self, plan, q, kv_layer, scale: float):
        raise NotImplementedError("planning benchmark only")


def cpu_us(fn, calls: int, repeats: int) -> float:
    """Best-of-``repeats`` thread CPU microseconds per ``fn()`` call (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t0) / calls * 1e6)
    return best


def tables_for(batch: int, ctx: int, seed: int = 0) -> list[list[int]]:
    """Disjoint shuffled tables with room for ``ctx`` positions plus one headroom page."""
    pages = -(-ctx // BLOCK) + 1
    ids = list(range(batch * pages))
    random.Random(seed).shuffle(ids)
    return [ids[r * pages : (r + 1) * pages] for r in range(batch)]


def measure(batch: int, ctx: int, k: int, repeats: int) -> dict:
    tables = tables_for(batch, ctx)
    q = k + 1
    calls = max(5, 600 // batch)
    backend = PlanOnlyBackend("cpu", GEOM)

    def lists(cached: int, qlen: int) -> BatchLayout:
        return BatchLayout(block_tables=tables, cached_lens=[cached] * batch, query_lens=[qlen] * batch)

    arr = np.asarray(tables, dtype=np.int64)
    cached_arr = np.full(batch, ctx - 1, dtype=np.int64)
    ones = np.ones(batch, dtype=np.int64)
    try:
        BatchLayout(block_tables=arr, cached_lens=cached_arr, query_lens=ones)
        layout_arrays = cpu_us(lambda: BatchLayout(arr, cached_arr, ones), calls, repeats)
    except Exception:  # noqa: BLE001 - an older BatchLayout that only takes lists
        layout_arrays = None

    decode = lists(ctx - 1, 1)
    verify = lists(ctx - q, q)
    out = {
        "batch": batch,
        "layout_lists_us": cpu_us(lambda: lists(ctx - 1, 1), calls, repeats),
        "layout_arrays_us": layout_arrays,
        "plan_decode_us": cpu_us(lambda: backend.plan(decode, AttentionKind.DECODE), calls, repeats),
        "plan_verify_us": cpu_us(lambda: backend.plan(verify, AttentionKind.VERIFY), calls, repeats),
    }
    out["spec_step_us"] = 4 * out["layout_lists_us"] + 2 * out["plan_decode_us"] + 2 * out["plan_verify_us"]
    return out


def table(rows: list[dict]) -> str:
    def fmt(v):
        return "n/a" if v is None else f"{v:,.0f}"

    lines = [
        "| batch | layout (lists) | layout (arrays) | plan DECODE | plan VERIFY q=4 | spec step (4 layouts + 4 plans) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {fmt(r['layout_lists_us'])} | {fmt(r['layout_arrays_us'])} | "
            f"{fmt(r['plan_decode_us'])} | {fmt(r['plan_verify_us'])} | {fmt(r['spec_step_us'])} |"
        )
    return "\n".join(lines)


def profile(batch: int, ctx: int, n: int = 300) -> str:
    import cProfile
    import io
    import pstats

    tables = tables_for(batch, ctx)
    backend = PlanOnlyBackend("cpu", GEOM)
    layout = BatchLayout(block_tables=tables, cached_lens=[ctx - 1] * batch, query_lens=[1] * batch)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        backend.plan(layout, AttentionKind.DECODE)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ctx", type=int, default=4096, help="context tokens per request")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step (VERIFY plans k + 1 tokens)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", type=int, metavar="BATCH", help="also print a cProfile of plan(DECODE)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(int(b), args.ctx, args.k, args.repeats) for b in args.batches.split(",")]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"plan_bench: {args.ctx}-token contexts, pages of {BLOCK}, k={args.k}; thread CPU us per call, "
        f"best of {args.repeats}; {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}; {now}\n"
    )
    print(table(rows))
    if args.profile:
        print(f"\nplan(DECODE) profile, batch {args.profile}:\n{profile(args.profile, args.ctx)}")


if __name__ == "__main__":
    main()
