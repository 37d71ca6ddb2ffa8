"""Pieces the benchmarks share: the suite as child processes, machine facts, GPU timing, bar plots.

    start_suite(log_dir, [worker argv, ...], router argv)   kvstore + workers + router, all SERVING
    machine()                                               CPU, cores, load, date (for the JSON)
    gc_pauses_in(log_dir)                                   the services' logged GC pauses, per process
    gpu_ms(fn)                                              median CUDA-event time of fn()
    busy_processes([cpus, ...])                             spinning processes for a with block
    grouped_bars(ax, groups, series)                        one bar per series in each group

Imported by the scripts next to it (``python bench/x.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Suite:
    """The suite's child processes (kvstore, workers, router) and their addresses."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    kvstore: str = ""
    router: str = ""
    workers: list[str] = field(default_factory=list)

    def spawn(self, name: str, argv: list[str], log_dir: Path, env_extra: dict | None = None,
              log_level: str = "WARNING") -> None:
        # the repo first, then whatever the caller's path had (wheels unpacked elsewhere, say)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        log = open(log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "--log-level", log_level, *argv],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc))

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each live child has used so far (Linux /proc; {} elsewhere);
        a child's own children (a worker's engine process) as ``name.1``, ``name.2``, ..."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for name, pid in self.pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            except (OSError, IndexError, ValueError):
                pass
        return out

    def pids(self) -> list[tuple[str, int]]:
        """(name, pid) of each child and of its own children (``name.1``, ...; Linux /proc)."""
        out = []
        for name, proc in self.procs:
            out.append((name, proc.pid))
            kids = []
            try:
                for task in os.listdir(f"/proc/{proc.pid}/task"):
                    kids += [int(p) for p in Path(f"/proc/{proc.pid}/task/{task}/children").read_text().split()]
            except OSError:
                pass
            out += [(f"{name}.{i}", pid) for i, pid in enumerate(sorted(kids), 1)]
        return out

    def stop(self) -> None:
        """SIGTERM in reverse start order (router first), then SIGKILL stragglers (mutates procs)."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 10
        for _, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def pyspy_binary() -> str:
    """The py-spy to run: ``$PY_SPY``, on PATH, or beside this interpreter (``pip install
    --target`` puts it in ``bin/``)."""
    import shutil

    return os.environ.get("PY_SPY") or shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


def start_suite(log_dir: Path, workers: list[list[str]], router: list[str], *, env: dict | None = None,
                worker_env: dict | None = None, timeout_s: float = 120.0, log_level: str = "WARNING") -> Suite:
    """kvstore (memory) + one worker per argv in ``workers`` (``tandem worker`` flags besides
    port, kvstore and worker id) + the router (``router``: flags besides port and kvstore), as
    processes; each is SERVING (grpc health) before this returns. ``env``: extra environment of
    every process, ``worker_env`` of the workers only (on top of ``env``)."""
    from services.launcher import wait_serving

    suite = Suite()
    try:
        kv_port = free_port()
        suite.kvstore = f"127.0.0.1:{kv_port}"
        suite.spawn("kvstore", ["kvstore", "--port", str(kv_port)], log_dir, env, log_level)
        deadline = time.monotonic() + timeout_s
        wait_serving(suite.kvstore, deadline, suite.procs[-1][1])
        for i, argv in enumerate(workers):
            port = free_port()
            suite.workers.append(f"127.0.0.1:{port}")
            suite.spawn(f"worker{i}", ["worker", "--port", str(port), "--kvstore", suite.kvstore,
                                       "--worker-id", f"worker{i}", *argv], log_dir, {**(env or {}), **(worker_env or {})},
                        log_level)
        r_port = free_port()
        suite.router = f"127.0.0.1:{r_port}"
        suite.spawn("router", ["router", "--port", str(r_port), "--kvstore", suite.kvstore, *router], log_dir, env,
                    log_level)
        for addr, (_, proc) in zip([*suite.workers, suite.router], suite.procs[1:]):
            wait_serving(addr, deadline, proc)
        return suite
    except BaseException:
        suite.stop()
        raise


# a line of services.common.gc_tuning's, in the services' log format (a router child adds "[router i]")
_GC_PAUSE = re.compile(r"services\.common\.gc_tuning(?: \[[^]]*\])?: (?P<who>.+?): a generation-(?P<gen>\d) "
                       r"garbage collection stalled it (?P<ms>\d+) ms")
_GC_FROZEN = re.compile(r"services\.common\.gc_tuning(?: \[[^]]*\])?: (?P<who>.+?): (?P<n>\d+) start-up objects frozen")
GC_VISIBLE_MS = 5  # a collection this long shows in a stream's inter-token gaps


def gc_pauses_in(log_dir: Path) -> tuple[dict, dict]:
    """The garbage collections the suite's processes logged (``TANDEM_<SERVICE>_GC_WARN_MS`` sets
    how long one must be to be logged), per process as each names itself: how many, by generation,
    the longest, and those of ``GC_VISIBLE_MS`` or more; and each process's start-up heap as its
    freeze counted it (an INFO line: only with ``log_level="INFO"``). Reads the log files."""
    out: dict[str, dict] = {}
    heaps: dict[str, int] = {}
    for f in sorted(log_dir.glob("*.log")):
        for line in f.read_text(errors="replace").splitlines():
            frozen = _GC_FROZEN.search(line)
            if frozen:
                heaps[frozen["who"]] = int(frozen["n"])
            m = _GC_PAUSE.search(line)
            if not m:
                continue
            ms, who = int(m["ms"]), m["who"]
            row = out.setdefault(who, {"over_1ms": 0, "visible": 0, "visible_ms": 0, "longest_ms": 0, "by_generation": [0, 0, 0]})
            row["over_1ms"] += 1
            row["by_generation"][int(m["gen"])] += 1
            row["longest_ms"] = max(row["longest_ms"], ms)
            if ms >= GC_VISIBLE_MS:
                row["visible"] += 1
                row["visible_ms"] += ms
    return out, heaps


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "load_1m": load,
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def gpu_ms(fn, reps: int = 30, warmup: int = 3) -> float:
    """Median GPU time of ``fn()`` in ms (CUDA events around each call)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def grouped_bars(ax, groups: list[str], series: list[tuple[str, list[float]]], **bar_kw) -> list[list[float]]:
    """Side-by-side bars: for each group one bar per series (``(label, values per group)``).
    Returns each series' bar centres, for markers drawn on top."""
    width = 0.8 / len(series)
    centres = []
    for i, (name, vals) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, vals, width, label=name, **bar_kw)
        centres.append(xs)
    ax.set_xticks(range(len(groups)), groups)
    return centres


