"""Host cost of an engine step with the device taken out (CPU): the Python a GPU worker spends per
step, and the part of it the device waits for.

On the GPU the engine's forwards are graph replays that return at once; what bounds a step at
high batch is the host: reading the verdict, moving request state, scheduling, laying out and
planning the next forwards. This script measures exactly that on any machine: the engine runs
as served (graph padding, overlapped steps, fused speculative steps, forced acceptance), the
attention planner is the shared one every backend runs (``AttentionBackend._common_plan``, not
FlashInfer's own ``wrapper.plan``, which comes on top on the GPU), and once every request
decodes the registered forwards are swapped for null ones (outputs of the right shapes, no
compute). Per step it records:

    total     wall time of ``Engine.step()`` (host only: nothing waits for a device here)
    exposed   from reading the previous fused step's verdict to the first forward of this one:
              on the GPU the device is idle at least this long every step (the verdict is read
              when the device is done, and nothing runs until the next launch); more when the
              host is the bottleneck (the rest of the step's host work then outlasts the device)

    one step with overlap (``--overlap-steps``), fused k = 3:

      host:    ... | read verdict N ─ apply ─ schedule ─ layouts ─ plan ─┐ launch N+1 ─ trim, report ─ return
      device:  [ step N ]                                                 └ [ step N+1 ..........
                         |<──────────────── exposed ─────────────────────>|

Run:   python bench/engine_host_bench.py                       # B = 1, 16, 64; k = 0 and 3 (one, split)
       python bench/engine_host_bench.py --profile 64          # plus a cProfile of fused steps at B = 64
       python bench/engine_host_bench.py --churn               # plus each fused case with requests ending
                                                               # and arriving every few steps (a busy server)
       python bench/engine_host_bench.py --out docs/engine_host_bench.json --png docs/img/engine_host_bench.png
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common

import torch  # noqa: E402

from _common import grouped_bars  # noqa: E402

from services.common.spec import SpecMode  # noqa: E402
from services.gpuworker.attention.torch_backend import TorchBackend  # noqa: E402
from services.gpuworker.engine.readback import Readback  # noqa: E402
from services.gpuworker.engine.capacity import LocalBlockSource  # noqa: E402
from services.gpuworker.engine.engine import Engine, EngineConfig  # noqa: E402
from services.gpuworker.engine.local import LocalSetup, submit  # noqa: E402
from services.gpuworker.model.loader import load_model  # noqa: E402

BLOCK = 16
PROMPT = 64


class PlanOnlyAfterWarmup(TorchBackend):
    """The torch backend, but while ``null`` is set the shared planner only (the torch backend's
    own mask building is CPU-specific: no GPU backend pays it)."""

    null = False

    def _finish_plan(self, plan, ws) -> None:
        if not self.null:
            super()._finish_plan(plan, ws)


def nulled_forward(name: str) -> bool:
    """The forwards ``null_forwards`` swaps out (a fused step's, and the target's decode graph)."""
    return name in ("target", "spec", "spec_verify") or name.startswith("spec_chain")


def null_plans_of(graphs, backend: PlanOnlyAfterWarmup, nulled) -> None:
    """Plans made for a nulled forward stop at the shared planner; every other plan (a prompt's
    eager forward, the draft's fill after it: real forwards under ``--churn``) is made whole."""
    def wrap(run):
        def wrapped(name, *a, **kw):
            backend.null = nulled(name)
            try:
                return run(name, *a, **kw)
            finally:
                backend.null = False
        return wrapped
    graphs.run, graphs.run_lanes = wrap(graphs.run), wrap(graphs.run_lanes)


def null_forwards(graphs, hidden: int, chain_hidden: int, dtype: torch.dtype, vocab: int, aux_width: int = 0) -> dict[str, int]:
    """Swap every registered forward for one that returns preallocated outputs of its shapes
    (what a graph replay hands back) and computes nothing; a fused step's verdict accepts
    ``forced`` drafts, as the real one does under forced acceptance (which it needs). Returns
    the calls per forward name, counted as they come."""
    cache: dict[tuple, torch.Tensor] = {}
    calls: dict[str, int] = {}

    def zeros(*shape, dtype=torch.long) -> torch.Tensor:
        key = (shape, dtype)
        if key not in cache:
            cache[key] = torch.zeros(shape, dtype=dtype)
        return cache[key]

    def verdict(ids, forced, cap):
        if bool((forced < 0).any()):
            raise RuntimeError("null forwards need forced acceptance (their verdict is the forced count)")
        b = forced.shape[0]
        q = ids.shape[0] // b
        return {"drafts": ids.view(b, q)[:, 1:], "target": zeros(b, q), "accepted": torch.minimum(forced.clamp(max=q - 1), cap),
                "next_draft": zeros(b), "next_hidden": zeros(b, chain_hidden, dtype=dtype)}

    fns = {
        # (an EAGLE-3 draft's fill reads the aux rows: a decode of a request with no budget left)
        "target": lambda plan, ids: {"logits": zeros(ids.shape[0], vocab, dtype=dtype),
                                     "hidden": zeros(ids.shape[0], hidden, dtype=dtype),
                                     **({"aux": zeros(ids.shape[0], aux_width, dtype=dtype)} if aux_width else {})},
        "spec": lambda plans, last, d1, hidden, forced, cap: verdict(
            torch.stack([last, d1] + [zeros(last.shape[0])] * (len(plans) - 1), dim=1).reshape(-1), forced, cap),
        "spec_verify": lambda plan, ids, forced, cap: verdict(ids, forced, cap),
    }
    for name, (fn, inputs, qs) in list(graphs._forwards.items()):
        if name.startswith("spec_chain"):
            new = lambda plan, tokens, hidden: {"tokens": zeros(tokens.shape[0]), "hidden": hidden}  # noqa: E731
        elif name in fns:
            new = fns[name]
        else:
            continue  # phase-by-phase forwards (chain, fill) stay real: only prompts run them (--churn)

        def counted(*a, _new=new, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _new(*a, **kw)
        graphs._forwards[name] = (counted, inputs, qs)
    return calls


def churn_max_new(i: int) -> int:
    """``--churn``: request i's max_new_tokens, 8 .. 127 spread over the ids (2 to 32 steps at
    k = 3 with every draft accepted), so that requests end at different steps."""
    return 8 + (37 * i) % 120


def run_case(models, batch: int, k: int, launch: str, steps: int, profile: bool = False, churn: bool = False) -> dict:
    """One case; ``churn``: a closed loop as a busy server runs it (each request ends after its
    ``churn_max_new`` tokens and the next one arrives, its prompt prefilled for real beside the
    nulled decodes; room reserved ahead, as the worker's watermark does) instead of one batch
    decoding for ever."""
    target, draft = models
    backend = PlanOnlyAfterWarmup("cpu", target.attention_geometry(BLOCK))
    if churn and not k:
        raise ValueError("--churn needs k > 0 (it measures fused steps)")
    if not churn and PROMPT + (steps + 14 + 2) * (k + 1) >= target.config.max_seq_len:
        raise ValueError(f"{steps} steps of k = {k} pass the model's max_seq_len ({target.config.max_seq_len}): fewer --steps")
    headroom = 128 + 2 * (k + 1) if churn else 0
    per_request = -(-(PROMPT + (steps + 40) * (k + 1) + 16) // BLOCK) if not churn else -(-(PROMPT + headroom) // BLOCK) + 1
    blocks = batch * per_request
    source = LocalBlockSource(blocks, BLOCK)
    config = EngineConfig(graphs="pad", overlap=True, fused_spec=k > 0, fused_graphs=launch, max_draft_tokens=max(k, 1),
                          forced_acceptance=k if k else None, max_batch_size=batch, max_batch_tokens=4096, chunk_size=4096)
    engine = Engine(target, draft if k else None, backend, target.new_kv_pool(blocks + 1, BLOCK),
                    draft.new_kv_pool(blocks + 1, BLOCK) if k else None, source, config)
    setup = LocalSetup(engine, source, target, draft if k else None)
    admitted = 0

    def admit() -> None:
        nonlocal admitted
        i, admitted = admitted, admitted + 1
        submit(setup, f"r{i}", [(7 * i + j) % 200 + 1 for j in range(PROMPT)],
               max_new_tokens=churn_max_new(i) if churn else 10**6, k=k, headroom=headroom)

    def step():
        report = engine.step()
        for rid, r in report.results.items():
            if r.finished:  # churn only: the next request takes its place
                source.release(rid)
                admit()
        return report

    for _ in range(batch):
        admit()
    for _ in range(4):  # prefill, then the first decodes (real forwards)
        step()
    aux = engine.drafter.target_aux_layers if engine.drafter is not None else ()
    calls = null_forwards(engine.graphs, target.config.hidden_size, draft.chain_hidden_size,
                          target.embed_tokens.weight.dtype, target.config.vocab_size,
                          aux_width=len(aux) * target.config.hidden_size)
    null_plans_of(engine.graphs, backend, nulled_forward)

    marks: dict[str, float] = {}
    read = Readback.values

    def values(self):  # from the read on (its wait and its copy to lists), the device has nothing to run
        marks.setdefault("read", time.perf_counter())  # the step's first read: the verdict
        return read(self)

    for name, (fn, inputs, qs) in list(engine.graphs._forwards.items()):
        if name in ("target", "spec", "spec_chain1", "spec_verify"):
            def timed(*a, _fn=fn, **kw):
                marks.setdefault("forward", time.perf_counter())
                return _fn(*a, **kw)
            engine.graphs._forwards[name] = (timed, inputs, qs)
    Readback.values = values
    totals, exposed = [], []
    prof = cProfile.Profile() if profile else None
    lengths = {rid: engine.state(rid).logical_len for rid in engine.request_ids()}
    fused_before, continued_before = engine.fused_steps, engine.continued_steps
    try:
        for i in range(steps + 10):
            marks.clear()
            if prof is not None and i == 10:
                prof.enable()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            if i >= 10:
                totals.append(t1 - t0)
                if k and "read" in marks and "forward" in marks and marks["forward"] > marks["read"]:
                    exposed.append(marks["forward"] - marks["read"])
        if prof is not None:
            prof.disable()
    finally:
        Readback.values = read
    fused, continued = engine.fused_steps - fused_before, engine.continued_steps - continued_before
    if k and not churn and fused != steps + 10:
        raise RuntimeError(f"only {fused} of {steps + 10} steps ran fused (B={batch}, k={k})")
    # the bookkeeping ran as in real steps: every request moved by k + 1 tokens a step (forced
    # acceptance; with overlap the last step's verdict is still on its way)
    moved = sorted({engine.state(rid).logical_len - n for rid, n in lengths.items() if rid in engine.request_ids()})
    row = {"batch": batch, "k": k, "launch": launch if k else "-", "churn": churn, "steps": steps,
           "fused_share": fused / (steps + 10), "continued_share": continued / (steps + 10),
           "requests_ended": admitted - batch,
           "total_us": statistics.median(totals) * 1e6, "total_min_us": min(totals) * 1e6,
           "exposed_us": statistics.median(exposed) * 1e6 if exposed else None,
           "tokens_per_step": batch * (k + 1), "tokens_moved_per_request": moved, "null_calls": dict(calls)}
    row["host_bound_tokens_per_s"] = row["tokens_per_step"] / row["total_us"] * 1e6
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        row["profile"] = out.getvalue()
    return row


def plot(res: dict, png: Path) -> None:
    """Left: each steady case's host time a step, the device-idle part hatched. Right (with
    ``--churn``): the device-idle interval with an unchanging batch and with churn (a churn
    step's whole time holds the tiny model's real prompt forwards on this CPU: not a host cost)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["batch"], r["k"], r["launch"], r.get("churn", False)): r for r in res["rows"]}
    steady = sorted({(k, launch) for _, k, launch, churn in by if not churn})
    churned = sorted({(k, launch) for _, k, launch, churn in by if churn})
    batches = sorted({b for b, *_ in by})
    fig, axes = plt.subplots(1, 2 if churned else 1, figsize=(13 if churned else 9, 4.8), squeeze=False)
    ax = axes[0][0]
    labels = [f"k={k}" + (f", {launch}" if k else "") for k, launch in steady]
    centres = grouped_bars(ax, [str(b) for b in batches], alpha=0.45, series=[
        (f"{label}: whole step", [by[(b, k, launch, False)]["total_us"] for b in batches])
        for label, (k, launch) in zip(labels, steady)])
    for label, (k, launch), xs, bars in zip(labels, steady, centres, list(ax.containers)):
        if k:  # overlapped plain decode hides its host work behind the device's step
            ax.bar(xs, [by[(b, k, launch, False)]["exposed_us"] for b in batches], 0.8 / len(steady), hatch="//",
                   color=bars[0].get_facecolor(), alpha=1.0, label=f"{label}: device idle (verdict → launch)")
    ax.set_xlabel("batch size")
    ax.set_ylabel("host µs per engine step (median)")
    ax.set_title("one batch decoding, forwards nulled", fontsize=10)
    ax.legend(fontsize=7)
    if churned:
        ax = axes[0][1]
        grouped_bars(ax, [str(b) for b in batches], series=[
            (f"k={k}, {launch}, {'churn' if churn else 'steady'}",
             [by[(b, k, launch, churn)]["exposed_us"] for b in batches])
            for k, launch in churned for churn in (False, True)])
        ax.set_xlabel("batch size (requests in flight)")
        ax.set_ylabel("device idle µs per step, verdict → launch (median)")
        ax.set_title("requests ending and arriving every few steps (--churn)", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"engine host cost per step — {res['meta']['machine']}, {res['meta']['date']}", fontsize=11)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="each case this many times, interleaved; the best median kept")
    ap.add_argument("--profile", type=int, help="cProfile the fused steps (split) of this batch size")
    ap.add_argument("--churn", action="store_true",
                    help="also run each fused case as a closed loop of requests ending and arriving (see run_case)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--png", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    target, draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3, device="cpu", seed=0)
    batches = list(map(int, args.batches.split(",")))
    cases = [(b, 0, "one", False) for b in batches]
    if args.k:
        cases += [(b, args.k, launch, churn) for b in batches for launch in ("one", "split")
                  for churn in ((False, True) if args.churn else (False,))]
    best: dict[tuple, dict] = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            for b, k, launch, churn in cases:
                row = run_case((target, draft), b, k, launch, args.steps, churn=churn)
                key = (b, k, launch, churn)
                if key not in best or row["total_us"] < best[key]["total_us"]:
                    best[key] = row
                exposed = f", exposed {row['exposed_us']:.0f}" if row["exposed_us"] is not None else ""
                shares = f", fused {row['fused_share']:.0%} continued {row['continued_share']:.0%}" if k else ""
                print(f"[round {r + 1}/{args.rounds}] B={b:3d} k={k} {row['launch']:>5}{' churn' if churn else ''}: "
                      f"step {row['total_us']:.0f} us{exposed}{shares}", flush=True)
        if args.profile:
            row = run_case((target, draft), args.profile, args.k, "split", args.steps, profile=True)
            print(row["profile"])
    rows = [best[c] for c in cases]
    print("\n| batch | k | launch | requests | host µs / step | device idle µs / step (verdict → launch) | fused / continued steps | host-bound tokens/s |")
    print("|---:|---:|---|---|---:|---:|---:|---:|")
    for row in rows:
        exposed = f"{row['exposed_us']:.0f}" if row["exposed_us"] is not None else "-"
        shares = f"{row['fused_share']:.0%} / {row['continued_share']:.0%}" if row["k"] else "-"
        print(f"| {row['batch']} | {row['k']} | {row['launch']} | {'churn' if row['churn'] else 'steady'} | {row['total_us']:.0f} | "
              f"{exposed} | {shares} | {row['host_bound_tokens_per_s']:,.0f} |")
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(sys.argv), "torch": torch.__version__}
    res = {"meta": meta, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    if args.png:
        plot(res, args.png)


if __name__ == "__main__":
    main()
