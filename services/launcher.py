"""``tandem up``: the whole suite on this machine, without Docker.

Starts one kvstore, N gpuworkers and one router (``--router-procs M``: a router of M processes on
one port, ``tandem router --procs``) as child processes, waits until every
``grpc.health.v1`` check says SERVING, prints the endpoints, optionally runs a demo request, and
supervises until Ctrl-C/SIGTERM:

* every fixed port is checked BEFORE anything starts: a busy port is a one-line error (exit 3),
  so the demo never runs against someone else's suite that holds the ports; a port left to us
  (``--router-port 0`` ...) is picked free, and a child that loses it to another process before it
  binds (it exits 3) is started again on another (:func:`_await_serving`);
* a worker that dies is restarted with backoff (1 s, 2 s, 4 s ... 30 s; the count resets once a
  worker stayed up for a while); the kvstore or router dying stops the suite (exit 1);
* stopping goes router → workers → kvstore, each group drained before the next is signalled, so
  no new work arrives while workers finish and the kvstore outlives every worker that talks to it;
* mutual TLS inside the suite by default: a throwaway CA (``services.common.certs``) signs one
  certificate per service (role + id), handed to each child through ``TANDEM_*_TLS_*`` variables;
  ``--insecure`` turns it off (every caller that reaches a port is then trusted). Clients reach
  the router in plaintext on localhost, authenticated by bearer tokens.

Where workers go (CPU, or one per GPU with FlashInfer and bf16) is :mod:`services.launch_plan`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.paths import distilled_tiny_dir
from services.common.server import INSTANCE_ENV, instance_service
from services.common.settings import add_settings_flags, invalid_configuration, report_startup_error, settings_from_args
from services.common.startup import EXIT_ENVIRONMENT, EXIT_FAILURE, PortInUse, StartupError, check_port_free, port_held
from services.launch_plan import WorkerPlan, detect_gpus, installed_capabilities, plan_workers

DEMO_PROMPT = "import os\n\n\ndef read_config(path):\n    "
CPU_NUM_BLOCKS = 1024
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
STABLE_AFTER_S = 30.0  # a worker up this long counts as healthy again (its backoff resets)
AUTO_PORT_TRIES = 3  # starts of a child whose picked port another process took before it bound


class UpSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_UP_", extra="forbid", protected_namespaces=())

    workers: int = Field(0, ge=0, description="gpuworkers to start (0 = one per usable GPU, 1 on CPU)")
    model: str = Field("demo", min_length=1, description="model folder, hub id (org/name), 'demo' (the shipped byte-level model trained on Python's stdlib, with its EAGLE-3 draft) or 'tiny' (random weights)")
    revision: str = Field("", description="hub revision of --model ('' = main)")
    spec_mode: Literal["none", "eagle3", "mtp"] = Field("eagle3", description="draft kind of every worker")
    draft_model: str = Field("", description="draft of every worker: folder or hub id (public EAGLE-3 layout), 'random' (benchmarks), '' = the model's own")
    draft_revision: str = Field("", description="hub revision of --draft-model ('' = main)")
    num_draft_tokens: int | None = Field(None, ge=0, le=32, description="draft tokens per step (k) every worker advertises (tandem worker --num-draft-tokens; unset: the draft's recommendation, else 3)")
    stream_interval: int | None = Field(None, ge=1, le=64, description="tokens each worker streams a request at a time after its first (tandem worker --stream-interval; unset: 1, every step's tokens as they come)")
    served_model_name: str = Field("", max_length=128, description="explicit model identity of every worker (mixed into the KV-cache namespace)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = CUDA when a GPU is visible")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="unset: bfloat16 on CUDA, float32 on CPU")
    kv_memory_fraction: float | None = Field(None, gt=0, le=1, description="KV share of free GPU memory per worker (unset: 0.9 on CUDA)")
    num_blocks: int | None = Field(None, ge=0, description=f"paired KV blocks per worker (unset: {CPU_NUM_BLOCKS} on CPU, sized by kv_memory_fraction on CUDA)")
    host: str = Field("127.0.0.1", description="address every service binds")
    router_port: int = Field(50050, ge=0, le=65535, description="router port (0 = any free port)")
    http_port: int = Field(8000, ge=0, le=65535, description="router's OpenAI-compatible HTTP API port (0 = any free port)")
    http: bool = Field(True, description="serve the OpenAI-compatible HTTP API (--no-http: gRPC only)")
    kvstore_port: int = Field(50051, ge=0, le=65535, description="kvstore port (0 = any free port)")
    worker_base_port: int = Field(50061, ge=0, le=65535, description="first worker port (0 = any free ports)")
    router_procs: int = Field(1, ge=1, le=256, description="router processes on the router's port (tandem router --procs: SO_REUSEPORT, one event loop each; clients need several connections to use them all)")
    metrics_base_port: int = Field(0, ge=0, le=65535, description="kvstore metrics on this port, router process j +1+j, worker i +1+router_procs+i (0 = off)")
    demo: bool = Field(False, description="run a demo request twice once everything is up")
    exit_after_demo: bool = Field(False, description="stop the suite after the demo (for scripts)")
    startup_timeout_s: float = Field(300.0, gt=0, description="give up if not SERVING by then")
    insecure: bool = Field(False, description="no mTLS between the services (default: a throwaway local CA and one certificate per service)")
    certs_dir: str = Field("", description="where the throwaway CA and certificates go ('' = a temporary folder removed on exit)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, UpSettings)


@dataclass
class Child:
    name: str
    address: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen
    started_at: float
    failures: int = 0  # restarts in a row without staying up STABLE_AFTER_S
    restart_at: float | None = None
    auto_ports: tuple[str, ...] = ()  # flags of argv whose port we picked (the user asked for 0)
    instance: str = ""  # its health answers for services.common.server.instance_service(instance)


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _spawn(name: str, argv: list[str], address: str, env: dict[str, str] | None = None,
           auto_ports: tuple[str, ...] = ()) -> Child:
    """Start ``tandem <argv>`` (argv starts with the global flags, e.g. --log-level), named by a
    fresh instance id that its health service answers for (so that a SERVING answer on its port
    is known to be its own, not another process's that holds the port)."""
    env = dict(env or {})
    instance = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", *argv],
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **env, **{INSTANCE_ENV: instance}),
                            start_new_session=True)
    return Child(name, address, argv, env, proc, time.monotonic(), auto_ports=auto_ports, instance=instance)


