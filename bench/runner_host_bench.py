"""Host cost of a SERVED engine step with the device taken out (CPU): what the worker's engine
thread spends per step beyond ``Engine.step()`` itself, and what the step costs when it runs as
served instead of alone.

``bench/engine_host_bench.py`` times ``Engine.step()`` with its forwards nulled. A served worker
runs the same engine inside :class:`~services.gpuworker.runner.EngineRunner` in an engine process
of its own, and every turn of that loop also moves the step's results to the gRPC process (one
pickled message through a pipe), sends Publishes and ahead-of-need Extends to a real kvstore
(through the courier's carrier: a process of its own by default, ``--carrier thread`` for a thread
of the engine process), and applies their answers. This script builds exactly that, minus the
device and the gRPC front::

    this process (the engine process)                                  other processes
    EngineRunner thread: step (forwards nulled) ─ results ─ flush ──pipe──▶ a reader that unpickles
                         publishes / extends ──pipe──▶ carrier process ──gRPC──▶ tandem kvstore (memory)

    turn    wall time between two steps' ends on the engine thread (what bounds tokens/s)
    step    ``Engine.step()`` inside it (``on_step``'s elapsed)
    outside turn - step: the loop's own work (results, outbox, kvstore verbs, admissions)

and, for the same batch and k, the engine alone (``engine_host_bench.run_case``): on the GPU a
served turn that costs more host time than the alone step is time the device waits. A third run
serves the same batch with no kvstore traffic while it is timed (whole-run capacity reserved up
front, Publishes prepared as served but dropped unsent): the difference is what sending the verbs
and applying their answers cost, on the engine thread and through the carrier's and the kvstore's
competition for the GIL and the cores.

Run:   python bench/runner_host_bench.py                      # B = 16, 64; k = 0 and 3
       python bench/runner_host_bench.py --batches 64 --k 3 --profile   # + cProfile of the engine thread
       python bench/runner_host_bench.py --batches 64 --thread-too      # + the thread carrier, for comparison
       python bench/runner_host_bench.py --out docs/runner_host_bench.json --png docs/img/runner_host_bench.png
       python bench/runner_host_bench.py --compare before1.json,before2.json after1.json,after2.json --png cmp.png
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing
import os
import pstats
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
import torch  # noqa: E402

from _common import Suite, free_port, grouped_bars, machine  # noqa: E402
from engine_host_bench import (  # noqa: E402
    BLOCK, PROMPT, PlanOnlyAfterWarmup, churn_max_new, null_forwards, null_plans_of, nulled_forward, run_case,
)

from services.common.spec import SpecMode  # noqa: E402
from services.common.wire import tokens_to_proto  # noqa: E402
from services.gpuworker.engine.engine import Engine, EngineConfig  # noqa: E402
from services.gpuworker.engine.request import RequestSpec  # noqa: E402
from services.gpuworker.engine_process import PipeOutbox  # noqa: E402
from services.gpuworker.kvstore_carrier import LinkRecipe, ProcessCarrier, ThreadCarrier  # noqa: E402
from services.gpuworker.kvstore_courier import KVStoreCourier  # noqa: E402
from services.gpuworker.kvstore_link import KVStoreLink, ReservationBlockSource  # noqa: E402
from services.gpuworker.model.loader import load_model  # noqa: E402
from services.gpuworker.runner import EngineRunner, Job  # noqa: E402
from tandem.kvstore.v1 import kvstore_pb2 as kv  # noqa: E402
from tandem.kvstore.v1 import kvstore_pb2_grpc as kv_grpc  # noqa: E402

WARM_STEPS = 10


def _drain(conn, ready) -> None:
    """The gRPC process's reader, reduced to what costs the engine nothing: unpickle, drop."""
    ready.set()
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass


