"""CUDA graphs in the engine (FlashInfer, bf16): captured replays equal eager runs of the same
padded layouts and plans, token for token; warm-up captures before the worker says SERVING; and
greedy output through the served path (kvstore + worker + router) equals the engine alone."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch

from services.common.tokenizer import BYTE_TOKENIZER_MARKER, TINY_VOCAB_SIZE
from services.gpuworker.attention.base import get_backend
from services.gpuworker.engine.capacity import LocalBlockSource
from services.gpuworker.engine.engine import Engine, EngineConfig
from services.gpuworker.engine.local import LocalSetup, run_until_done, submit
from test_flashinfer_engine import BS, CONFIG, DEV, models, prompts  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu

NUM_BLOCKS = 64
MAX_NEW = 24


def graph_setup(models, graphs: str, **config) -> LocalSetup:
    """An engine whose FlashInfer plans are graph-safe in both modes, so ``capture`` and ``pad``
    run the same kernels on the same padded layouts and differ only in replaying graphs."""
    target, draft = models
    backend = get_backend("flashinfer", DEV, target.attention_geometry(BS, torch.bfloat16),
                          graph_max_pages_per_request=CONFIG.max_seq_len // BS)
    tpool, dpool = target.new_kv_pool(NUM_BLOCKS + 1, BS), draft.new_kv_pool(NUM_BLOCKS + 1, BS)
    source = LocalBlockSource(NUM_BLOCKS, BS)
    engine = Engine(target, draft, backend, tpool, dpool, source,
                    EngineConfig(graphs=graphs, max_batch_size=8, **config))
    return LocalSetup(engine, source, target, draft)


@pytest.mark.parametrize("k, fused, overlap, launch, forced",
                         [(0, True, False, "one", None), (3, True, False, "one", None), (3, False, False, "one", None),
                          (3, True, True, "one", None), (3, True, False, "split", None), (3, True, True, "split", None),
                          (3, True, False, "one", 3), (3, True, True, "split", 3)],
                         ids=["k0", "k3-fused", "k3-phases", "k3-fused-overlap", "k3-split", "k3-split-overlap",
                              "k3-fused-forced3", "k3-split-overlap-forced3"])
@torch.inference_mode()
def test_graph_replay_equals_eager(models, k, fused, overlap, launch, forced):
    """Fused speculative steps (one graph over the chain, verify, verdict and fill, or ``split``:
    a graph per chain position on its own lane, then one for the verify, verdict and fill, the
    drafts copied out of the earlier graphs' outputs; with overlap the verdict read back at the
    next step's start) and the phase-by-phase ones each replay exactly what their eager padded
    runs compute: tokens and counts. The random draft's proposals are rarely accepted, so only
    forced acceptance (every proposal becomes output) shows a chain that replayed wrong."""
    outputs = {}
    for graphs in ("pad", "capture"):
        setup = graph_setup(models, graphs, chunk_size=32, max_batch_tokens=128, fused_spec=fused, overlap=overlap,
                            fused_graphs=launch, forced_acceptance=forced)
        captured = setup.engine.warmup()
        if graphs == "capture":
            # target and EAGLE-3 fill for q = 1..9, the chain, and (fused) the whole step for
            # k = 1..8 (split: chain positions 1..7 and the verify + fill for k = 1..8), for
            # every bucket up to 8 (1, 2, 4, 8)
            spec = (7 + 8 if launch == "split" else 8) if fused else 0
            assert captured == 4 * (9 + 1 + 9 + spec)
        for i, p in enumerate(prompts()):
            submit(setup, f"r{i}", p, max_new_tokens=MAX_NEW, k=k)
        outputs[graphs] = {rid: (c.tokens, c.counts) for rid, c in run_until_done(setup).items()}
        assert (setup.engine.fused_steps > 0) == (k > 0 and fused)
        if graphs == "capture":
            assert setup.engine.graphs.replays > 0
            assert setup.engine.graphs.eager_runs == 0
    assert outputs["capture"] == outputs["pad"]


@torch.inference_mode()
def test_graph_replay_with_penalties_and_logprobs(models):
    """Penalties (counts on the device, verify rows counting the drafts before them) and logprobs
    (raw rows) on CUDA: a captured replay equals the eager padded run, greedy and seeded sampling,
    and every token's logprob is the row's own log_softmax (finite, <= 0, top-1 >= it)."""
    from services.gpuworker.engine.sampling import SamplingParams

    kinds = {"g": SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3),
             "s": SamplingParams(temperature=0.8, seed=1, presence_penalty=0.7, repetition_penalty=1.2)}
    outputs = {}
    for graphs in ("pad", "capture"):
        setup = graph_setup(models, graphs, chunk_size=32, max_batch_tokens=128)
        setup.engine.warmup()
        for i, p in enumerate(prompts()):
            for name, sampling in kinds.items():
                submit(setup, f"{name}{i}", p, max_new_tokens=MAX_NEW, k=3, sampling=sampling, logprobs=2)
        done = run_until_done(setup)
        outputs[graphs] = {rid: (c.tokens, [lp.logprob for lp in c.logprobs]) for rid, c in done.items()}
        for c in done.values():
            assert [lp.token_id for lp in c.logprobs] == c.tokens
            assert all(lp.logprob <= 1e-6 and lp.top[0][1] >= lp.logprob - 1e-3 for lp in c.logprobs)
    for rid, (tokens, lps) in outputs["capture"].items():
        assert tokens == outputs["pad"][rid][0], rid
        assert torch.allclose(torch.tensor(lps), torch.tensor(outputs["pad"][rid][1]), atol=1e-3), rid


@torch.inference_mode()
def test_plain_decoding_publishes_the_draft_kv_a_prefill_writes(models):
    """k = 0 requests fill their generated positions' draft KV late (in fill rounds, from rows
    kept across steps). Under captured graphs, the rows a replay returns are the graph's own
    memory and the next replay rewrites them, so the kept rows must be copies. The draft KV of
    each published block must equal, within bf16 noise, what a prefill of the same tokens writes
    (a fresh forward, filled at once). A kept view instead of a copy fills from later steps' rows:
    a relative error of order 1."""
    setup = graph_setup(models, "capture", chunk_size=32, max_batch_tokens=128)
    setup.engine.warmup()
    g = torch.Generator().manual_seed(5)
    # prompts ending at four offsets in a block: boundaries crossed in different steps
    ps = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (20, 24, 28, 31)]
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=40, k=0)
    done = run_until_done(setup, keep=[f"r{i}" for i in range(len(ps))])
    assert setup.engine.graphs.replays > 0
    pool = setup.engine.drafter.pool.data
    for i, p in enumerate(ps):
        c = done[f"r{i}"]
        blocks = c.publishable_positions // BS
        assert blocks * BS > len(p)  # generated positions were published
        ref_id = f"ref{i}"
        submit(setup, ref_id, (p + c.tokens)[: blocks * BS + 1], max_new_tokens=1, k=0)
        ref = run_until_done(setup, keep=[ref_id])[ref_id]
        assert ref.publishable_positions >= blocks * BS
        for j in range(blocks):
            got, want = pool[:, c.block_table[j]].float(), pool[:, ref.block_table[j]].float()
            err = (got - want).abs().mean() / want.abs().mean()
            assert err < 0.05, f"r{i} block {j}: draft KV off by {err:.3f} (relative mean)"


def write_checkpoint(folder) -> str:
    """A random Llama with FlashInfer's head size (128), written by transformers; the loader
    gives it a seeded random EAGLE-3 draft (``draft_model="random"``). A byte-sized
    vocabulary lets the router use its built-in byte tokenizer (the router refuses a worker whose
    vocabulary differs from its tokenizer's)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=TINY_VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                      max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # wide logit margins
    model.save_pretrained(folder)
    (folder / BYTE_TOKENIZER_MARKER).write_text(json.dumps({"type": "byte"}))
    return str(folder)


async def _served_tokens(model: str, prompts_: list[list[int]], max_new: int, k: int,
                         engine_process: bool) -> tuple[list[list[int]], int, int | None]:
    """Greedy tokens of each prompt through kvstore + worker (FlashInfer, CUDA graphs) + router;
    the graphs captured before SERVING, and the replays (None when the engine ran in its own
    process, where this test cannot count them)."""
    from services.gpuworker.server import start_worker
    from services.gpuworker.settings import WorkerSettings
    from services.kvstore.server import start_kvstore
    from services.kvstore.settings import KVStoreSettings
    from services.router.server import start_router
    from services.router.settings import RouterSettings
    from services.common.wire import tokens_to_proto
    from tandem.router.v1 import router_pb2, router_pb2_grpc

    kv_server, _ = await start_kvstore(KVStoreSettings(host="127.0.0.1", port=0, grace_s=0.0))
    kv_addr = f"127.0.0.1:{kv_server.port}"
    worker_settings = WorkerSettings(
        host="127.0.0.1", port=0, kvstore=kv_addr, model=model, device="cuda:0", backend="flashinfer",
        dtype="bfloat16", spec_mode="eagle3", draft_model="random", num_blocks=256, grace_s=0.0,
        engine_process=engine_process,
    )
    w_server, runner, _identity = await start_worker(worker_settings)
    # start_worker returns once SERVING
    captured_at_serving = runner.facts.graphs if engine_process else runner.engine.graphs.captured
    r_server, router = await start_router(RouterSettings(host="127.0.0.1", port=0, kvstore=kv_addr, grace_s=0.0,
                                                         registry_ttl_s=0.0))
    await asyncio.wait_for(router.ready.wait(), 30)
    out = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{r_server.port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            for p in prompts_:
                toks: list[int] = []
                req = router_pb2.GenerateRequest(token_ids=tokens_to_proto(p), max_new_tokens=max_new,
                                                 num_draft_tokens=k, temperature=0.0)
                async for msg in stub.Generate(req, timeout=120):
                    toks.extend(msg.token_ids)
                out.append(toks)
    finally:
        for s in (r_server, w_server, kv_server):
            await s.stop()
    return out, captured_at_serving, None if engine_process else runner.engine.graphs.replays


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
@pytest.mark.parametrize("k", [0, 3])
def test_served_path_equals_engine_alone_and_warms_up_first(tmp_path, k, engine_process):
    from services.gpuworker.build import build_engine
    from services.gpuworker.settings import WorkerSettings

    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (9, 33, 70)]
    model = write_checkpoint(tmp_path / "model")
    served, captured_at_serving, replays = asyncio.run(_served_tokens(model, ps, 16, k, engine_process))
    assert captured_at_serving > 0, "the worker said SERVING before capturing its graphs"
    assert replays is None or replays > 0

    settings = WorkerSettings(model=model, device="cuda:0", backend="flashinfer", dtype="bfloat16",
                              spec_mode="eagle3", draft_model="random", num_blocks=256)
    source = LocalBlockSource(256, settings.block_size)
    alone = build_engine(settings, lambda _num_blocks: source).engine
    alone.warmup()
    setup = LocalSetup(alone, source, alone.target, None)
    alone_tokens = []
    for i, p in enumerate(ps):  # one at a time, as the served requests ran: same batch shapes
        submit(setup, f"r{i}", p, max_new_tokens=16, k=k)
        alone_tokens.append(run_until_done(setup)[f"r{i}"].tokens)
    assert served == alone_tokens


def test_step_fence_completes_after_the_work_queued_before_it():
    from services.gpuworker.engine.fence import StepFence

    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time queued before the fence
    fence = StepFence.record(torch.device(DEV))
    assert not fence.done()  # recorded behind the sleep: not complete yet
    fence.wait()
    assert fence.done()