def _lost_a_picked_port(child: Child) -> bool:
    """Whether ``child`` (exited) failed because a port WE picked for it is held by another
    process now (pure but for the probe binds). Exit code 3 alone says only "the environment":
    a missing model or a taken port the user named exits 3 as well, and must not be retried."""
    if child.proc.poll() != EXIT_ENVIRONMENT:
        return False
    host = child.address.rsplit(":", 1)[0]
    return any(port_held(host, int(child.argv[child.argv.index(flag) + 1])) for flag in child.auto_ports)


def _on_fresh_ports(child: Child) -> Child:
    """``child`` started again with new free ports for the ones we had picked."""
    host = child.address.rsplit(":", 1)[0]
    argv = list(child.argv)
    for flag in child.auto_ports:
        argv[argv.index(flag) + 1] = str(_free_port(host))
    fresh = _spawn(child.name, argv, f"{host}:{argv[argv.index('--port') + 1]}", child.env, child.auto_ports)
    fresh.failures = child.failures
    return fresh


def _await_serving(children: list[Child], i: int, deadline: float, credentials=None) -> None:
    """:func:`wait_serving` for ``children[i]`` (mutates ``children``). A port we picked free can
    be taken by another process before the child (seconds of imports later) binds it; the child
    then exits with EXIT_ENVIRONMENT ("... is already in use") and is started again on freshly
    picked ports, replacing ``children[i]``, at most AUTO_PORT_TRIES starts in all. A port the
    user chose is never changed: its failure stands."""
    for attempt in range(1, AUTO_PORT_TRIES + 1):
        child = children[i]
        try:
            wait_serving(child.address, deadline, child.proc, credentials, instance=child.instance)
            return
        except StartupError:
            if attempt == AUTO_PORT_TRIES or not _lost_a_picked_port(child):
                raise
        print(f"tandem up: {child.name} exited with code {EXIT_ENVIRONMENT}: another process took a port picked for it "
              f"before it bound it; starting it again on other ports (start {attempt + 1} of {AUTO_PORT_TRIES})",
              file=sys.stderr, flush=True)
        children[i] = _on_fresh_ports(child)


def restart_delay(failures: int) -> float:
    """Seconds before the ``failures``-th restart in a row (1, 2, 4 ... capped at 30)."""
    return min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** max(0, failures - 1))


def tls_env(files, prefix: str) -> dict[str, str]:
    """The ``TANDEM_<SERVICE>_TLS_*`` variables that hand a child its certificate (pure)."""
    return {f"{prefix}TLS_CERT": files.cert, f"{prefix}TLS_KEY": files.key, f"{prefix}TLS_CA": files.ca}