def cpu_jiffies() -> tuple[int, int]:
    """(steal, total) clock ticks of the whole machine so far (/proc/stat; (0, 0) elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the machine's CPU time the hypervisor gave to others between two
    ``cpu_jiffies`` readings (0 where unknown): a virtual machine's host busy elsewhere."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set (pure)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def siblings(cpu: int) -> set[int]:
    """A CPU's SMT siblings (itself included), from sysfs; {cpu} where unknown."""
    try:
        return cpu_list(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()) or {cpu}
    except OSError:
        return {cpu}


def tasks_of(pid: int, descendants: bool = True) -> list[int]:
    """Every thread id of process ``pid`` and, with ``descendants``, of its descendants' (Linux
    /proc; [] if gone)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                out.append(int(task))
                if descendants:
                    todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def pin_tasks(pid: int, cpus: set[int], descendants: bool = True) -> int:
    """Pin every thread of ``pid`` (and of its descendants) to ``cpus``; threads and processes
    started later inherit their creator's set. The number of threads pinned."""
    n = 0
    for tid in tasks_of(pid, descendants):
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except OSError:  # a thread that ended meanwhile
            pass
    return n


def split_cpus(n: int) -> tuple[set[int], set[int]]:
    """(``n`` CPUs of this process's set, the rest less those CPUs' SMT siblings): a core of its
    own for a host-bound process, nothing else on its core. Raises if too few CPUs are left."""
    allowed = sorted(os.sched_getaffinity(0))
    own = set(allowed[-n:])
    taken = set().union(*(siblings(c) for c in own))
    rest = set(allowed) - taken
    if n < 1 or not rest:
        raise ValueError(f"cannot give {n} CPUs of {len(allowed)} a core of their own")
    return own, rest


@contextlib.contextmanager
def busy_processes(cpus: list[set[int] | None]):
    """One process spinning in pure Python per entry of ``cpus``, pinned to that set of CPUs
    (None: wherever the OS puts it, on any CPU of the machine — not only the caller's, which a
    child would inherit: a caller pinned to the CPU it measures got its busy processes on that
    very CPU), running for the ``with`` block: the other CPU load of a served run (router,
    clients, the worker's gRPC process, the kvstore). Killed at its end."""
    everywhere = set(range(os.cpu_count() or 1))
    procs = []
    try:
        for allowed in cpus:
            code = ("import os\n"
                    f"cpus={sorted(allowed or everywhere)!r}\n"
                    "os.sched_setaffinity(0, set(cpus))\n"
                    "while True: pass\n")
            procs.append(subprocess.Popen([sys.executable, "-c", code]))
        time.sleep(0.5)  # they are running before the measurement starts
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
