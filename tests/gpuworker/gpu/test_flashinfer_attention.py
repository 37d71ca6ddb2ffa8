"""FlashInfer backend vs the torch reference backend on the same inputs (bf16, GPU).

Every case builds one random bf16 pool, shuffled block tables with reserved headroom past the
logical length, and writes this forward's K/V through both backends into two copies of the pool:

    pages of a request:  [ cached | written now ][ headroom (NaN in the FlashInfer copy) ]

The FlashInfer copy has NaN in every page no request's logical KV covers, the torch copy has
zeros there: equal outputs prove FlashInfer reads only positions ``0..kv_len-1``. Written pages
must be bit-identical, attention outputs within a relative error of 2e-2 (measured ~2e-3).
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from services.common.errors import FailedPrecondition, InvalidArgument
from services.gpuworker.attention.base import AttentionGeometry, AttentionKind, BatchLayout, get_backend
from services.gpuworker.attention.flashinfer_backend import FlashInferBackend

pytestmark = pytest.mark.gpu

DEV = "cuda"
BS = 16
# head_dim 128, bf16: the benchmark model's, so one FlashInfer JIT build serves tests and bench
GEOM = AttentionGeometry(num_qo_heads=8, num_kv_heads=2, head_dim=128, block_size=BS, dtype=torch.bfloat16)
HD = GEOM.head_dim
REL_TOL = 2e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def make_layout(cached: list[int], qlens: list[int], num_blocks: int, seed: int) -> BatchLayout:
    """Disjoint shuffled tables with 0-2 pages of reserved headroom per request."""
    rng = random.Random(seed)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = []
    for c, q in zip(cached, qlens):
        need = -(-(c + q) // BS) + rng.randint(0, 2)
        tables.append([ids.pop() for _ in range(need)])
    return BatchLayout(block_tables=tables, cached_lens=list(cached), query_lens=list(qlens))


def logical_pages(layout: BatchLayout) -> list[int]:
    return [p for t, n in zip(layout.block_tables, layout.kv_lens) for p in t[: -(-n // BS)]]


def pools_for(layout: BatchLayout, num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FlashInfer pool with NaN outside logical pages, torch pool with zeros there)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    shape = (num_blocks, 2, BS, GEOM.num_kv_heads, GEOM.head_dim)
    base = torch.randn(shape, generator=g, device=DEV).to(torch.bfloat16)
    keep = torch.zeros(num_blocks, dtype=torch.bool, device=DEV)
    keep[torch.tensor(logical_pages(layout), device=DEV)] = True
    mask = keep.view(-1, 1, 1, 1, 1)
    return torch.where(mask, base, float("nan")), torch.where(mask, base, 0.0)


def qkv(T: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(T, GEOM.num_qo_heads, GEOM.head_dim, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(T, GEOM.num_kv_heads, GEOM.head_dim, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn(T, GEOM.num_kv_heads, GEOM.head_dim, generator=g, device=DEV).to(torch.bfloat16)
    return q, k, v


@pytest.fixture(scope="module")
def fi():
    return get_backend("flashinfer", DEV, GEOM)


@pytest.fixture(scope="module")
def ref():
    return get_backend("torch", DEV, GEOM)


def compare(fi, ref, layout, kind, *, scale=GEOM.head_dim**-0.5, seed=0, num_blocks=256):
    """Write + attend through both backends; check pools and outputs. Returns the rel. error."""
    pool_fi, pool_ref = pools_for(layout, num_blocks, seed)
    q, k, v = qkv(layout.num_tokens, seed + 1)
    plan_fi, plan_ref = fi.plan(layout, kind), ref.plan(layout, kind)
    assert plan_fi.kind is plan_ref.kind
    fi.write_kv(plan_fi, pool_fi, k, v)
    ref.write_kv(plan_ref, pool_ref, k, v)
    pages = torch.tensor(logical_pages(layout), device=DEV)
    assert torch.equal(pool_fi[pages], pool_ref[pages]), "paged writes differ"
    out = fi.attend(plan_fi, q, pool_fi, scale=scale)
    expect = ref.attend(plan_ref, q, pool_ref, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "FlashInfer read a page past the logical length"
    err = rel_err(out, expect)
    assert err <= REL_TOL, err
    return err


PLAN_FIELDS = ("positions", "slot_mapping", "batch_indices", "qo_indptr", "kv_lens", "kv_page_indptr",
               "kv_page_indices", "kv_last_page_len", "block_tables")


def test_plan_tensors_equal_the_base_plan(fi, ref):
    """The vectorized planner of the FlashInfer backend computes what the base planner does."""
    rng = random.Random(13)
    for trial in range(40):
        B = rng.randint(1, 7)
        cached = [rng.randint(0, 90) for _ in range(B)]
        kind = rng.choice([AttentionKind.PREFILL, AttentionKind.DECODE, AttentionKind.VERIFY])
        q = {AttentionKind.DECODE: [1] * B, AttentionKind.VERIFY: [3] * B}.get(
            kind, [rng.randint(1, 30) for _ in range(B)]
        )
        layout = make_layout(cached, q, 256, seed=trial)
        a, b = ref.plan(layout, kind), fi.plan(layout, kind)
        for name in PLAN_FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), (trial, name)
        for name in ("num_tokens", "batch_size", "query_len", "max_query_len", "max_kv_len", "max_block_id"):
            assert getattr(a, name) == getattr(b, name), (trial, name)


def test_decode_matches_torch(fi, ref):
    cached = [0, 14, 15, 16, 99, 332, 1000]
    layout = make_layout(cached, [1] * len(cached), 256, seed=1)
    compare(fi, ref, layout, AttentionKind.DECODE, seed=1)


def test_verify_matches_torch(fi, ref):
    """Multi-token decode: last accepted token + 3 drafts per request, causal among the 4."""
    cached = [0, 12, 13, 60, 255, 700]
    layout = make_layout(cached, [4] * len(cached), 256, seed=2)
    compare(fi, ref, layout, AttentionKind.VERIFY, seed=2)


def test_prefill_ragged_matches_torch(fi, ref):
    """Prompt chunks over cached prefixes, mixed with a one-token request."""
    cached = [0, 0, 16, 100, 5, 333]
    qlens = [1, 37, 16, 7, 300, 1]
    layout = make_layout(cached, qlens, 256, seed=3)
    compare(fi, ref, layout, AttentionKind.PREFILL, seed=3)


@pytest.mark.parametrize("kind,q", [(AttentionKind.DECODE, 1), (AttentionKind.VERIFY, 3)])
def test_large_balanced_batch_without_split_kv(fi, ref, kind, q):
    """Enough requests to fill the GPU: the backend plans without split-kv; same results."""
    B = (2 * fi._num_sms) // GEOM.num_kv_heads + 4
    rng = random.Random(21)
    layout = make_layout([rng.randint(90, 150) for _ in range(B)], [q] * B, 16 * B, seed=21)
    compare(fi, ref, layout, kind, seed=21, num_blocks=16 * B)
    plan = fi.plan(layout, kind)
    assert fi._batch_fills_gpu(plan, fi._workspaces[plan.key].state["host"])


@pytest.mark.parametrize("kind,q", [(AttentionKind.DECODE, 1), (AttentionKind.VERIFY, 3), (AttentionKind.PREFILL, 5)])
def test_non_default_scale(fi, ref, kind, q):
    """A softmax scale other than 1/sqrt(head_dim) reaches the kernel (through q_scale)."""
    layout = make_layout([40, 77], [q, q], 64, seed=4)
    compare(fi, ref, layout, kind, scale=0.37, seed=4, num_blocks=64)


def test_replan_same_key_reuses_wrapper_and_stales_old_plan(ref):
    fi = get_backend("flashinfer", DEV, GEOM)
    first = make_layout([10, 20, 30], [1, 1, 1], 128, seed=5)
    old = fi.plan(first)
    wrapper = old.extras["wrapper"]
    second = make_layout([200, 3, 64], [1, 1, 1], 128, seed=6)
    compare(fi, ref, second, AttentionKind.DECODE, seed=6, num_blocks=128)
    assert fi.stats.hits == 1 and fi.stats.misses == 1
    assert fi.plan(second).extras["wrapper"] is wrapper
    pool = torch.zeros(128, 2, BS, GEOM.num_kv_heads, HD, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(FailedPrecondition):
        fi.attend(old, torch.zeros(3, 8, HD, dtype=torch.bfloat16, device=DEV), pool, scale=0.125)


def test_rejections(fi):
    layout = make_layout([5], [1], 8, seed=7)
    plan = fi.plan(layout)
    pool = torch.zeros(8, 2, BS, 2, HD, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(InvalidArgument):  # q in the wrong dtype
        fi.attend(plan, torch.zeros(1, 8, HD, device=DEV), pool, scale=0.125)
    with pytest.raises(InvalidArgument):  # float32 pool
        fi.write_kv(plan, pool.float(), torch.zeros(1, 2, HD, device=DEV), torch.zeros(1, 2, HD, device=DEV))
    with pytest.raises(InvalidArgument):  # past the reserved capacity (one block)
        fi.plan(BatchLayout(block_tables=[[0]], cached_lens=[BS], query_lens=[1]))
    with pytest.raises(InvalidArgument):
        get_backend("flashinfer", DEV, AttentionGeometry(8, 2, HD, BS, torch.float32))
    with pytest.raises(InvalidArgument):
        get_backend("flashinfer", DEV, AttentionGeometry(8, 2, 16, BS, torch.bfloat16))
    with pytest.raises(InvalidArgument):
        get_backend("flashinfer", "cpu", GEOM)


def test_graph_mode_rejects_tables_longer_than_its_buffers():
    small = FlashInferBackend(DEV, GEOM, graph_max_pages_per_request=2)
    with pytest.raises(InvalidArgument):
        small.plan(BatchLayout(block_tables=[[0, 1, 2]], cached_lens=[40], query_lens=[1]))
    small.plan(BatchLayout(block_tables=[[0, 1, 2]], cached_lens=[20], query_lens=[1]))  # 2 pages: fine


@pytest.mark.parametrize("kind,q", [(AttentionKind.DECODE, 1), (AttentionKind.VERIFY, 4)])
def test_cuda_graph_replays_after_replan(ref, kind, q):
    """Capture write_kv + attend for two layers, re-plan the same key with other lengths and
    tables, replay: results equal the torch backend on the NEW layout."""
    fi = FlashInferBackend(DEV, GEOM, graph_max_pages_per_request=32)
    B, nb, layers = 3, 160, 2
    first = make_layout([17, 40, 3], [q] * B, nb, seed=8)
    pools = [torch.zeros(nb, 2, BS, 2, HD, dtype=torch.bfloat16, device=DEV) for _ in range(layers)]
    q_in, k_in, v_in = (t.clone() for t in qkv(B * q, seed=9))
    plan = fi.plan(first, kind)

    def forward():
        outs = []
        for pool in pools:
            fi.write_kv(plan, pool, k_in, v_in)
            outs.append(fi.attend(plan, q_in, pool, scale=0.125))
        return outs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # warm-up outside capture (allocator, lazy init)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outs = forward()

    second = make_layout([300, 5, 129], [q] * B, nb, seed=10)
    for i in range(layers):
        fresh_fi, _ = pools_for(second, nb, seed=11 + i)
        pools[i].copy_(fresh_fi)
    q2, k2, v2 = qkv(B * q, seed=12)
    q_in.copy_(q2), k_in.copy_(k2), v_in.copy_(v2)
    fi.plan(second, kind)  # same key: same buffers, new contents
    graph.replay()
    torch.cuda.synchronize()

    for i in range(layers):
        _, pool_ref = pools_for(second, nb, seed=11 + i)
        plan_ref = ref.plan(second, kind)
        ref.write_kv(plan_ref, pool_ref, k2, v2)
        expect = ref.attend(plan_ref, q2, pool_ref, scale=0.125)
        pages = torch.tensor(logical_pages(second), device=DEV)
        assert torch.equal(pools[i][pages], pool_ref[pages])
        assert rel_err(static_outs[i], expect) <= REL_TOL


@pytest.mark.parametrize("kind,q", [(AttentionKind.DECODE, 1), (AttentionKind.VERIFY, 4)])
def test_replan_equals_wrapper_plan(kind, q, monkeypatch):
    """Graph-mode re-plans skip ``wrapper.plan`` (``_replan``): over a run of layouts of one key
    whose lengths move the split-kv schedule (5 to 500 tokens), the plan info and every output
    are identical to a backend that plans through ``wrapper.plan`` each time."""
    fast = FlashInferBackend(DEV, GEOM, graph_max_pages_per_request=40)
    slow = FlashInferBackend(DEV, GEOM, graph_max_pages_per_request=40)
    monkeypatch.setattr(slow, "_can_replan", lambda plan, wrapper: False)
    B, nb = 3, 200
    rng = random.Random(21)
    for trial in range(12):
        cached = [rng.randint(5, 500) for _ in range(B)] if trial % 3 else [rng.randint(4, 20) for _ in range(B)]
        layout = make_layout(cached, [q] * B, nb, seed=30 + trial)
        pool, _ = pools_for(layout, nb, seed=40 + trial)
        q_in, k_in, v_in = qkv(B * q, seed=50 + trial)
        outs = []
        for backend in (fast, slow):
            plan = backend.plan(layout, kind)
            kv = pool.clone()
            backend.write_kv(plan, kv, k_in, v_in)
            outs.append(backend.attend(plan, q_in, kv, scale=0.125))
        wf, ws = (b._workspaces[(kind, B, q, 0)] for b in (fast, slow))
        assert wf.state["replan"] is True and ws.state["replan"] is False
        assert list(wf.state["wrapper"]._plan_info) == list(ws.state["wrapper"]._plan_info), trial
        assert torch.isfinite(outs[0]).all()
        assert torch.equal(outs[0], outs[1]), trial


def test_lanes_keep_live_plans_of_one_shape_apart(ref):
    """Two DECODE plans of one (batch, q) on lanes 0 and 1 (a fused speculative step plans its
    chain positions so) have a wrapper each: the first stays fresh and still attends its own
    layout after the second was made, in graph mode too."""
    fi = FlashInferBackend(DEV, GEOM, graph_max_pages_per_request=40)
    nb = 256
    layouts = [make_layout([10, 200, 31], [1] * 3, nb, seed=61), make_layout([90, 7, 300], [1] * 3, nb, seed=62)]
    plans = [fi.plan(layout, AttentionKind.DECODE, lane=i) for i, layout in enumerate(layouts)]
    assert plans[0].extras["wrapper"] is not plans[1].extras["wrapper"]
    for i, (layout, plan) in enumerate(zip(layouts, plans)):
        pool_fi, pool_ref = pools_for(layout, nb, seed=70 + i)
        q, k, v = qkv(3, seed=80 + i)
        fi.write_kv(plan, pool_fi, k, v)
        plan_ref = ref.plan(layout, AttentionKind.DECODE)
        ref.write_kv(plan_ref, pool_ref, k, v)
        assert rel_err(fi.attend(plan, q, pool_fi, scale=0.125), ref.attend(plan_ref, q, pool_ref, scale=0.125)) <= REL_TOL


def test_flashinfer_is_not_imported_by_cpu_paths():
    code = (
        "import sys, torch\n"
        "from services.gpuworker.attention.base import AttentionGeometry, get_backend\n"
        "import services.gpuworker.model\n"
        "get_backend('torch', 'cpu', AttentionGeometry(4, 2, 128, 16))\n"
        "assert 'flashinfer' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
