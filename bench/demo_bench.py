"""Acceptance length and tokens/s of the shipped demo model + its EAGLE-3 draft, k = 0 vs k > 0,
greedy, on held-out standard-library text (files the model and draft never trained on).

    held-out stdlib files ──evenly spaced windows──▶ prompts (BOS + --prompt-len bytes)
    engine alone (build_engine: the worker's own recipe, local block source), batch B:
        k = 0   plain greedy decoding            -> tokens/s
        k = K   EAGLE-3 speculative decoding     -> tokens/s, acceptance length (1 + accepted / verify)
    outputs of every k must be token-identical (greedy speculation changes nothing but speed)

``--served``: the same prompts through the served path instead, as processes (kvstore + one
``tandem worker`` + the router, ``bench/_common.start_suite``), one request after another (or
``--batch`` at once) over gRPC ``Router.Generate``; acceptance length from the worker's Usage
(tokens per target forward), tokens/s = completion tokens / wall time. Every prompt is sent once
untimed first (warm-up; the prompts' KV is then cached in the kvstore for every k alike).

Usage (CPU; ``--device cuda:0`` on a GPU box picks FlashInfer + bf16 when the head size has
kernels, else the torch backend)::

    python bench/demo_bench.py --out docs/demo_bench.json --png docs/img/demo_bench.png
    python bench/demo_bench.py --served --out docs/demo_served_cpu.json --png docs/img/demo_served_cpu.png
    python bench/demo_bench.py --served --device cuda:0 --out demo_served_h200.json --png demo_served_h200.png
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, pyspy_binary  # noqa: E402


def _backend(args) -> str:
    """The worker's own choice (tandem up's): FlashInfer on CUDA where it has kernels for the head size."""
    from services.gpuworker.model.loader import plan_model
    from services.launch_plan import FLASHINFER_HEAD_DIMS

    head_dim = plan_model(args.model).config.head_dim
    return "flashinfer" if args.device.startswith("cuda") and head_dim in FLASHINFER_HEAD_DIMS else "torch"


def _prompts(args) -> list[list[int]]:
    from services.common.tokenizer import ByteTokenizer
    from services.gpuworker.train_demo import held_out_text

    return [ByteTokenizer().encode(t)[: args.prompt_len + 1] for t in held_out_text(args.prompts, args.prompt_len)]


def run(args) -> dict:
    import torch

    from services.gpuworker.build import build_engine
    from services.gpuworker.engine.capacity import LocalBlockSource, blocks_for
    from services.gpuworker.engine.local import LocalSetup, generate
    from services.gpuworker.settings import WorkerSettings
    from services.common.tokenizer import ByteTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = args.device.startswith("cuda")
    tok = ByteTokenizer()
    prompts = _prompts(args)
    per = blocks_for(args.prompt_len + 1 + args.max_new_tokens + max(args.k) + 1, 16)
    num_blocks = args.batch * per + 8
    setups, models = {}, None
    ks = [0, *args.k]
    backend = _backend(args)
    for k in ks:
        settings = WorkerSettings(model=args.model, spec_mode="eagle3", device=args.device,
                                  backend=backend, num_blocks=num_blocks)
        source = LocalBlockSource(num_blocks, settings.block_size)
        built = build_engine(settings, lambda _n: source, models=models)
        models = (built.target, built.draft)
        setups[k] = LocalSetup(built.engine, source, built.target, built.draft)
        if gpu:
            built.engine.warmup()
        generate(setups[k], prompts[: args.batch], max_new_tokens=8, k=k)  # warm-up, not timed
    # the machine may be shared: every repeat runs each k once, interleaved; medians reported
    walls = {k: [] for k in ks}
    outputs, stats = {}, {}
    for _ in range(args.repeats):
        for k in ks:
            done, wall = [], 0.0
            for i in range(0, len(prompts), args.batch):
                start = time.perf_counter()
                done += generate(setups[k], prompts[i : i + args.batch], max_new_tokens=args.max_new_tokens, k=k)
                wall += time.perf_counter() - start
            walls[k].append(wall)
            outputs[k] = [c.tokens for c in done]
            stats[k] = (sum(c.decode_steps for c in done), sum(c.accepted_drafts for c in done),
                        sum(len(c.tokens) for c in done), len(done))
    rows = []
    for k in ks:
        steps, accepted, tokens, n = stats[k]
        med = statistics.median(walls[k])
        row = {"k": k, "batch": args.batch, "requests": n, "tokens": tokens, "repeats": args.repeats,
               "wall_s_median": round(med, 3), "wall_s_all": [round(w, 3) for w in walls[k]],
               "tokens_per_s": round(tokens / med, 1),
               "acceptance_length": round((steps + accepted) / max(steps, 1), 3) if k else 1.0,
               "identical_to_k0": outputs[k] == outputs[0]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    sample = tok.decode(prompts[0] + outputs[0][0])
    return {"machine": machine(), "command": " ".join(sys.argv), "model": args.model, "device": args.device,
            "path": "engine alone", "backend": backend,
            "dtype": settings.torch_dtype_name, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
            "rows": rows, "sample": sample}


def profile(suite, k: int, log_dir: Path) -> list[subprocess.Popen]:
    """``--profile K``: py-spy records the worker's engine process during the first timed repeat
    of k, twice: where it holds the GIL (``pyspy_k{K}_gil.txt``: where the host time goes) and
    every thread including where it waits (``pyspy_k{K}_idle.txt``: why the engine thread is not
    stepping); collapsed stacks beside the suite logs; the GIL file's summary is printed at the
    end (``bench/pyspy_summary.py`` reads either). Two samplers slow that repeat a little: the
    median of the repeats absorbs it."""
    # the worker's busiest child is its engine process (another child is multiprocessing's
    # helper); on CPU the engine is a thread of the worker itself
    cpu, pids = suite.cpu_seconds(), suite.pids()
    kids = [(cpu.get(name, 0.0), pid) for name, pid in pids if name.startswith("worker") and "." in name]
    engine = max(kids)[1] if kids else next(pid for name, pid in pids if name.startswith("worker"))
    return [subprocess.Popen([pyspy_binary(), "record", "--pid", str(engine), "--rate", "500", "--format", "raw",
                              "--threads", "--nonblocking", mode, "-o", str(log_dir / f"pyspy_k{k}_{mode[2:]}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for mode in ("--gil", "--idle")]


def run_served(args) -> dict:
    """The same measurement through the served path: kvstore + worker + router as processes."""
    import asyncio
    import tempfile

    import grpc

    from _common import start_suite
    from services.common.tokenizer import ByteTokenizer
    from services.common.wire import tokens_to_proto
    from tandem.router.v1 import router_pb2, router_pb2_grpc

    prompts = _prompts(args)
    backend = _backend(args)
    gpu = args.device.startswith("cuda")
    per = -(-(args.prompt_len + 2 + args.max_new_tokens + max(args.k) + 1) // 16)
    worker = ["--model", args.model, "--spec-mode", "eagle3", "--device", args.device, "--backend", backend,
              "--dtype", "auto", "--num-blocks", str(len(prompts) * per + 64)]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    ks = [0, *args.k]
    log_dir = Path(tempfile.mkdtemp(prefix="demo-served-"))
    print(f"suite logs: {log_dir}; worker {' '.join(worker)}", flush=True)
    suite = start_suite(log_dir, [worker], ["--model", args.model], worker_env=env, timeout_s=args.startup_timeout_s)

    async def one(stub, prompt, k, rid):
        req = router_pb2.GenerateRequest(token_ids=tokens_to_proto(prompt), max_new_tokens=args.max_new_tokens,
                                         num_draft_tokens=k, request_id=rid, temperature=0.0)
        tokens, usage = [], None
        async for msg in stub.Generate(req, timeout=600):
            tokens += list(msg.token_ids)
            if msg.HasField("usage"):
                usage = msg.usage
        return tokens, usage

    async def batch(stub, k, tag):
        out = []
        for i in range(0, len(prompts), args.batch):
            part = prompts[i : i + args.batch]
            out += await asyncio.gather(*(one(stub, p, k, f"{tag}-k{k}-{i + j}") for j, p in enumerate(part)))
        return out

    async def main():
        walls = {k: [] for k in ks}
        outputs, stats = {}, {}
        async with grpc.aio.insecure_channel(suite.router) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for k in ks:  # warm-up: every prompt once (kernels, caches), untimed
                await batch(stub, k, "warm")
            for r in range(args.repeats):  # interleaved repeats: a shared machine drifts
                for k in ks:
                    profilers = profile(suite, k, log_dir) if r == 0 and k in args.profile else []
                    start = time.perf_counter()
                    done = await batch(stub, k, f"r{r}")
                    walls[k].append(time.perf_counter() - start)
                    for profiler in profilers:
                        profiler.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
                    for profiler in profilers:
                        profiler.wait(timeout=30)
                    outputs[k] = [t for t, _ in done]
                    steps = sum(u.decode_steps for _, u in done)
                    produced = sum(u.mean_acceptance_length * u.decode_steps for _, u in done)
                    stats[k] = (steps, produced, sum(len(t) for t, _ in done), len(done),
                                sum(u.cached_tokens for _, u in done), sum(u.prompt_tokens for _, u in done))
        return walls, outputs, stats

    try:
        walls, outputs, stats = asyncio.run(main())
    finally:
        suite.stop()
    for k in args.profile:
        path = log_dir / f"pyspy_k{k}_gil.txt"
        if path.exists():
            from pyspy_summary import summarize

            print(summarize(path, 45, "engine"), flush=True)
    rows = []
    for k in ks:
        steps, produced, tokens, n, cached, prompt_tokens = stats[k]
        med = statistics.median(walls[k])
        row = {"k": k, "batch": args.batch, "requests": n, "tokens": tokens, "repeats": args.repeats,
               "wall_s_median": round(med, 3), "wall_s_all": [round(w, 3) for w in walls[k]],
               "tokens_per_s": round(tokens / med, 1),
               "acceptance_length": round(produced / max(steps, 1), 3) if k else 1.0,
               "cached_prompt_fraction": round(cached / max(prompt_tokens, 1), 3),
               "identical_to_k0": outputs[k] == outputs[0]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    speedup = {f"k{k}_over_k0": round(rows[i]["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
               for i, k in enumerate(ks) if k}
    print(json.dumps(speedup), flush=True)
    sample = ByteTokenizer().decode(prompts[0] + outputs[0][0])
    return {"machine": machine(), "command": " ".join(sys.argv), "model": args.model, "device": args.device,
            "path": "served (kvstore + worker + router processes, gRPC)", "backend": backend,
            "dtype": "bfloat16" if gpu else "float32", "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens, "rows": rows, "speedup": speedup, "sample": sample}


def plot(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    labels = [f"k={r['k']}" for r in rows]
    a.bar(labels, [r["tokens_per_s"] for r in rows], color=["#888"] + ["#2a7"] * (len(rows) - 1))
    a.set_ylabel("tokens/s")
    a.set_title(f"demo model, {result['device']}, batch {rows[0]['batch']}"
                + (", served" if result.get("path", "").startswith("served") else ""))
    b.bar(labels, [r["acceptance_length"] for r in rows], color=["#888"] + ["#27a"] * (len(rows) - 1))
    b.axhline(2.0, ls="--", c="k", lw=0.8)
    b.set_ylabel("acceptance length (tokens / verify)")
    b.set_title("held-out stdlib text, greedy")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--k", type=int, nargs="+", default=[3])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every k (medians reported)")
    ap.add_argument("--served", action="store_true", help="through the served path (kvstore + worker + router processes)")
    ap.add_argument("--profile", type=int, nargs="*", default=[],
                    help="--served: py-spy the worker's engine (GIL holders) during these k's first timed repeat")
    ap.add_argument("--startup-timeout-s", type=float, default=600.0, help="--served: load + warm-up before SERVING")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    result = run_served(args) if args.served else run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
