"""How fast one host-bound thread runs while other processes keep the box's other cores busy
(issue 7): the served engine is host-bound at c 64 (its step is host time, the device waits), and
a served run puts the router, the clients, the worker's gRPC process and the kvstore on the same
box. If one core's speed drops when the others are busy (SMT siblings sharing a core, the clock
falling from single-core to all-core turbo, a shared cache), the served engine's steps get slower
than the engine alone's for that reason alone.

One workload stands for the engine's host work: plain Python on small objects (a scheduler's
dataclasses, dicts and lists) and small CPU tensor ops (the shapes a step stages). It runs pinned
to one CPU, timed as the median of ``--reps`` repetitions, in these cases:

    alone               nothing else busy (first, and again last: "alone again")
    busy N              N spinning processes, placed by the OS
    busy N off-sibling  N spinning processes pinned away from the measured CPU and its SMT sibling
    sibling             one spinning process on the measured CPU's SMT sibling (if it has one)

Prints the CPU topology (``lscpu``'s model, threads per core) and each case's median and ratio to
"alone"; ``--out`` writes them as JSON.

    python bench/host_contention_bench.py [--busy 1,3,6] [--reps 30] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import busy_processes, machine, siblings  # noqa: E402


@dataclasses.dataclass(slots=True)
class _Item:
    rid: str
    length: int
    table: list[int]


def workload(torch) -> None:
    """~10-40 ms of host work shaped like an engine turn's: objects, dicts, sorts, small tensors."""
    items = [_Item(f"r{i}", i * 7 % 513, list(range(i % 32))) for i in range(2000)]
    by_id = {it.rid: it for it in items}
    items.sort(key=lambda it: (it.length, it.rid))
    total = sum(len(by_id[it.rid].table) for it in items)
    rows = [[it.length, total % 97, len(it.table)] for it in items[:256]]
    if torch is not None:
        t = torch.tensor(rows, dtype=torch.int32)
        for _ in range(50):
            t = (t + 1).clamp_(max=1 << 20)
            t.cumsum(0)


def timed(reps: int, torch) -> float:
    workload(torch)  # warm
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        workload(torch)
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


def run(args) -> dict:
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None
    allowed = sorted(os.sched_getaffinity(0))
    cpu = allowed[0]
    os.sched_setaffinity(0, {cpu})
    sib = siblings(cpu) & set(allowed)
    others = [c for c in allowed if c not in sib]
    cases: list[tuple[str, list[set[int] | None]]] = [("alone", [])]
    for n in args.busy:
        cases.append((f"busy {n}", [None] * n))
        if len(others) >= n:
            cases.append((f"busy {n} off-sibling", [{c} for c in others[:n]]))
    if len(sib) > 1:
        cases.append(("sibling", [{min(sib - {cpu})}]))
    # again at the end: a host whose clock or neighbours drift over the run shows it here (session
    # 41's box ran "alone" first at 4.82 ms and every case beside busy processes faster)
    cases.append(("alone again", []))
    rows = []
    for name, placement in cases:
        with busy_processes(placement):
            ms = timed(args.reps, torch)
        rows.append({"case": name, "ms": ms})
        print(f"{name:>22}: {ms:7.2f} ms  ({ms / rows[0]['ms']:.2f}x alone)", flush=True)
    return {"measured_cpu": cpu, "smt_siblings": sorted(sib), "cpus": len(allowed), "rows": rows}


def lscpu() -> dict:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    keep = ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "CPU max MHz", "L3 cache")
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if k.strip() in keep}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busy", default="1,3,6", help="numbers of spinning processes (comma-separated)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.busy = [int(x) for x in args.busy.split(",") if x]
    facts = {**machine(), "lscpu": lscpu()}
    print(json.dumps(facts), flush=True)
    res = {"machine": facts, **run(args)}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
