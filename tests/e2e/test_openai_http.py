"""The OpenAI-compatible HTTP front, driven by the official ``openai`` client against the real
suite on loopback (kvstore + tiny-model worker on CPU + router serving HTTP on port 0)."""

from __future__ import annotations

import json
import socket
import time

import openai
import pytest

from services.common.tokenizer import ByteTokenizer
from suite_rig import LONG_PREFIX, TIMEOUT

MODEL = "tiny"


@pytest.fixture
def front(suite):
    suite.add_worker("w0")
    suite.add_router(http_port=0, tenants="tokA=alice,tokB=bob")
    return suite


def client(suite, token: str = "tokA") -> openai.OpenAI:
    return openai.OpenAI(base_url=suite.router.payload.http_url + "/v1", api_key=token, timeout=TIMEOUT, max_retries=0)


def test_completion_matches_grpc_and_repeat_reports_cached_tokens(front):
    """Greedy HTTP completion = the gRPC answer for the same prompt; the repeat hits the cache."""
    api = client(front)
    prompt = LONG_PREFIX + "Question: what is paired?"
    first = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    second = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ids, text, usage = front.generate(prompt, token="tokA", max_new_tokens=12)

    assert first.object == "text_completion" and first.model == MODEL
    assert first.choices[0].text == second.choices[0].text == text
    assert first.choices[0].finish_reason in ("length", "stop")
    assert first.usage.prompt_tokens == usage.prompt_tokens == len(ByteTokenizer().encode(prompt))
    assert first.usage.completion_tokens == len(ids)
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert front.wait_no_live_reservations().live_reservations == 0
    assert front.invariants().ok


def test_streamed_completion_equals_the_whole_one(front):
    api = client(front)
    prompt = LONG_PREFIX + "Stream this."
    whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 64  # the first request published the prefix


def test_chat_whole_and_streamed_use_the_demo_template(front):
    api = client(front)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    rendered = "<|system|>\nBe brief.\n<|user|>\nHello there\n<|assistant|>\n"
    assert whole.usage.prompt_tokens == len(ByteTokenizer().encode(rendered))
    ids, text, _ = front.generate(rendered, token="tokA", max_new_tokens=10)
    assert whole.choices[0].message.content == text

    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_health_answers_like_vllms(front):
    """GET /health (what vLLM serves and load generators such as guidellm probe): 200, no token."""
    import urllib.request

    with urllib.request.urlopen(front.router.payload.http_url + "/health", timeout=TIMEOUT) as r:
        assert r.status == 200 and r.read() == b""