def make_suite_certs(directory: str, workers: int):
    """A fresh CA and certificates for the kvstore, the router, ``workers`` workers and this
    launcher's health probes (``client/launcher``); returns {name: CertFiles}."""
    from services.common.certs import LocalCA

    ca = LocalCA(days=7)
    files = {"kvstore": ca.write(directory, "kvstore", "kvstore"), "router": ca.write(directory, "router", "router"),
             "launcher": ca.write(directory, "client", "launcher")}
    for i in range(workers):
        files[f"worker{i}"] = ca.write(directory, "worker", f"worker{i}")
    return files


def _probe_credentials(files):
    if files is None:
        return None
    from services.common.auth import load_channel_credentials

    probe = files["launcher"]
    return load_channel_credentials(probe.ca, probe.cert, probe.key)


def wait_serving(address: str, deadline: float, proc: subprocess.Popen | None = None, credentials=None,
                 instance: str = "") -> None:
    """Poll grpc.health.v1 at ``address`` until SERVING; raise if the deadline passes or ``proc``
    dies. ``instance``: ask for the health of that instance name (``services.common.server.
    instance_service``), which only the process started with it answers: another process that
    holds the port (and would answer SERVING for the whole server) does not count."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    service = instance_service(instance) if instance else ""

    def dead() -> bool:
        return proc is not None and proc.poll() is not None

    channel = grpc.secure_channel(address, credentials) if credentials is not None else grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if dead():
                raise StartupError(f"{address}: process exited with code {proc.returncode} (its log is above)", EXIT_FAILURE)
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    time.sleep(0.05)
                    if not dead():
                        return
                    continue
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise StartupError(f"{address} not SERVING by the start-up deadline (--startup-timeout-s)", EXIT_FAILURE)
            time.sleep(0.2)


def stop_children(children: list[Child], timeout_s: float = 10.0) -> list[str]:
    """Stop router → workers → kvstore: SIGTERM a group, wait for it (SIGKILL after ``timeout_s``),
    then the next. Returns the names in the order they were stopped."""
    order = [[c for c in children if c.name == "router"],
             [c for c in children if c.name.startswith("worker")],
             [c for c in children if c.name == "kvstore"]]
    stopped = []
    for group in order:
        for child in group:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout_s
        for child in group:
            try:
                child.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            stopped.append(child.name)
            print(f"stopped {child.name} (exit code {child.proc.returncode})", flush=True)
    return stopped


def _metrics(s: UpSettings, offset: int) -> list[str]:
    return ["--metrics-port", str(s.metrics_base_port + offset)] if s.metrics_base_port else []


def worker_metrics_offset(s: UpSettings, index: int) -> int:
    """Where worker ``index``'s metrics port lies past ``metrics_base_port`` (pure): after the
    kvstore's and one per router process (``tandem router --procs N`` serves process j's on its
    port + j)."""
    return 1 + s.router_procs + index


def check_ports(s: UpSettings, workers: int) -> None:
    """Raise :class:`PortInUse` for the first fixed port something else holds."""
    wanted = [("kvstore port", s.kvstore_port), ("router port", s.router_port)]
    if s.http and s.http_port:
        wanted.append(("router HTTP port", s.http_port))
    if s.worker_base_port:
        wanted += [(f"worker{i} port", s.worker_base_port + i) for i in range(workers)]
    if s.metrics_base_port:
        wanted += [("metrics port", s.metrics_base_port + i) for i in range(worker_metrics_offset(s, workers))]
    for what, port in wanted:
        try:
            check_port_free(s.host, port, what)
        except PortInUse as exc:
            raise StartupError(f"{exc.message}; is another Tandem suite running? (`tandem up --help` lists the port flags)") from None


def worker_argv(s: UpSettings, plan: WorkerPlan, port: int, kv_addr: str) -> list[str]:
    num_blocks = s.num_blocks if s.num_blocks is not None else (CPU_NUM_BLOCKS if plan.device == "cpu" else 0)
    return ["worker", "--host", s.host, "--port", str(port), "--kvstore", kv_addr, "--worker-id", f"worker{plan.index}",
            "--model", s.model, "--spec-mode", s.spec_mode, "--num-blocks", str(num_blocks), *plan.flags(),
            *(["--draft-model", s.draft_model] if s.draft_model else []),
            *(["--revision", s.revision] if s.revision else []),
            *(["--draft-revision", s.draft_revision] if s.draft_revision else []),
            *(["--num-draft-tokens", str(s.num_draft_tokens)] if s.num_draft_tokens is not None else []),
            *(["--stream-interval", str(s.stream_interval)] if s.stream_interval is not None else []),
            *(["--served-model-name", s.served_model_name] if s.served_model_name else []),
            *_metrics(s, worker_metrics_offset(s, plan.index))]


def router_argv(s: UpSettings, port: int, kv_addr: str, http_port: int | None) -> list[str]:
    """``tandem router`` flags of the suite's router (pure; ``http_port`` None = no HTTP front)."""
    return ["router", "--host", s.host, "--port", str(port), "--kvstore", kv_addr, "--model", s.model,
            *(["--revision", s.revision] if s.revision else []),
            *(["--http-port", str(http_port)] if http_port is not None else []),
            *(["--procs", str(s.router_procs)] if s.router_procs > 1 else []),
            *_metrics(s, 1)]


