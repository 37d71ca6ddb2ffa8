"""The Llama target and its EAGLE-3 draft give the same logits with FlashInfer as with the torch
backend (bf16, GPU) over a prefill chunk, a decode step and a multi-token verify step.

    request r:  | prompt (PREFILL) | t (DECODE) | t d1 d2 d3 (VERIFY) |  + draft fill over the same rows

Each backend gets its own copy of the KV pools; only attention differs between the two runs.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.common.spec import SpecMode
from services.gpuworker.attention.base import AttentionKind, BatchLayout, get_backend
from services.gpuworker.model.config import DraftConfig, LlamaConfig
from services.gpuworker.model.draft import Eagle3Draft
from services.gpuworker.model.layers import init_weights
from services.gpuworker.model.llama import TargetModel

pytestmark = pytest.mark.gpu

DEV = "cuda"
BS = 16
REL_TOL = 2e-2
CONFIG = LlamaConfig(  # head_dim 128 like the benchmark model: one FlashInfer JIT build for both
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    max_seq_len=1024,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def models():
    target = TargetModel(CONFIG)
    init_weights(target, torch.Generator().manual_seed(0), std=0.05)
    draft = Eagle3Draft(target, DraftConfig.default_for(CONFIG, SpecMode.EAGLE3))
    init_weights(draft, torch.Generator().manual_seed(1), std=0.05)
    target.to(DEV, torch.bfloat16).eval()
    draft.to(DEV, torch.bfloat16).eval()
    return target, draft


def test_target_and_draft_match_torch_across_prefill_decode_verify(models):
    target, draft = models
    geom = target.attention_geometry(BS, torch.bfloat16)
    backends = {"torch": get_backend("torch", DEV, geom), "flashinfer": get_backend("flashinfer", DEV, geom)}
    num_blocks = 64
    pools = {
        name: (target.new_kv_pool(num_blocks, BS), draft.new_kv_pool(num_blocks, BS)) for name in backends
    }
    rng = random.Random(0)
    prompt_lens = [37, 70, 1]
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-(n + 8) // BS) + 1)] for n in prompt_lens]
    tokens = [[rng.randrange(CONFIG.vocab_size) for _ in range(n + 8)] for n in prompt_lens]
    aux = draft.aux_layers

    steps = [  # (cached lens, query lens, kind)
        ([0, 0, 0], prompt_lens, AttentionKind.PREFILL),
        ([n for n in prompt_lens], [1, 1, 1], AttentionKind.DECODE),
        ([n + 1 for n in prompt_lens], [4, 4, 4], AttentionKind.VERIFY),
    ]
    results: dict[str, list] = {name: [] for name in backends}
    for name, backend in backends.items():
        tpool, dpool = pools[name]
        for cached, qlens, kind in steps:
            layout = BatchLayout(block_tables=tables, cached_lens=cached, query_lens=qlens)
            plan = backend.plan(layout, kind)
            ids_t = torch.tensor(
                [tokens[r][c + i] for r, (c, q) in enumerate(zip(cached, qlens)) for i in range(q)],
                device=DEV,
            )
            out = target(ids_t, plan, backend, tpool, aux_layers=aux)
            # draft fill over the same rows: token t[i+1], context = target aux hidden at i
            nxt = torch.tensor(
                [tokens[r][c + i + 1] for r, (c, q) in enumerate(zip(cached, qlens)) for i in range(q)],
                device=DEV,
            )
            with torch.no_grad():
                d = draft(nxt, out.aux_hidden, plan, backend, dpool, context_is_aux=True)
            results[name].append((out.logits, out.hidden, d.logits))

    for step, ((lt, ht, dt), (lf, hf, df)) in enumerate(zip(results["torch"], results["flashinfer"])):
        assert torch.isfinite(lf).all() and torch.isfinite(df).all()
        assert rel_err(hf, ht) <= REL_TOL, (step, "hidden", rel_err(hf, ht))
        assert rel_err(lf, lt) <= REL_TOL, (step, "target logits", rel_err(lf, lt))
        assert rel_err(df, dt) <= REL_TOL, (step, "draft logits", rel_err(df, dt))
    # and the pools agree on every position written (target and draft alike)
    for which in (0, 1):
        a, b = pools["flashinfer"][which].data, pools["torch"][which].data
        pages = torch.tensor([p for t in tables for p in t], device=DEV)
        assert rel_err(a[:, pages], b[:, pages]) <= REL_TOL
