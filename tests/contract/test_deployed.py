"""Contract tests of a deployed Tandem stack, through its public doors only: the router's gRPC
API (health, reflection, Generate) and the metrics the deployment scrapes. ``conftest.py`` points
them at compose's stack or at an in-process suite."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.router.v1 import router_pb2, router_pb2_grpc

TIMEOUT = 60
PROMPT = "A deployed stack answers, and its second answer to the same long prompt reuses the KV of the first. " * 2


@pytest.fixture(scope="module")
def channel(deployment):
    with grpc.insecure_channel(deployment.router) as ch:
        yield ch


def generate(channel, **request):
    request.setdefault("temperature", 0.0)  # greedy: the API's unset temperature is OpenAI's 1.0
    messages = list(router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(**request), timeout=TIMEOUT))
    return messages, messages[-1].usage


def test_router_is_serving(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_router_api(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert {"tandem.router.v1.Router", "grpc.health.v1.Health"} <= names


def test_generate_streams_and_the_repeat_is_cached(channel):
    first, u1 = generate(channel, text=PROMPT, max_new_tokens=16)
    second, u2 = generate(channel, text=PROMPT, max_new_tokens=16)
    assert u1.completion_tokens == u2.completion_tokens == 16
    assert sum(len(m.token_ids) for m in first) == 16
    assert [t for m in first for t in m.token_ids] == [t for m in second for t in m.token_ids]  # greedy: same answer
    assert u1.cached_tokens == 0 or u1.cached_tokens < u2.cached_tokens  # a rerun of the suite may start warm
    assert u2.cached_tokens >= 16 and u2.cached_tokens % 16 == 0  # whole blocks of the first request's KV


def test_bad_request_is_invalid_argument_not_internal(channel):
    with pytest.raises(grpc.RpcError) as info:
        generate(channel, max_new_tokens=4)  # no prompt
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in info.value.details()


def test_every_service_is_scraped(deployment):
    end = time.monotonic() + TIMEOUT
    while True:
        health = deployment.scrape()
        if set(health) >= {"kvstore", "router", "worker"} and set(health.values()) == {"up"}:
            return
        assert time.monotonic() < end, health
        time.sleep(1)


def test_openai_http_api_answers_and_reports_cached_tokens(deployment):
    """The router's OpenAI-compatible door (official client): a completion, then the same prompt
    again with its cached tokens in usage."""
    import openai

    api = openai.OpenAI(base_url=deployment.http, api_key="none", timeout=TIMEOUT, max_retries=0)
    model = api.models.list().data[0].id
    first = api.completions.create(model=model, prompt=PROMPT + "HTTP", max_tokens=4, temperature=0)
    again = api.completions.create(model=model, prompt=PROMPT + "HTTP", max_tokens=4, temperature=0)
    assert first.usage.completion_tokens == 4 and first.choices[0].finish_reason in ("length", "stop")
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0
