"""Where an engine step's time goes: host (Python) vs device, and the host's hottest functions.

Builds a random Llama of ``--shape`` exactly as ``bench/serve_bench.py`` does, builds the engine
as the worker does (``services/gpuworker/build.py``, CUDA graphs, warm-up), admits ``--batch``
requests, prefills them, then times ``--steps`` decode steps three ways::

    step wall      engine.step() end to end (what a served token costs the engine)
    device busy    the kernels' own durations (torch.profiler), summed per step
    host profile   cProfile of the same steps: the Python functions that cost the most

and prints a table per (batch, k). A step whose wall time is far above the device time is
host-bound: that is what overlapped steps and a leaner step loop must win back.

    python3 bench/profile_step.py --shape 1b --batch 1,64 --k 0,3 --steps 100
    python bench/profile_step.py --device cpu --shape tiny-cpu --batch 1 --k 0 --steps 5   # smoke
    python3 bench/profile_step.py --model demo --batch 1 --k 0,3 --prompt-len 64   # the shipped demo + draft
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_bench import SHAPES, build_model  # noqa: E402


def settings_for(args, model_dir: Path, k: int):
    from services.gpuworker.settings import WorkerSettings

    gpu = args.device.startswith("cuda")
    draft = {} if args.model else {"draft_model": "random"}  # a given model brings its own draft
    return WorkerSettings(model=str(model_dir), spec_mode="eagle3", **draft, device=args.device,
                          backend="flashinfer" if gpu else "torch", dtype="bfloat16" if gpu else "float32",
                          num_blocks=max(args.batch) * (-(-(args.prompt_len + (args.steps + 20) * (k + 1) + 64) // 16)) + 8,
                          forced_acceptance=args.accept if k else None, fused_spec_steps=args.fused_spec_steps,
                          fused_spec_graphs=args.fused_spec_graphs)


def profile_one(built, batch: int, k: int, args) -> dict:
    import torch

    from services.gpuworker.engine.local import LocalSetup, submit

    setup = LocalSetup(built.engine, built.source, built.target, built.draft)
    engine = setup.engine
    gen = torch.Generator().manual_seed(batch * 10 + k)
    vocab = built.target.config.vocab_size
    rids = []
    for i in range(batch):
        rid = f"p{batch}-{k}-{i}"
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
        submit(setup, rid, prompt, max_new_tokens=(args.steps + 20) * (k + 1) + 16, k=k, headroom=k + 1)
        rids.append(rid)
    while any(engine.state(r).in_prefill for r in rids):  # prefill (and the first token)
        engine.step()
    for _ in range(5):  # steady state
        engine.step()
    gpu = engine.device.type == "cuda"
    walls, devs, api_rows = [], [], []
    if gpu:  # device busy time: the kernels' own durations over a few steps
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as tp:
            for _ in range(10):
                engine.step()
            torch.cuda.synchronize()
        averages = tp.key_averages()
        busy_us = sum(e.self_device_time_total for e in averages)
        devs.append(busy_us / 10 / 1e6)
        # the CUDA runtime calls the host made (launches, copies, waits): host µs a step each
        api = sorted((e for e in averages if e.key.startswith("cuda")), key=lambda e: -e.self_cpu_time_total)
        api_rows = [(e.key, e.count / 10, e.self_cpu_time_total / 10) for e in api[:12]]
    prof = cProfile.Profile()
    for i in range(args.steps):
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if i >= args.steps // 2:
            prof.enable()
        report = engine.step()
        if i >= args.steps // 2:
            prof.disable()
        if gpu:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        if any(r.finished for r in report.results.values()):
            raise RuntimeError("a request finished inside the profile: raise max_new_tokens")
    for rid in rids:
        engine.abort(rid)
        built.source.release(rid)
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s).sort_stats("tottime")
    st.print_stats(args.top)
    s2 = io.StringIO()
    pstats.Stats(prof, stream=s2).sort_stats("cumulative").print_stats(args.top)
    walls.sort()
    devs.sort()
    med = lambda xs: xs[len(xs) // 2] if xs else float("nan")  # noqa: E731
    return {"batch": batch, "k": k, "wall_ms": med(walls) * 1e3, "device_ms": med(devs) * 1e3,
            "tottime": s.getvalue(), "cumulative": s2.getvalue(), "cuda_api": api_rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--model", help="profile this model (a folder, a hub id or 'demo') with its own draft instead of a random --shape")
    p.add_argument("--batch", default="1,64")
    p.add_argument("--k", default="0,3")
    p.add_argument("--accept", type=int, default=3, help="forced acceptance for k > 0")
    p.add_argument("--fused-spec-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="worker setting fused_spec_steps: a greedy speculative step as one graph (default on)")
    p.add_argument("--fused-spec-graphs", choices=("one", "split"), default="split",
                   help="worker setting fused_spec_graphs: the fused step as one graph, or a graph per chain position and one for the verify")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.batch = [int(x) for x in args.batch.split(",")]
    ks = [int(x) for x in args.k.split(",")]
    from services.gpuworker.build import build_engine
    from services.gpuworker.engine.capacity import LocalBlockSource

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir, facts = args.model, {}
        else:
            model_dir = Path(tmp) / "model"
            model_dir.mkdir()
            facts = build_model(args.shape, model_dir, args.device, 0)
        models = None
        for k in ks:
            settings = settings_for(args, model_dir, k)
            built = build_engine(settings, lambda n: LocalBlockSource(n, settings.block_size), models=models)
            models = (built.target, built.draft)
            built.engine.warmup()
            for b in args.batch:
                row = profile_one(built, b, k, args)
                rows.append(row)
                print(f"\n==== batch {b} k {k}: step wall {row['wall_ms']:.2f} ms, device {row['device_ms']:.2f} ms")
                for name, calls, us in row["cuda_api"]:
                    print(f"  {name:<40} {calls:6.1f} calls/step {us:8.1f} us/step")
                print(row["tottime"][:6000])
                print(row["cumulative"][:6000])
            del built
    if "params" in facts:
        print(f"\nmodel {facts['params'] / 1e6:.0f}M params")
    print(f"{'batch':>5} {'k':>2} {'wall ms':>8} {'device ms':>9} {'host share':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['k']:>2} {r['wall_ms']:>8.2f} {r['device_ms']:>9.2f} "
              f"{1 - r['device_ms'] / r['wall_ms'] if r['device_ms'] == r['device_ms'] else float('nan'):>10.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
