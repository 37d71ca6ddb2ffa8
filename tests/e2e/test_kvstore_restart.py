"""A memory kvstore restarted under running streams (issue 10): the workers re-register with
what they hold, so no stream fails, every stream is token-identical to a run without the
restart, and the cache is rebuilt from the workers. Real gRPC servers on loopback throughout."""

from __future__ import annotations

import threading
import time

import pytest

from suite_rig import wait_registered
from tandem.router.v1 import router_pb2

PROMPTS = [f"stream {i}: the kvstore may restart at any moment and nobody should notice. " * 2 for i in range(6)]
MAX_NEW = 64


def _stream(suite, prompt: str, out: dict, key: int, first: threading.Event) -> None:
    ids: list[int] = []
    try:
        request = router_pb2.GenerateRequest(text=prompt, max_new_tokens=MAX_NEW, num_draft_tokens=3, temperature=0.0)
        for msg in suite.stub.Generate(request, timeout=120):
            ids.extend(msg.token_ids)
            if ids:
                first.set()
        out[key] = ids
    except Exception as exc:  # noqa: BLE001 - the assertion below shows it
        out[key] = exc
        first.set()


SEEDS = [f"seed {i}: a prefix that only the cache remembers, published before the restart. " * 2 for i in range(3)]


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_running_streams_survive_a_memory_kvstore_restart(suite, start_kvstore_service, engine_process):
    for wid in ("w0", "w1"):
        suite.add_worker(wid, engine_process=engine_process)
    suite.add_router()
    # reference outputs (greedy): what each stream must produce, restart or not
    reference = {i: suite.generate(p, max_new_tokens=MAX_NEW, num_draft_tokens=3)[0] for i, p in enumerate(PROMPTS)}
    for seed in SEEDS:
        suite.generate(seed, max_new_tokens=4)
    cached_before = [suite.generate(seed, max_new_tokens=4)[2].cached_tokens for seed in SEEDS]
    assert all(cached_before)

    out: dict = {}
    firsts = [threading.Event() for _ in PROMPTS]
    threads = [threading.Thread(target=_stream, args=(suite, p, out, i, firsts[i])) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for ev in firsts:
        assert ev.wait(60)
    port = suite.kv.address.rsplit(":", 1)[1]
    suite.kv.stop()  # the kvstore dies with everything it knew
    time.sleep(0.3)
    suite.kv = start_kvstore_service(lease_ttl_s=1.5, port=int(port))
    for t in threads:
        t.join(120)

    failed = {i: v for i, v in out.items() if isinstance(v, Exception)}
    assert not failed, failed
    assert out == reference  # token-identical: nothing was recomputed wrongly or dropped
    # both workers came back with what they hold; nothing leaked; invariants hold. The streams
    # may all end in the capacity they held before a worker's next heartbeat finds the new
    # kvstore: wait for the re-registrations (issue 10's bound for the cache is 5 s) first.
    for wid in ("w0", "w1"):
        wait_registered(suite, wid, timeout_s=5.0)
    stats = suite.wait_no_live_reservations()
    assert stats.live_reservations == 0 and len(stats.workers) == 2
    assert list(suite.invariants().violations) == []
    # the cache came back from the workers: the seed prompts, which nothing ran during the
    # restart, hit as much as before it, once the workers' re-announcements have landed (they
    # follow re-registration; issue 10 gives the hit rate 5 s to come back). Nothing else
    # publishes now, so the trie stops growing when they are all in.
    end, seen, still = time.monotonic() + 5.0, -1, 0
    while still < 3 and time.monotonic() < end:
        nodes = suite.stats().trie_nodes
        still, seen = (still + 1, seen) if nodes == seen else (0, nodes)
        time.sleep(0.2)
    cached_after = [suite.generate(seed, max_new_tokens=4)[2].cached_tokens for seed in SEEDS]
    assert cached_after == cached_before
