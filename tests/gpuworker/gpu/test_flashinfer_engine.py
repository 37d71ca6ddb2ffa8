"""The whole speculative loop on the GPU: the engine (chunked prefill, EAGLE-3 fill + chain,
verify, accept, trim) over bf16 models with the FlashInfer backend.

bf16 greedy runs of different batch shapes may break near-ties differently, so token identity
with plain decoding is not asserted here (the CPU float32 suite does that). Instead each output is
*teacher-forced*: one unchunked prefill of prompt + output through the torch backend (another
code path) must predict every generated token from its prefix (>= 95 % of positions, measured
100 %); a misaligned loop — wrong position, token or KV page — scores about 1/vocab.
"""

from __future__ import annotations

import pytest
import torch

from services.common.spec import SpecMode
from services.gpuworker.attention.base import BatchLayout, get_backend
from services.gpuworker.engine.capacity import LocalBlockSource
from services.gpuworker.engine.engine import Engine, EngineConfig
from services.gpuworker.engine.local import LocalSetup, run_until_done, submit
from services.gpuworker.model.config import DraftConfig, LlamaConfig
from services.gpuworker.model.draft import Eagle3Draft
from services.gpuworker.model.layers import init_weights
from services.gpuworker.model.llama import TargetModel

pytestmark = pytest.mark.gpu

DEV = "cuda"
BS = 16
NUM_BLOCKS = 64
MAX_NEW = 24
CONFIG = LlamaConfig(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    max_seq_len=1024,
)


@pytest.fixture(scope="module")
def models():
    target = TargetModel(CONFIG)
    init_weights(target, torch.Generator().manual_seed(0), std=0.05)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # wide logit margins: bf16 noise must not decide argmax
    draft = Eagle3Draft(target, DraftConfig.default_for(CONFIG, SpecMode.EAGLE3))
    init_weights(draft, torch.Generator().manual_seed(1), std=0.05)
    return target.to(DEV, torch.bfloat16).eval(), draft.to(DEV, torch.bfloat16).eval()


def engine_setup(models, **config) -> LocalSetup:
    target, draft = models
    backend = get_backend("flashinfer", DEV, target.attention_geometry(BS, torch.bfloat16))
    tpool, dpool = target.new_kv_pool(NUM_BLOCKS, BS), draft.new_kv_pool(NUM_BLOCKS, BS)
    source = LocalBlockSource(NUM_BLOCKS, BS)
    engine = Engine(target, draft, backend, tpool, dpool, source, EngineConfig(**config))
    return LocalSetup(engine, source, target, draft)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 70)]


@torch.inference_mode()
def teacher_forced_agreement(target, prompt: list[int], output: list[int]) -> float:
    seq = prompt + output
    backend = get_backend("torch", DEV, target.attention_geometry(BS, torch.bfloat16))
    nb = -(-len(seq) // BS)
    pool = target.new_kv_pool(nb, BS)
    plan = backend.plan(BatchLayout([list(range(nb))], [0], [len(seq)]))
    logits = target(torch.tensor(seq, device=DEV), plan, backend, pool).logits
    predicted = logits.argmax(-1)[len(prompt) - 1 : -1].tolist()
    return sum(int(p == t) for p, t in zip(predicted, output)) / len(output)


@torch.inference_mode()
def test_speculative_greedy_loop_on_gpu(models):
    setup = engine_setup(models, chunk_size=32, max_batch_tokens=64)
    ps = prompts()
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=MAX_NEW, k=3)
    done = run_until_done(setup)
    for i, p in enumerate(ps):
        c = done[f"r{i}"]
        assert len(c.tokens) == MAX_NEW and c.proposed_drafts > 0
        agreement = teacher_forced_agreement(models[0], p, c.tokens)
        assert agreement >= 0.95, (i, agreement)


@torch.inference_mode()
def test_forced_full_acceptance_loop_on_gpu(models):
    """Every verify keeps all 3 drafts: 4 tokens per target forward after the first token."""
    setup = engine_setup(models, chunk_size=64, max_batch_tokens=128, forced_acceptance=3)
    ps = prompts()
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=MAX_NEW + 1, k=3)
    done = run_until_done(setup)
    for i in range(len(ps)):
        c = done[f"r{i}"]
        assert len(c.tokens) == MAX_NEW + 1
        assert all(0 <= t < CONFIG.vocab_size for t in c.tokens)
        # the first token comes from the prefill, then every verify yields 3 drafts + 1 token
        # (the last one may draft fewer when max_new_tokens is near)
        assert 1 + c.decode_steps + c.accepted_drafts == MAX_NEW + 1
        assert c.accepted_drafts >= 3 * (c.decode_steps - 1) and c.decode_steps <= MAX_NEW // 4 + 1