def test_models_lists_the_served_model(front):
    models = client(front).models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 3.0}, "temperature"),
        ({"n": 17}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"logit_bias": {"1": 2.0}}, "logit_bias"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"stop": [""]}, None),
        ({"prompt": ""}, None),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt": [600]}, None),  # outside the 512-token vocabulary
    ],
)
def test_bad_requests_are_openai_400s_and_change_nothing(front, fields, param):
    before = front.stats()
    with pytest.raises(openai.BadRequestError) as info:
        client(front).completions.create(**{"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields})
    err = info.value
    assert err.status_code == 400
    assert err.body["type"] == "invalid_request_error" and err.body["message"]
    if param:
        assert err.body["param"] == param
    after = front.stats()
    assert after.live_reservations == 0 and after.reservations_created == before.reservations_created


def test_a_body_over_max_receive_bytes_is_413_and_changes_nothing(suite):
    """The HTTP front reads at most --max-receive-bytes of a body (the gRPC front's message
    limit): larger is 413 with OpenAI's error shape, whether the size is declared up front
    (Content-Length) or only shows while a chunked body streams in; the router serves on."""
    import http.client
    from urllib.parse import urlsplit

    suite.add_worker("w0")
    suite.add_router(http_port=0, tenants="tokA=alice", max_receive_bytes=64 << 10)
    before = suite.stats()
    where = urlsplit(suite.router.payload.http_url)
    headers = {"authorization": "Bearer tokA", "content-type": "application/json"}
    big = json.dumps({"model": MODEL, "prompt": "x" * (80 << 10), "max_tokens": 2}).encode()

    def chunks():
        for i in range(0, len(big), 8 << 10):
            yield big[i : i + (8 << 10)]

    for content in (big, chunks()):  # with a Content-Length, then chunked
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=TIMEOUT)
        try:
            conn.request("POST", "/v1/completions", body=content, headers=headers, encode_chunked=not isinstance(content, bytes))
            r = conn.getresponse()
            status, text = r.status, r.read()
        finally:
            conn.close()
        assert status == 413, text
        err = json.loads(text)["error"]
        assert err["code"] == "request_too_large" and "65536 bytes" in err["message"]
    after = suite.stats()
    assert after.live_reservations == 0 and after.reservations_created == before.reservations_created
    small = client(suite).completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert small.usage.completion_tokens == 2


def test_unknown_model_is_404_and_bad_token_is_401(front):
    with pytest.raises(openai.NotFoundError) as info:
        client(front).completions.create(model="gpt-9", prompt="Hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        client(front, token="wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)


def test_bearer_token_picks_the_tenant_namespace(front):
    """alice's repeat hits her cache; bob's identical prompt does not (different cache salt)."""
    prompt = LONG_PREFIX + "Tenants?"
    client(front, "tokA").completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    alice = client(front, "tokA").completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    bob = client(front, "tokB").completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert alice.usage.prompt_tokens_details.cached_tokens >= 64
    assert bob.usage.prompt_tokens_details.cached_tokens == 0


def _send_raw(url: str, body: dict, token: str) -> socket.socket:
    """POST /v1/completions on a raw socket (so the test decides when the client hangs up)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    return sock


def _raw_stream_then_drop(url: str, body: dict, token: str, events: int) -> list[str]:
    """Send a streaming request on a raw socket, read ``events`` SSE events, then hang up."""
    sock = _send_raw(url, body, token)
    seen, buf = [], b""
    while len(seen) < events:
        buf += sock.recv(4096)
        seen = [line for line in buf.decode(errors="replace").split("\n") if line.startswith("data: ")]
    sock.close()
    return seen


def test_client_that_disconnects_mid_stream_leaks_no_reservation(front):
    """Hanging up cancels the request: the reservation ends as an Abort (it publishes nothing of
    the output: a run to the end would publish ~90 more blocks) and every block is back."""
    prompt = LONG_PREFIX + "Go on forever"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1500, "temperature": 0, "stream": True}
    seen = _raw_stream_then_drop(front.router.payload.http_url, body, "tokA", events=3)
    assert seen[0].startswith("data: {")
    stats = front.wait_no_live_reservations()
    assert stats.live_reservations == 0
    assert front.invariants().ok
    w = stats.workers[0]
    assert w.pool.in_use == 0
    prompt_blocks = len(ByteTokenizer().encode(prompt)) // 16
    assert w.published_blocks <= prompt_blocks + 16, w  # stopped within a few steps of the hang-up


def test_client_that_disconnects_while_waiting_for_a_whole_answer_cancels_it(front):
    """Not streaming: the router notices the hang-up while the answer is being generated."""
    prompt = LONG_PREFIX + "Wait for it"
    sock = _send_raw(front.router.payload.http_url, {"model": MODEL, "prompt": prompt, "max_tokens": 1500,
                                                     "temperature": 0}, "tokA")
    deadline = time.monotonic() + TIMEOUT
    while front.stats().live_reservations == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # wait until it runs
    sock.close()
    stats = front.wait_no_live_reservations()
    assert stats.live_reservations == 0 and front.invariants().ok
    prompt_blocks = len(ByteTokenizer().encode(prompt)) // 16
    assert stats.workers[0].published_blocks <= prompt_blocks + 16, stats.workers[0]


def test_stop_strings_cut_the_text_the_same_with_and_without_speculation(front):
    """A stop string taken from the middle of the greedy answer ends it right before the
    earliest match, with speculation on and off alike (token-identical greedy output), streamed
    or not; the rest is never generated to the end (the reservation is aborted, nothing leaks)."""
    api = client(front)
    prompt = LONG_PREFIX + "Stop somewhere."
    ids, full, _ = front.generate(prompt, token="tokA", max_new_tokens=48, num_draft_tokens=0)
    # the tiny random model writes mostly invalid UTF-8: stop on its last ASCII letter, first seen at n
    letter = [t for t in ids if chr(t).isascii() and chr(t).isalpha()][-1]
    n = ids.index(letter)
    stop, expected = chr(letter), ByteTokenizer().decode(ids[:n])
    answers = []
    for k in (0, 1, 4):
        r = api.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stop=[stop, "\x00never"],
                                   extra_body={"num_draft_tokens": k})
        answers.append((r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens))
        chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stop=stop,
                                             stream=True, extra_body={"num_draft_tokens": k}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert answers[0] == (expected, "stop", n + 1)  # the token completing the stop counts; none after it
    assert answers == [answers[0]] * 3
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=30,
                                       temperature=0, stop="\n")
    assert "\n" not in chat.choices[0].message.content
    assert front.wait_no_live_reservations().live_reservations == 0
    assert front.invariants().ok


def test_min_p_one_samples_the_greedy_answer_under_speculation(front):
    """min_p = 1 keeps only the most likely token, so sampling at temperature 1 (draft and target
    alike, k = 4) must return exactly the greedy tokens: the filter reaches both and verification
    stays exact."""
    api = client(front)
    prompt = LONG_PREFIX + "min p"
    greedy = api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    sampled = api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=0,
                                     extra_body={"min_p": 1.0, "num_draft_tokens": 4})
    assert sampled.choices[0].text == greedy.choices[0].text


def test_http_generations_count_in_the_router_metrics(suite):
    """HTTP requests land in the same Prometheus series as gRPC ones (outcome by status code name)."""
    from types import SimpleNamespace

    from test_metrics import scrape, value

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    suite.add_worker("w0")
    suite.add_router(http_port=0, metrics_port=port)
    api = client(suite)
    api.completions.create(model=MODEL, prompt=LONG_PREFIX, max_tokens=5, temperature=0)
    list(api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                     temperature=0, stream=True))
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt="x", max_tokens=0)
    samples = scrape(SimpleNamespace(port=port))
    assert value(samples, "tandem_router_requests_total", outcome="OK") == 2
    assert value(samples, "tandem_router_requests_total", outcome="INVALID_ARGUMENT") == 1
    assert value(samples, "tandem_router_in_flight_requests") == 0
    assert value(samples, "tandem_router_completion_tokens_total") == 8
    # a client that hangs up mid-stream, and one that hangs up on a whole answer: CANCELLED, none left in flight
    body = {"model": MODEL, "prompt": LONG_PREFIX, "max_tokens": 1500, "temperature": 0}
    _raw_stream_then_drop(suite.router.payload.http_url, body | {"stream": True}, "any", events=2)
    sock = _send_raw(suite.router.payload.http_url, body, "any")
    end = time.monotonic() + TIMEOUT
    while suite.stats().live_reservations == 0:
        assert time.monotonic() < end, "the whole-answer request never got a reservation"
        time.sleep(0.01)
    sock.close()
    deadline = time.monotonic() + TIMEOUT
    while value(samples, "tandem_router_requests_total", outcome="CANCELLED") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
        samples = scrape(SimpleNamespace(port=port))
    assert value(samples, "tandem_router_requests_total", outcome="CANCELLED") == 2
    assert value(samples, "tandem_router_requests_total", outcome="OK") == 2
    assert value(samples, "tandem_router_in_flight_requests") == 0
    assert suite.wait_no_live_reservations().live_reservations == 0


def test_client_that_hangs_up_before_its_first_token_cancels_the_wait(suite):
    """No worker yet (the router knows its model): a streamed request waits for one to register.
    Hanging up then cancels the wait at once (CANCELLED, before the 30 s wait would end), and the
    worker that registers afterwards never sees the request."""
    from types import SimpleNamespace

    from test_metrics import scrape, value

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from services.router.server import start_router
    from services.router.settings import RouterSettings

    settings = RouterSettings(host="127.0.0.1", port=0, kvstore=suite.kv.address, grace_s=0.0, registry_ttl_s=0.0,
                              http_port=0, metrics_port=port, model="tiny", kvstore_outage_wait_s=30.0)
    # not add_router: it waits until a worker is registered
    suite.router = suite.start_service(lambda: start_router(settings, tracer_provider=suite.tracer_provider))
    body = {"model": MODEL, "prompt": "waiting", "max_tokens": 4, "temperature": 0, "stream": True}
    sock = _send_raw(suite.router.payload.http_url, body, "any")
    samples = scrape(SimpleNamespace(port=port))
    end = time.monotonic() + TIMEOUT
    while value(samples, "tandem_router_in_flight_requests") == 0:
        assert time.monotonic() < end, "the request never reached the router"
        time.sleep(0.01)
        samples = scrape(SimpleNamespace(port=port))
    time.sleep(0.2)  # waiting for a worker
    sock.close()
    deadline = time.monotonic() + 10.0
    while value(samples, "tandem_router_requests_total", outcome="CANCELLED") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
        samples = scrape(SimpleNamespace(port=port))
    assert value(samples, "tandem_router_requests_total", outcome="CANCELLED") == 1
    assert value(samples, "tandem_router_in_flight_requests") == 0
    suite.add_worker("w0")
    api = client(suite)
    api.completions.create(model=MODEL, prompt="after", max_tokens=2, temperature=0)  # the worker serves
    assert suite.stats().reservations_created == 1  # that one only


def test_front_trace_stamps_each_request_of_both_fronts_in_order(suite, tmp_path):
    """``--front-trace``: one line per generation of either front, keyed by its prompt's token ids,
    with entry <= dispatch <= first event <= first write; a request refused before dispatch has none."""
    from services.common.wire import tokens_to_proto
    from services.router.front_trace import STAMPS, prompt_key, read_trace

    path = tmp_path / "trace.jsonl"
    suite.add_worker("w0")
    suite.add_router(http_port=0, front_trace=str(path))
    api = client(suite)
    ids = [[65 + i, 66, 67, 68, 69, 70] for i in range(3)]
    suite.generate(token_ids=tokens_to_proto(ids[0]), max_new_tokens=3)
    list(api.completions.create(model=MODEL, prompt=ids[1], max_tokens=3, temperature=0, stream=True))
    api.completions.create(model=MODEL, prompt=ids[2], max_tokens=3, temperature=0)
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt=ids[0], max_tokens=0)
    deadline = time.monotonic() + TIMEOUT
    while (not path.exists() or len(read_trace(path)) < 3) and time.monotonic() < deadline:
        time.sleep(0.01)  # each line is written just after its first write
    lines = read_trace(path)
    assert [(line["front"], line["key"]) for line in lines] == [
        ("grpc", prompt_key(ids[0])), ("http", prompt_key(ids[1])), ("http", prompt_key(ids[2]))]
    for line in lines:
        stamps = [line[s] for s in STAMPS]
        assert stamps == sorted(stamps) and stamps[-1] - stamps[0] < TIMEOUT


def test_n_samples_share_the_prompt_and_arrive_as_indexed_choices(front):
    """n = 3: three choices (index 0..2), the later samples reuse the first one's prompt blocks,
    seeded samples are reproducible, streaming carries every index and one finish per choice."""
    api = client(front)
    prompt = LONG_PREFIX + "Three samples."
    r = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3)
    again = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert r.usage.completion_tokens == 3 * 8 and r.usage.prompt_tokens == len(ByteTokenizer().encode(prompt))
    assert r.choices[1].text != r.choices[0].text or r.choices[2].text != r.choices[0].text  # seeds 5, 6, 7
    # greedy samples are identical; on a prompt nobody sent before, samples 1 and 2 reuse sample 0's blocks
    before = front.stats().workers[0].reused_positions
    g = api.completions.create(model=MODEL, prompt="A greedy trio, never seen. " * 6, max_tokens=6, temperature=0, n=3)
    assert len({c.text for c in g.choices}) == 1
    assert front.stats().workers[0].reused_positions - before >= 2 * 144
    chunks = list(api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "n"}], max_tokens=5,
                                              temperature=0, n=2, stream=True, stream_options={"include_usage": True}))
    finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finishes == [0, 1]
    assert chunks[-1].usage.completion_tokens == 10
    assert front.wait_no_live_reservations().live_reservations == 0 and front.invariants().ok


def test_logprobs_in_openai_shapes_streamed_and_whole_equal_grpc(front):
    """Completions ``logprobs: 2`` and chat ``logprobs + top_logprobs: 2``: the same numbers as the
    gRPC API's (which are the target's, see test_sampling_api), whole and streamed, k = 0 and 3."""
    from services.client import Client

    api = client(front)
    prompt = LONG_PREFIX + "Log probabilities."
    with Client(front.router.address, token="tokA") as c:
        ref = c.generate(prompt, max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    want = [lp.logprob for lp in ref.logprobs]
    for k in (0, 3):
        whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                       extra_body={"num_draft_tokens": k, "ignore_eos": True})
        lp = whole.choices[0].logprobs
        assert lp.tokens == [ByteTokenizer().decode([t], skip_special_tokens=False) for t in ref.token_ids]
        assert lp.token_logprobs == pytest.approx(want, abs=1e-5)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
        assert all(len(d) <= 3 and lp.tokens[i] in d for i, d in enumerate(lp.top_logprobs))
        chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                             stream=True, extra_body={"num_draft_tokens": k, "ignore_eos": True}))
        streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
        assert streamed == pytest.approx(want, abs=1e-5)
    messages = [{"role": "user", "content": "logprobs please"}]
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-5)
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, top_logprobs=2)


def test_penalties_are_accepted_and_exact_under_speculation(front):
    api = client(front)
    prompt = LONG_PREFIX + "Penalize repeats."
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, presence_penalty=1.2, frequency_penalty=0.8)
    plain = api.completions.create(**kw, extra_body={"num_draft_tokens": 0, "repetition_penalty": 1.4, "ignore_eos": True})
    spec = api.completions.create(**kw, extra_body={"num_draft_tokens": 4, "repetition_penalty": 1.4, "ignore_eos": True})
    free = api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].text == spec.choices[0].text != free.choices[0].text