def _best_of(kept: dict | None, new: dict) -> dict:
    """Per case, the best round of EACH run on its own (the alone step, the served turn, each
    comparison run): rounds on a shared machine vary, and a served turn of one round over the
    alone step of another is a ratio of noise."""
    if kept is None:
        return new
    out = dict(new if new["turn_us"] < kept["turn_us"] else kept)
    out["alone_us"] = min(kept["alone_us"], new["alone_us"])
    for run in ("no_verbs", "unapplied", "thread"):
        if new.get(run) and kept.get(run):
            out[run] = min(kept[run], new[run], key=lambda r: r["turn_us"])
    return out


def _process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) another process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_served(models, kv_addr: str, batch: int, k: int, steps: int, worker: str, profile: bool = False,
               verbs: str = "all", pin: bool = False, carrier: str = "process", churn: bool = False) -> dict:
    """``batch`` requests decoding for ever (forced acceptance k) in an EngineRunner over the
    kvstore at ``kv_addr``; times ``steps`` steps after the first ``WARM_STEPS`` decodes.
    ``verbs``: "all" as served; "none": no kvstore traffic while timing (each reservation holds
    the whole run's capacity from Reserve on, so no Extend is due, and Publishes are prepared but
    dropped unsent); "unapplied": the same capacity, Publishes sent as served but their answers
    not applied (the courier's traffic alone, without the engine thread's work on the answers).
    ``carrier``: where the verbs are sent from, "process" (a CUDA worker's default) or "thread".
    ``pin``: the engine thread runs on CPU 0 alone (the caller keeps everything else off it).
    ``churn``: requests end after ``churn_max_new`` tokens and a feeder thread reserves and submits
    the next (half its prompt shared, as serve_bench's), as the worker's command thread does; the
    pool has room for the batch and little more, so new requests' blocks are evicted cached ones,
    handed out deepest first as the kvstore does (admissions and their ledger work included)."""
    if verbs not in ("all", "none", "unapplied") or (churn and verbs != "all"):
        raise ValueError(f"verbs: all, none or unapplied (churn: all only), not {verbs!r}")
    target, draft = models
    if not churn and PROMPT + (steps + 3 * WARM_STEPS + 16) * (k + 1) >= target.config.max_seq_len:
        raise ValueError(f"{steps} steps of k = {k} pass the model's max_seq_len ({target.config.max_seq_len}): fewer --steps")
    backend = PlanOnlyAfterWarmup("cpu", target.attention_geometry(BLOCK))
    if churn:
        per_request = -(-(PROMPT + 128 + 2 * (k + 1) + 4 * BLOCK) // BLOCK)  # prompt, 127 tokens, headroom, a chunk
    else:
        per_request = -(-(PROMPT + (steps + 3 * WARM_STEPS + 40) * (k + 1) + 16) // BLOCK)
    blocks = batch * per_request + 64
    link = KVStoreLink(kv_addr, timeout_s=10.0)
    if carrier == "process":
        courier = KVStoreCourier(ProcessCarrier(LinkRecipe(kv_addr, 10.0, worker)))
        pid = courier._carrier.pid
        courier_clock = lambda: _process_cpu_s(pid)  # noqa: E731
    else:
        courier = KVStoreCourier(ThreadCarrier(link))
        clock = time.pthread_getcpuclockid(courier._carrier._thread.ident)
        courier_clock = lambda: time.clock_gettime(clock)  # noqa: E731
    source = ReservationBlockSource(courier)
    config = EngineConfig(graphs="pad", overlap=True, fused_spec=k > 0, fused_graphs="split", max_draft_tokens=max(k, 1),
                          forced_acceptance=k if k else None, max_batch_size=batch, max_batch_tokens=4096, chunk_size=4096)
    engine = Engine(target, draft if k else None, backend, target.new_kv_pool(blocks + 1, BLOCK),
                    draft.new_kv_pool(blocks + 1, BLOCK) if k else None, source, config)
    info = link.register(worker_id=worker, address="127.0.0.1:1", model_id=f"bench-{worker}", spec_mode=SpecMode.EAGLE3,
                         mtp_depth=0, block_size=BLOCK, num_blocks=blocks, vocab_size=target.config.vocab_size,
                         max_seq_len=target.config.max_seq_len)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    reader = ctx.Process(target=_drain, args=(ours, ready), daemon=True)
    reader.start()
    ours.close()
    if not ready.wait(120):  # a spawned child imports this script (torch) first: a full pipe would block the engine
        raise RuntimeError("the reader process did not start")
    outbox = PipeOutbox(theirs)

    ends: list[float] = []
    inside: list[float] = []
    cpu: dict[int, tuple[float, float, float]] = {}  # engine thread, carrier, this process (CPU s)
    decoding = [0]  # steps in which every request got tokens
    swapped = threading.Event()
    prof = cProfile.Profile() if profile else None

    def on_step(report, elapsed_s: float, _between_s: float = 0.0) -> None:  # the engine thread, after every step
        if not swapped.is_set():
            if pin:
                os.sched_setaffinity(0, {0})  # 0: the calling thread
            decoded = sum(1 for r in report.results.values() if r.new_token_ids)
            # churn: from 8 tokens in, requests end and the next are in prefill, so a step in
            # which all of the batch decodes may never come again: most of it is enough there
            if decoded == batch or (churn and decoded >= batch // 2):
                decoding[0] += 1
            if decoding[0] >= 3:  # prefill, then the first decodes ran real forwards
                aux = engine.drafter.target_aux_layers if engine.drafter is not None else ()
                null_forwards(engine.graphs, target.config.hidden_size, draft.chain_hidden_size,
                              target.embed_tokens.weight.dtype, target.config.vocab_size,
                              aux_width=len(aux) * target.config.hidden_size)
                null_plans_of(engine.graphs, backend, nulled_forward)
                swapped.set()
            return
        ends.append(time.perf_counter())
        inside.append(elapsed_s)
        if len(ends) in (WARM_STEPS, WARM_STEPS + steps):  # only here: reading /proc costs the engine thread
            counted[len(ends)] = (engine.fused_steps, engine.continued_steps)
            cpu[len(ends)] = (time.thread_time(), courier_clock(), time.process_time())
        if prof is not None and len(ends) == WARM_STEPS:
            prof.enable()  # this thread's calls from here on
        if prof is not None and len(ends) == WARM_STEPS + steps:
            prof.disable()

    ended: queue.Queue = queue.Queue()  # churn: a reservation ended, the next request goes in
    runner = EngineRunner(engine, link, source, courier, max_running=batch, on_step=on_step, outbox=outbox,
                          extend_watermark_blocks=2, extend_chunk_blocks=4,
                          on_disown=ended.put if churn else None)
    outbox.running = lambda: runner.running
    usages: list = []  # churn: each ended request's Usage (its queue time and TTFT), once timing began
    usage_of = runner._usage

    def recorded_usage(job, counts):
        usage = usage_of(job, counts)
        if swapped.is_set() and ends:
            usages.append(usage)
        return usage

    runner._usage = recorded_usage
    if verbs == "none":
        runner._send_publishes = runner._step_publishes.clear  # the loop calls it once a turn
    elif verbs == "unapplied":
        runner._published = lambda rid, response, at_risk, published=None: runner._publishing.discard(at_risk)
    runner.start()
    beating = threading.Event()

    def heartbeat() -> None:  # the gRPC process's job when served: without it the lease lapses (10 s)
        while not beating.wait(1.0):
            link.heartbeat(worker)

    threading.Thread(target=heartbeat, daemon=True).start()
    counted = {}  # fused / continued steps when the timing starts and ends
    stub = kv_grpc.KVStoreStub(link._channel)
    shared = [(3 * j) % 200 + 1 for j in range(PROMPT // 2)]

    def admit(i: int) -> None:
        if churn:
            rng = random.Random(i)
            prompt = shared + [rng.randrange(1, 200) for _ in range(PROMPT - len(shared))]
        else:
            prompt = [(7 * i + j) % 200 + 1 for j in range(PROMPT)]
        rid = f"{worker}-r{i}"
        r = stub.Reserve(kv.ReserveRequest(worker_id=worker, incarnation=info.incarnation, request_id=rid,
                                           tokens=tokens_to_proto(prompt), headroom_positions=2 * (k + 1) if verbs == "all" else (per_request - 1) * BLOCK - PROMPT),
                         timeout=10).reservation
        spec = RequestSpec(request_id=rid, prompt_ids=prompt, block_table=list(r.block_table),
                           reused_positions=int(r.reused_positions), max_new_tokens=churn_max_new(i) if churn else 10**6, k=k)
        runner.submit(Job(spec, r.reservation_id, info.incarnation, kv_request_id=r.request_id))

    def feed() -> None:  # churn: the gRPC side, reduced to Reserve + submit (the in-process queue, not an inbox pipe)
        i = batch
        while ended.get() is not None:
            admit(i)
            i += 1

    feeder = threading.Thread(target=feed, name="feeder", daemon=True)
    try:
        for i in range(batch):
            admit(i)
        if churn:
            feeder.start()
        end = time.monotonic() + 600
        while len(ends) < WARM_STEPS + steps:
            if time.monotonic() > end or not runner._thread.is_alive():
                raise RuntimeError(f"only {len(ends)} timed steps in 600 s (B={batch}, k={k})")
            time.sleep(0.05)
    finally:
        beating.set()
        ended.put(None)
        runner.stop()
        link.close()
        theirs.close()
        reader.join(5)
    turns = [b - a for a, b in zip(ends[WARM_STEPS - 1:], ends[WARM_STEPS:WARM_STEPS + steps])]
    steps_in = inside[WARM_STEPS:WARM_STEPS + steps]
    (f0, c0), (f1, c1) = counted[WARM_STEPS], counted[WARM_STEPS + steps]
    first, last = cpu[WARM_STEPS], cpu[WARM_STEPS + steps]
    engine_cpu, courier_cpu, process_cpu = ((b - a) / steps * 1e6 for a, b in zip(first, last))
    row = {"batch": batch, "k": k, "steps": steps, "turn_us": statistics.median(turns) * 1e6,
           "engine_thread_cpu_us": engine_cpu, "courier_thread_cpu_us": courier_cpu, "process_cpu_us": process_cpu,
           "fused_share": (f1 - f0) / steps, "continued_share": (c1 - c0) / steps,
           "step_us": statistics.median(steps_in) * 1e6,
           "outside_us": statistics.median([t - s for t, s in zip(turns, steps_in)]) * 1e6}
    if usages:  # how long a request waited for admission, and for its first token, in ms and in turns
        row["queue_ms"] = statistics.mean(u.queue_time_s for u in usages) * 1e3
        row["ttft_ms"] = statistics.mean(u.time_to_first_token_s for u in usages) * 1e3
        row["ended"] = len(usages)
    if prof is not None:
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats("runner.py|kvstore_courier|engine_process|cache_ledger|kvstore_link", 40)
        row["profile"] = out.getvalue()
    return row


def plot(rows: list[dict], png: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"B={r['batch']}, k={r['k']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    grouped_bars(ax, labels, series=[
        ("engine alone: Engine.step()", [r["alone_us"] for r in rows]),
        ("served: Engine.step() in the runner", [r["step_us"] for r in rows]),
        ("served: whole turn", [r["turn_us"] for r in rows]),
        *([("served, no kvstore verbs: whole turn", [r["no_verbs"]["turn_us"] for r in rows])]
          if all(r.get("no_verbs") for r in rows) else []),
        *([("served, Publishes sent, answers not applied: whole turn", [r["unapplied"]["turn_us"] for r in rows])]
          if all("unapplied" in r for r in rows) else []),
        *([("served, verbs from a thread of the engine process: whole turn", [r["thread"]["turn_us"] for r in rows])]
          if all("thread" in r for r in rows) else []),
    ])
    _finish(fig, ax, png, "host µs per step (median), forwards nulled",
            f"served engine turn vs engine alone\n{meta['machine']}, {meta['date']}")


def plot_compare(before: list[Path], after: list[Path], png: Path) -> None:
    """Before / after: the served turn's work outside the step (median over the runs of each
    side, ``--out`` files of this script), per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def medians(paths: list[Path]) -> dict[tuple[int, int], float]:
        runs = [json.loads(p.read_text())["rows"] for p in paths]
        cases = sorted({(r["batch"], r["k"]) for rows in runs for r in rows})
        return {c: statistics.median(r["outside_us"] for rows in runs for r in rows if (r["batch"], r["k"]) == c)
                for c in cases}

    old, new = medians(before), medians(after)
    cases = [c for c in old if c in new]
    fig, ax = plt.subplots(figsize=(8, 4.4))
    grouped_bars(ax, [f"B={b}, k={k}" for b, k in cases], series=[
        (f"before (median of {len(before)} runs)", [old[c] for c in cases]),
        (f"after (median of {len(after)} runs)", [new[c] for c in cases]),
    ])
    meta = json.loads(after[0].read_text())["meta"]
    _finish(fig, ax, png, "served turn outside Engine.step(), µs (median)",
            f"the engine thread's work between steps, forwards nulled\n{meta['machine']}, {meta['date']}")


def _finish(fig, ax, png: Path, ylabel: str, title: str) -> None:
    """Label a bar chart of this script and write it to ``png``."""
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="no run: plot two sets of --out files (comma-separated paths each) to --png")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--k", default="0,3", help="comma-separated k values")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2, help="each case this many times, interleaved; the best kept")
    ap.add_argument("--profile", action="store_true", help="cProfile the engine thread in the last case")
    ap.add_argument("--unapplied", action="store_true",
                    help="also serve each case with Publishes sent but their answers not applied (the courier's traffic alone)")
    ap.add_argument("--carrier", choices=("process", "thread"), default="process",
                    help="where the kvstore verbs are sent from: a carrier process (a CUDA worker's default) or a thread "
                         "of the engine's process")
    ap.add_argument("--thread-too", action="store_true",
                    help="with --carrier process: also serve each case with the thread carrier (the GIL's share)")
    ap.add_argument("--pin", action="store_true",
                    help="Linux: the engine thread (and the engine alone) on CPU 0, every other thread and process on the "
                         "other CPUs: what is left of the served cost when no other work competes for the engine's core")
    ap.add_argument("--churn", action="store_true",
                    help="requests end (8-127 new tokens) and the next are reserved and submitted, as on a busy server "
                         "(k > 0 only; the engine alone runs engine_host_bench's churn; no no-verbs run)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--png", type=Path)
    args = ap.parse_args()
    if args.compare:
        if not args.png:
            raise SystemExit("--compare needs --png")
        before, after = ([Path(p) for p in side.split(",")] for side in args.compare)
        plot_compare(before, after, args.png)
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    target, draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3, device="cpu", seed=0)
    cases = [(b, k) for b in map(int, args.batches.split(",")) for k in map(int, args.k.split(","))]
    if args.churn and any(k == 0 for _, k in cases):
        raise SystemExit("--churn needs k > 0")
    best: dict[tuple, dict] = {}
    others = set(range(os.cpu_count() or 1)) - {0}
    if args.pin and not others:
        raise SystemExit("--pin needs two CPUs or more")
    if args.pin:
        os.sched_setaffinity(0, others)  # the kvstore and reader processes and every thread inherit it
    with tempfile.TemporaryDirectory() as logs:
        suite = Suite()
        kv_port = free_port()
        suite.spawn("kvstore", ["kvstore", "--port", str(kv_port)], Path(logs))
        kv_addr = f"127.0.0.1:{kv_port}"
        try:
            grpc.channel_ready_future(grpc.insecure_channel(kv_addr)).result(timeout=60)
            with torch.inference_mode():
                n = 0
                for r in range(args.rounds):
                    for b, k in cases:
                        n += 1
                        if args.pin:
                            os.sched_setaffinity(0, {0})
                        alone = run_case((target, draft), b, k, "split", args.steps, churn=args.churn)
                        if args.pin:
                            os.sched_setaffinity(0, others)
                        served = run_served((target, draft), kv_addr, b, k, args.steps, f"w{n}", pin=args.pin,
                                            carrier=args.carrier, churn=args.churn)
                        if args.thread_too:
                            served["thread"] = run_served((target, draft), kv_addr, b, k, args.steps, f"w{n}t",
                                                          pin=args.pin, carrier="thread", churn=args.churn)
                        quiet = None if args.churn else run_served((target, draft), kv_addr, b, k, args.steps, f"w{n}q",
                                                                   verbs="none", pin=args.pin)
                        served["alone_us"] = alone["total_us"]
                        served["no_verbs"] = quiet
                        if args.unapplied:
                            served["unapplied"] = run_served((target, draft), kv_addr, b, k, args.steps, f"w{n}u",
                                                             verbs="unapplied", pin=args.pin)
                        key = (b, k)
                        best[key] = _best_of(best.get(key), served)
                        print(f"[round {r + 1}/{args.rounds}] B={b:3d} k={k}: alone {alone['total_us']:.0f} us; served turn "
                              f"{served['turn_us']:.0f} us = step {served['step_us']:.0f} + outside {served['outside_us']:.0f}; "
                              f"CPU a turn: engine thread {served['engine_thread_cpu_us']:.0f}, courier {served['courier_thread_cpu_us']:.0f}, "
                              f"process {served['process_cpu_us']:.0f} us; "
                              f"fused {served['fused_share']:.0%} continued {served['continued_share']:.0%} "
                              f"(alone {alone['fused_share']:.0%} / {alone['continued_share']:.0%})"
                              + (f"; a request's wait for admission {served['queue_ms']:.2f} ms "
                                 f"({served['queue_ms'] * 1e3 / served['turn_us']:.2f} turns), TTFT {served['ttft_ms']:.2f} ms "
                                 f"({served['ttft_ms'] * 1e3 / served['turn_us']:.2f} turns; {served['ended']} requests)"
                                 if "queue_ms" in served else "")
                              + (f"; without kvstore verbs: turn {quiet['turn_us']:.0f} us = step {quiet['step_us']:.0f} + "
                                 f"outside {quiet['outside_us']:.0f}" if quiet else "")
                              + (f"; Publishes sent, answers not applied: turn {served['unapplied']['turn_us']:.0f} us = step "
                                 f"{served['unapplied']['step_us']:.0f}, engine thread CPU {served['unapplied']['engine_thread_cpu_us']:.0f}"
                                 if args.unapplied else "")
                              + (f"; thread carrier: turn {served['thread']['turn_us']:.0f} us = step "
                                 f"{served['thread']['step_us']:.0f}" if args.thread_too else ""),
                              flush=True)
                if args.profile:
                    b, k = cases[-1]
                    row = run_served((target, draft), kv_addr, b, k, args.steps, "wprof", profile=True, churn=args.churn)
                    print(row["profile"])
        finally:
            suite.stop()
    rows = [best[c] for c in cases]
    print("\n| batch | k | engine alone µs / step | served step µs | served turn µs (outside the step) | turn ÷ alone "
          "| engine / courier thread CPU µs a turn | no kvstore verbs: step, turn µs |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        q, u = row["no_verbs"], row.get("unapplied")
        print(f"| {row['batch']} | {row['k']} | {row['alone_us']:.0f} | {row['step_us']:.0f} | {row['turn_us']:.0f} "
              f"({row['outside_us']:.0f}) | {row['turn_us'] / row['alone_us']:.2f} | {row['engine_thread_cpu_us']:.0f} / "
              f"{row['courier_thread_cpu_us']:.0f} | " + (f"{q['step_us']:.0f}, {q['turn_us']:.0f} |" if q else "– |")
              + (f" Publishes sent, answers not applied: step {u['step_us']:.0f}, turn {u['turn_us']:.0f}, engine thread CPU "
                 f"{u['engine_thread_cpu_us']:.0f} (no verbs {q['engine_thread_cpu_us']:.0f})" if u and q else ""))
    meta = machine()
    meta["machine"] = f"{meta['cpu']}, {meta['nproc']} cores, Python {meta['python']}" + (", engine pinned to CPU 0" if args.pin else "")
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "command": " ".join(sys.argv), "rows": rows}, indent=2))
    if args.png:
        plot(rows, args.png, meta)


if __name__ == "__main__":
    main()
