"""The router serves one model: workers serving another are refused (never gibberish), and with
``--model auto`` the model and tokenizer come from the workers themselves."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router_rig import TIMEOUT, collect, wait_serving
from services.router.model_binding import incompatibility


def test_incompatibility_names_the_difference():
    assert incompatibility("tiny", 512, "tiny", 512) is None
    assert incompatibility("tiny", 512, "", 512) is None  # a worker that names no model: vocabulary decides
    assert incompatibility("tiny", 512, "/models/llama", 512) == "it serves model '/models/llama', this router serves 'tiny'"
    assert incompatibility("tiny", 512, "tiny", 128256) == "its vocabulary has 128256 tokens, this router's tokenizer 512"


def test_a_worker_with_another_vocabulary_is_refused_and_a_matching_one_serves(rig, caplog):
    rig.worker("other", vocab_size=128256)
    router = rig.router(wait=False)
    time.sleep(0.5)
    health = health_pb2_grpc.HealthStub(router.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == health_pb2.HealthCheckResponse.NOT_SERVING
    _, err = collect(router, text="hello", max_new_tokens=2)
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    assert any("not routing to worker other" in r.getMessage() and "128256 tokens" in r.getMessage() for r in caplog.records)
    rig.worker("good")
    wait_serving(router.channel)
    for _ in range(4):  # every request lands on the compatible worker
        messages, err = collect(router, text="hello", max_new_tokens=2)
        assert err is None and messages[-1].usage.worker_id == "good"
