"""Sampling over the router's gRPC API against the real suite (kvstore + tiny EAGLE-3 worker on CPU):
logprobs equal a from-scratch target forward, penalties exact under speculation, ``n`` samples,
Worker.Abort ending a stream with finish reason ``abort``, usage after a stop-string end."""

from __future__ import annotations

import grpc
import pytest
import torch

from services.client import Client
from services.common.spec import SpecMode
from services.router.tenants import Tenant
from suite_rig import LONG_PREFIX, TIMEOUT
from tandem.common.v1 import common_pb2
from tandem.router.v1 import router_pb2
from tandem.worker.v1 import worker_pb2, worker_pb2_grpc


@pytest.fixture
def served(suite):
    suite.add_worker("w0")
    suite.add_router(tenants="tokA=alice")
    return suite


@pytest.fixture(scope="module")
def tiny_target():
    from services.gpuworker.model.loader import load_model

    target, _draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3)
    return target


@torch.inference_mode()
def reference_logprobs(target, tokens: list[int], n_prompt: int) -> torch.Tensor:
    from services.gpuworker.attention.base import BatchLayout, get_backend

    n = len(tokens)
    nb = -(-n // 16)
    backend = get_backend("torch", "cpu", target.attention_geometry(16))
    out = target(torch.tensor(tokens), backend.plan(BatchLayout([list(range(nb))], [0], [n])), backend,
                 target.new_kv_pool(nb, 16))
    return torch.log_softmax(out.logits.float(), -1)[n_prompt - 1 : n - 1]


@pytest.mark.parametrize("k", [0, 3])
def test_grpc_logprobs_are_the_targets(served, tiny_target, k):
    prompt = LONG_PREFIX + "logprobs"
    with Client(served.router.address, token="tokA") as c:
        a = c.generate(prompt, max_tokens=10, temperature=0, logprobs=2, num_draft_tokens=k, ignore_eos=True)
        ids = list(a.token_ids)
        prompt_ids = c.generate(prompt, max_tokens=1, temperature=0).usage.prompt_tokens
    from services.common.tokenizer import ByteTokenizer

    p = ByteTokenizer().encode(prompt)
    assert len(p) == prompt_ids and len(a.logprobs) == len(ids) == 10
    ref = reference_logprobs(tiny_target, p + ids, len(p))
    for i, lp in enumerate(a.logprobs):
        assert lp.token_id == ids[i]
        assert abs(lp.logprob - float(ref[i, ids[i]])) < 1e-4
        assert [t for t, _ in lp.top] == torch.topk(ref[i], 2).indices.tolist()


def test_grpc_penalties_are_exact_under_speculation(served):
    prompt = LONG_PREFIX + "penalties"
    kw = dict(max_tokens=16, temperature=0, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3,
              ignore_eos=True)
    with Client(served.router.address, token="tokA") as c:
        plain = c.generate(prompt, num_draft_tokens=0, **kw)
        spec = c.generate(prompt, num_draft_tokens=3, **kw)
        free = c.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True)
    assert plain.token_ids == spec.token_ids
    assert plain.token_ids != free.token_ids
    assert served.wait_no_live_reservations().live_reservations == 0


def test_grpc_n_samples_share_the_prompt(served):
    prompt = LONG_PREFIX + "three samples"
    with Client(served.router.address, token="tokA") as c:
        answers = c.samples(prompt, 3, max_tokens=8, seed=5, ignore_eos=True, logprobs=0)
        again = c.samples(prompt, 3, max_tokens=8, seed=5, ignore_eos=True)
        single = c.generate(prompt, max_tokens=8, seed=6, ignore_eos=True)  # sample 1 = seed + 1
        msgs = list(c._stub.Generate(router_pb2.GenerateRequest(text=prompt, max_new_tokens=4, n=2, temperature=0),
                                     timeout=TIMEOUT, metadata=c._metadata))
    assert [a.token_ids for a in answers] == [a.token_ids for a in again]
    assert answers[1].token_ids == single.token_ids
    assert all(len(a.token_ids) == 8 and len(a.logprobs) == 8 and a.finish_reason == "length" for a in answers)
    # the prompt's blocks are shared: by the time the repeat runs, every sample reuses them
    assert min(a.usage.cached_tokens for a in again) >= 64
    finals = [m for m in msgs if m.HasField("usage")]
    assert sorted(m.index for m in finals) == [0, 1] and msgs[-1].HasField("usage")
    with Client(served.router.address, token="tokA") as c, pytest.raises(Exception, match="n must be"):
        c.generate(prompt, max_tokens=2, n=17)
    assert served.wait_no_live_reservations().live_reservations == 0


def test_worker_abort_ends_the_stream_with_finish_reason_abort(served):
    with Client(served.router.address, token="tokA") as c:
        stream = c.stream(LONG_PREFIX, max_tokens=1500, temperature=0, ignore_eos=True, request_id="ab1")
        first = next(stream)
        assert first.token_ids and first.usage is None
        runner = served.workers[0].payload[0]
        with grpc.insecure_channel(served.workers[0].address) as ch:
            worker_pb2_grpc.WorkerStub(ch).Abort(
                worker_pb2.AbortRequest(request_id=f"{Tenant('alice', b'').scope}/ab1"), timeout=TIMEOUT)
        rest = list(stream)
    last = rest[-1]
    assert last.finish_reason == "abort"
    generated = len(first.token_ids) + sum(len(d.token_ids) for d in rest)
    assert last.usage.completion_tokens == generated < 1500
    assert served.wait_no_live_reservations().live_reservations == 0
    assert runner.running == 0


def test_usage_after_a_stop_string_counts_decode_steps(served):
    prompt = LONG_PREFIX + "Stop somewhere."
    with Client(served.router.address, token="tokA") as c:
        full = c.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)
        chars = [t for t in full.token_ids[4:] if t < 128]
        stopped = c.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True, stop=[chr(chars[0])])
    assert stopped.finish_reason == "stop"
    n = stopped.usage.completion_tokens
    assert n == len(stopped.token_ids) >= 5
    raw = stopped.usage  # decode steps are not reported by the client's Usage: ask the router's message
    assert raw.mean_acceptance_length >= 1.0
    with Client(served.router.address, token="tokA") as c:
        msgs = list(c._stub.Generate(router_pb2.GenerateRequest(text=prompt, max_new_tokens=24, temperature=0,
                                                                ignore_eos=True, stop=[chr(chars[0])]),
                                     timeout=TIMEOUT, metadata=c._metadata))
    usage = msgs[-1].usage
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    # the first token comes from the prefill, every later one from a decode step (k = 0 or misses)
    assert 1 <= usage.decode_steps <= usage.completion_tokens - 1 + 2
    assert usage.decode_steps >= (usage.completion_tokens - 1) / (1 + 8)
