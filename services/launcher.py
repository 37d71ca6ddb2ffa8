"""``tandem up``: the whole suite on this machine, without Docker.

Starts one kvstore, N gpuworkers and one router as child processes (embedded defaults: memory
kvstore, torch backend on CPU, the ``tiny`` model), waits until every ``grpc.health.v1`` check says
SERVING, prints the endpoints, optionally runs a demo request, and on Ctrl-C/SIGTERM stops the
children in reverse order (router first, so no new work arrives, kvstore last).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from services.common.paths import distilled_tiny_dir

DEMO_PROMPT = "Tandem pairs every target KV block with a draft KV block, so"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=int(os.environ.get("TANDEM_UP_WORKERS", 1)), help="gpuworkers to start (default 1)")
    parser.add_argument("--model", default=os.environ.get("TANDEM_UP_MODEL", "tiny"), help="model folder or 'tiny' (default)")
    parser.add_argument("--host", default="127.0.0.1", help="address every service binds")
    parser.add_argument("--router-port", type=int, default=50050, help="router port (0 = any free port)")
    parser.add_argument("--kvstore-port", type=int, default=50051, help="kvstore port (0 = any free port)")
    parser.add_argument("--worker-base-port", type=int, default=50061, help="first worker port (0 = any free ports)")
    parser.add_argument("--metrics-base-port", type=int, default=0,
                        help="serve Prometheus /metrics: kvstore on this port, router +1, worker i +2+i (0 = off)")
    parser.add_argument("--num-blocks", type=int, default=1024, help="paired KV blocks per worker")
    parser.add_argument("--demo", action="store_true", help="run a demo request twice once everything is up")
    parser.add_argument("--exit-after-demo", action="store_true", help="stop the suite after the demo (for scripts)")
    parser.add_argument("--startup-timeout-s", type=float, default=120.0, help="give up if not SERVING by then")


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: str = ""
    extra: dict = field(default_factory=dict)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port(host: str, wanted: int) -> int:
    return wanted if wanted else _free_port(host)


def _metrics(args: argparse.Namespace, offset: int) -> list[str]:
    """The ``--metrics-port`` flag of one child (none when ``--metrics-base-port`` is 0)."""
    return ["--metrics-port", str(args.metrics_base_port + offset)] if args.metrics_base_port else []


def _spawn(name: str, argv: list[str], address: str) -> Child:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", *argv], env=env, start_new_session=True)
    return Child(name, address, proc)


def wait_serving(address: str, deadline: float, proc: subprocess.Popen | None = None) -> None:
    """Poll grpc.health.v1 at ``address`` until SERVING; raise if the deadline passes or proc dies."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{address}: process exited with code {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after startup timeout")
            time.sleep(0.2)


def stop_children(children: list[Child], timeout_s: float = 10.0) -> None:
    """SIGTERM each child (reverse start order), then SIGKILL whatever is still alive."""
    for child in reversed(children):
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout_s
    for child in reversed(children):
        try:
            child.proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def start_suite(args: argparse.Namespace) -> list[Child]:
    """Start kvstore, workers and router; return them once all are SERVING."""
    host = args.host
    children: list[Child] = []
    try:
        kv_port = _port(host, args.kvstore_port)
        kv_addr = f"{host}:{kv_port}"
        children.append(_spawn("kvstore", ["kvstore", "--host", host, "--port", str(kv_port), *_metrics(args, 0)], kv_addr))
        deadline = time.monotonic() + args.startup_timeout_s
        wait_serving(kv_addr, deadline, children[-1].proc)
        for i in range(args.workers):
            port = args.worker_base_port + i if args.worker_base_port else _free_port(host)
            addr = f"{host}:{port}"
            argv = [
                "worker", "--host", host, "--port", str(port), "--kvstore", kv_addr,
                "--worker-id", f"worker{i}", "--model", args.model, "--num-blocks", str(args.num_blocks),
                *_metrics(args, 2 + i),
            ]
            children.append(_spawn(f"worker{i}", argv, addr))
        r_port = _port(host, args.router_port)
        r_addr = f"{host}:{r_port}"
        children.append(
            _spawn("router", ["router", "--host", host, "--port", str(r_port), "--kvstore", kv_addr, "--model", args.model,
                              *_metrics(args, 1)], r_addr)
        )
        for child in children[1:]:
            wait_serving(child.address, deadline, child.proc)
        return children
    except BaseException:
        stop_children(children)
        raise


def run(args: argparse.Namespace) -> int:
    if args.model == "tiny":
        distilled = distilled_tiny_dir()
        if (distilled / "config.json").is_file():
            args.model = str(distilled)
            print(f"serving the tiny model with its distilled draft from {distilled}")
        else:
            print("serving the tiny model with a random draft (run `tandem distill-draft tiny` for a trained one)")
    print(f"starting kvstore, {args.workers} worker(s) and router (model {args.model}) ...", flush=True)
    try:
        children = start_suite(args)
    except (RuntimeError, TimeoutError) as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    router = children[-1].address
    print("all services SERVING:")
    for child in children:
        print(f"  {child.name:<9} {child.address}  (pid {child.proc.pid})")
    print(f'try:  tandem generate --router {router} "Hello"')
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        if args.demo:
            from services.client import generate_and_print

            for attempt in (1, 2):
                print(f"\n--- demo request {attempt} of 2 (the second reuses the first one's KV) ---", flush=True)
                code = generate_and_print(router, DEMO_PROMPT, max_new_tokens=48)
                if code:
                    break
        if not args.exit_after_demo:
            print("\nserving; Ctrl-C stops everything", flush=True)
            while not stopping and all(c.proc.poll() is None for c in children):
                time.sleep(0.5)
            dead = [c.name for c in children if c.proc.poll() is not None]
            if dead and not stopping:
                print(f"tandem up: {', '.join(dead)} exited; stopping the suite", file=sys.stderr)
                code = 1
    finally:
        print("stopping ...", flush=True)
        stop_children(children)
    return code