def start_suite(s: UpSettings, plans: list[WorkerPlan], log_level: str = "INFO", certs_dir: str | None = None) -> list[Child]:
    """Start kvstore, workers and router (with mTLS unless ``s.insecure``: certificates go to
    ``certs_dir``); return them once all are SERVING."""
    check_ports(s, len(plans))
    host = s.host
    flags = ["--log-level", log_level]
    children: list[Child] = []
    certs = None if s.insecure else make_suite_certs(certs_dir or s.certs_dir or tempfile.mkdtemp(prefix="tandem-certs-"), len(plans))
    probe = _probe_credentials(certs)

    def env(name: str, prefix: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**(extra or {}), **(tls_env(certs[name], prefix) if certs else {})}

    try:
        kv_port = s.kvstore_port or _free_port(host)
        children.append(_spawn("kvstore", [*flags, "kvstore", "--host", host, "--port", str(kv_port), *_metrics(s, 0)],
                               f"{host}:{kv_port}", env("kvstore", "TANDEM_KVSTORE_"), _auto(s.kvstore_port == 0, "--port")))
        deadline = time.monotonic() + s.startup_timeout_s
        _await_serving(children, 0, deadline, probe)
        kv_addr = children[0].address
        for plan in plans:
            port = s.worker_base_port + plan.index if s.worker_base_port else _free_port(host)
            children.append(_spawn(f"worker{plan.index}", [*flags, *worker_argv(s, plan, port, kv_addr)], f"{host}:{port}",
                                   env(f"worker{plan.index}", "TANDEM_WORKER_", plan.env), _auto(s.worker_base_port == 0, "--port")))
        r_port = s.router_port or _free_port(host)
        http_port = (s.http_port or _free_port(host)) if s.http else None
        children.append(_spawn("router", [*flags, *router_argv(s, r_port, kv_addr, http_port)], f"{host}:{r_port}",
                               env("router", "TANDEM_ROUTER_"),
                               _auto(s.router_port == 0, "--port") + _auto(s.http and s.http_port == 0, "--http-port")))
        for i in range(1, len(children)):
            # the router's client side is plaintext (bearer tokens); the workers need a certificate
            _await_serving(children, i, deadline, None if children[i].name == "router" else probe)
        return children
    except BaseException:
        stop_children(children)
        raise


def _auto(picked: bool, flag: str) -> tuple[str, ...]:
    return (flag,) if picked else ()


def http_url(router: Child) -> str | None:
    """The router's HTTP front as ``tandem up`` started it (from its argv), or None."""
    if "--http-port" not in router.argv:
        return None
    host = router.address.rsplit(":", 1)[0]
    return f"http://{host}:{router.argv[router.argv.index('--http-port') + 1]}"


def supervise_once(children: list[Child], now: float) -> str | None:
    """One supervision pass (mutates ``children``): schedule or perform worker restarts. Returns
    the name of a dead kvstore/router (the suite must stop), else None."""
    for i, child in enumerate(children):
        code = child.proc.poll()
        if code is None:
            if child.failures and now - child.started_at >= STABLE_AFTER_S:
                child.failures = 0
            continue
        if not child.name.startswith("worker"):
            return child.name
        if child.restart_at is None:
            child.failures += 1
            child.restart_at = now + restart_delay(child.failures)
            print(f"tandem up: {child.name} exited with code {code}; restarting in {child.restart_at - now:.0f} s "
                  f"(restart {child.failures} in a row)", file=sys.stderr, flush=True)
        elif now >= child.restart_at:
            if _lost_a_picked_port(child):  # it would fail the same way on the same port
                fresh = _on_fresh_ports(child)
            else:
                fresh = _spawn(child.name, child.argv, child.address, child.env, child.auto_ports)
                fresh.failures = child.failures
            children[i] = fresh
            print(f"tandem up: {child.name} restarted (pid {fresh.proc.pid})", flush=True)
    return None


