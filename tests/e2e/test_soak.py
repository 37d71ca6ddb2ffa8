"""Bounded soak (issue 8): mTLS suite with two worker processes; clients stream greedy requests
while requests are cancelled, deadlines expire, the router aborts reservations from outside, one
worker is frozen (SIGSTOP, past its lease) and thawed, the other SIGKILLed and restarted.

Asserts: 0 wrong outputs (every completed answer equals the reference run's greedy answer for
its prompt, token for token), then 0 leaked blocks and 0 reservations left (live or ending),
a clean audit, every service SERVING. ~40 s here.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time

import grpc
import pytest

from tandem.kvstore.v1 import kvstore_pb2 as kv_pb
from tandem.router.v1 import router_pb2
from trust_rig import TIMEOUT, TrustRig, make_pki, spawn_worker, wait_workers

SOAK_S = 25.0
MAX_NEW = 24
PROMPTS = [
    "System: answer briefly. User: what is a paired KV block?",
    "System: answer briefly. User: why are draft keys shifted?",
    "System: answer briefly. User: who frees a reservation?",
    "A completely different prompt about speculative decoding",
]
OK_ERRORS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.mark.slow
def test_soak_mixed_traffic_and_failures(tmp_path, start_service):
    rig = TrustRig(make_pki(tmp_path), start_service)
    procs: dict[str, subprocess.Popen] = {}
    try:
        rig.start_kvstore()
        procs = {name: spawn_worker(rig, name) for name in ("w0", "w1")}
        wait_workers(rig, {"w0", "w1"})
        rig.start_router(idle_timeout_s=2.0, worker_probe_timeout_s=0.5, failed_worker_cooldown_s=1.0, max_queue_wait_s=2.0)
        time.sleep(1.2)  # the router probes both workers
        reference = {p: rig.generate(p, max_new_tokens=MAX_NEW)[0] for p in PROMPTS}
        assert all(len(ids) == MAX_NEW for ids in reference.values())

        stop = threading.Event()
        tally = {"ok": 0, "wrong": 0, "errors": 0, "cancelled_by_us": 0, "outside_aborts": 0}
        unexpected: list[str] = []
        lock = threading.Lock()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                prompt = rng.choice(PROMPTS)
                n = rng.randint(4, MAX_NEW)
                deadline = rng.choice([TIMEOUT, TIMEOUT, 0.3])
                cancel_after = rng.choice([None, None, None, 1])
                call = rig.router.stub.Generate(router_pb2.GenerateRequest(temperature=0.0, text=prompt, max_new_tokens=n), timeout=deadline)
                ids: list[int] = []
                try:
                    for msg in call:
                        ids.extend(msg.token_ids)
                        if cancel_after is not None and len(ids) >= cancel_after:
                            call.cancel()
                            with lock:
                                tally["cancelled_by_us"] += 1
                            break
                    else:
                        with lock:
                            if ids == reference[prompt][:n]:
                                tally["ok"] += 1
                            else:
                                tally["wrong"] += 1
                                unexpected.append(f"wrong answer for {prompt!r}: {ids} vs {reference[prompt][:n]}")
                except grpc.RpcError as err:
                    with lock:
                        tally["errors"] += 1
                        if err.code() not in OK_ERRORS:
                            unexpected.append(f"{err.code().name}: {err.details()}")

        def outside_aborter() -> None:
            rng = random.Random(99)
            kv = rig.kv_as("router2")
            while not stop.wait(0.4):
                live = rig.kv.in_loop(lambda: rig.kv.payload.view().reservations())
                if live:
                    r = rng.choice(live)
                    try:
                        kv.Abort(kv_pb.AbortRequest(reservation_id=r.reservation_id, incarnation=r.incarnation), timeout=5)
                        with lock:
                            tally["outside_aborts"] += 1
                    except grpc.RpcError:
                        pass  # ended meanwhile

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)] + [threading.Thread(target=outside_aborter)]
        for t in threads:
            t.start()
        started = time.monotonic()
        time.sleep(4)
        procs["w1"].send_signal(signal.SIGSTOP)  # frozen: lease lapses, its streams must not hang
        time.sleep(3)
        procs["w1"].send_signal(signal.SIGCONT)  # thawed: re-registers as a new incarnation
        time.sleep(3)
        procs["w0"].send_signal(signal.SIGKILL)
        procs["w0"].wait(10)
        procs["w0"] = spawn_worker(rig, "w0")
        time.sleep(max(0.0, SOAK_S - (time.monotonic() - started)))
        stop.set()
        for t in threads:
            t.join(TIMEOUT)

        print("soak:", tally)
        assert not unexpected, unexpected[:5]
        assert tally["wrong"] == 0
        assert tally["ok"] >= 10 and tally["outside_aborts"] >= 1, tally
        wait_workers(rig, {"w0", "w1"})
        stats = rig.wait_settled(timeout_s=20.0)
        assert (stats.live_reservations, stats.ending_reservations) == (0, 0), stats
        assert all(w.pool.in_use == 0 for w in stats.workers), stats
        assert rig.invariants().ok, rig.invariants().violations
        for p in PROMPTS:  # and the suite still answers right
            assert rig.generate(p, max_new_tokens=MAX_NEW)[0] == reference[p]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)
        rig.close()