def choose_workers(s: UpSettings, head_dim: int | None = None) -> list[WorkerPlan]:
    gpus = [] if s.device == "cpu" else detect_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))
    cuda_torch, flashinfer = installed_capabilities() if gpus or s.device == "cuda" else (False, False)
    plans, notes = plan_workers(device=s.device, gpus=gpus, workers=s.workers, kv_memory_fraction=s.kv_memory_fraction,
                                dtype=s.dtype, cuda_torch=cuda_torch, flashinfer=flashinfer, head_dim=head_dim)
    for note in notes:
        print(f"tandem up: {note}", file=sys.stderr)
    return plans


def check_model(s: UpSettings) -> int:
    """Refuse a model / spec mode / draft that cannot go together before starting anything (the
    workers would exit with the same line, and be restarted, again and again). Returns the
    model's head_dim (which attention backend can run it)."""
    from pydantic import ValidationError

    from services.gpuworker.build import preflight
    from services.gpuworker.settings import WorkerSettings

    try:
        worker = WorkerSettings(model=s.model, spec_mode=s.spec_mode, draft_model=s.draft_model, revision=s.revision,
                                draft_revision=s.draft_revision, num_draft_tokens=s.num_draft_tokens)
    except ValidationError as exc:  # a combination the workers refuse, named with tandem up's flags
        raise invalid_configuration(UpSettings, exc, WorkerSettings) from None
    plan = preflight(worker)
    return plan.config.head_dim


def run(args: argparse.Namespace) -> int:
    try:
        s = settings_from_args(UpSettings, args)
        if s.model == "tiny":
            distilled = distilled_tiny_dir(s.spec_mode)
            if (distilled / "config.json").is_file():
                s.model = str(distilled)
                print(f"serving the tiny model with its distilled draft from {distilled}")
            elif s.spec_mode != "none":
                print("serving the tiny model with a random draft (run `tandem distill-draft tiny` for a trained one)")
        head_dim = check_model(s)
        plans = choose_workers(s, head_dim)
        where = "CPU" if plans[0].device == "cpu" else f"{len(plans)} GPU(s), {plans[0].backend}, {plans[0].dtype}"
        print(f"starting kvstore, {len(plans)} worker(s) on {where} and router (model {s.model}) ...", flush=True)
        certs_dir = None
        if not s.insecure:
            certs_dir = s.certs_dir or tempfile.mkdtemp(prefix="tandem-certs-")
            print(f"mTLS between the services: throwaway CA and certificates in {certs_dir} (--insecure turns it off)")
        else:
            print("--insecure: no TLS between the services; anyone who reaches their ports is trusted")
        try:
            children = start_suite(s, plans, getattr(args, "log_level", "INFO"), certs_dir)
        except BaseException:
            _remove_certs(s, certs_dir)
            raise
    except StartupError as exc:
        return report_startup_error("up", exc)
    try:
        return serve_suite(s, children)
    finally:
        _remove_certs(s, certs_dir)


def _remove_certs(s: UpSettings, certs_dir: str | None) -> None:
    if certs_dir and not s.certs_dir:  # a temporary CA dies with the suite
        shutil.rmtree(certs_dir, ignore_errors=True)


def serve_suite(s: UpSettings, children: list[Child]) -> int:
    router = children[-1].address
    print("all services SERVING:")
    for child in children:
        print(f"  {child.name:<9} {child.address}  (pid {child.proc.pid})")
    http = http_url(children[-1])
    if http:
        print(f"  OpenAI-compatible HTTP API: {http}/v1  (e.g. openai.OpenAI(base_url=\"{http}/v1\", api_key=\"none\"))")
    print(f'try:  tandem generate --router {router} "Hello"')
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        if s.demo:
            from services.client import generate_and_print

            for attempt in (1, 2):
                print(f"\n--- demo request {attempt} of 2 (the second reuses the first one's KV) ---", flush=True)
                code = generate_and_print(router, DEMO_PROMPT, max_new_tokens=160)
                if code:
                    break
        if not s.exit_after_demo:
            print("\nserving; Ctrl-C stops everything", flush=True)
            while not stopping:
                dead = supervise_once(children, time.monotonic())
                if dead:
                    print(f"tandem up: {dead} exited with code {next(c for c in children if c.name == dead).proc.returncode}; "
                          "stopping the suite", file=sys.stderr)
                    code = EXIT_FAILURE
                    break
                time.sleep(0.5)
    finally:
        print("stopping ...", flush=True)
        stop_children(children)
    return code
