"""The attention interface and the torch reference backend: plan metadata, paged writes, causal
attention against a naive per-token implementation, plan caching, and the rejections (VERIFY with
ragged lengths, KV past reserved capacity, stale plans)."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.errors import FailedPrecondition, InvalidArgument
from services.gpuworker.attention.base import AttentionGeometry, AttentionKind, BatchLayout, get_backend

BS = 4
GEOM = AttentionGeometry(num_qo_heads=4, num_kv_heads=2, head_dim=8, block_size=BS)


def _pool(num_blocks=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, 2, BS, 2, 8), generator=g).to(dtype)


def _naive(q, k_ctx, v_ctx, positions, scale):
    """One request: q [Q, qh, d]; k_ctx/v_ctx [kv_len, kvh, d] dense; token t sees 0..positions[t]."""
    qh, kvh = q.shape[1], k_ctx.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        p = int(positions[t])
        for h in range(qh):
            kvi = h // (qh // kvh)
            scores = [float(q[t, h].double() @ k_ctx[j, kvi].double()) * scale for j in range(p + 1)]
            m = max(scores)
            w = [math.exp(s - m) for s in scores]
            z = sum(w)
            out[t, h] = sum(w[j] / z * v_ctx[j, kvi].double() for j in range(p + 1))
    return out


def _dense_of(kv_layer, table, n):
    """Positions 0..n-1 of a request, read page by page (independent of the backend's gathers)."""
    ks, vs = [], []
    for pos in range(n):
        page, off = table[pos // BS], pos % BS
        ks.append(kv_layer[page, 0, off])
        vs.append(kv_layer[page, 1, off])
    if not ks:
        empty = kv_layer.new_zeros((0, *kv_layer.shape[3:]))
        return empty, empty
    return torch.stack(ks), torch.stack(vs)


def _run_case(cached, qlens, kind, dtype=torch.float32, seed=0):
    rng = random.Random(seed)
    ids = list(range(24))
    rng.shuffle(ids)
    tables = []
    for c, q in zip(cached, qlens):
        need = -(-(c + q) // BS) + rng.randint(0, 1)  # sometimes a spare headroom page
        tables.append([ids.pop() for _ in range(need)])
    layout = BatchLayout(tables, list(cached), list(qlens))
    backend = get_backend("torch", "cpu", GEOM)
    plan = backend.plan(layout, kind)
    kv = _pool(dtype=dtype, seed=seed)
    before = kv.clone()
    g = torch.Generator().manual_seed(seed + 1)
    T = sum(qlens)
    q = torch.randn((T, 4, 8), generator=g).to(dtype)
    k = torch.randn((T, 2, 8), generator=g).to(dtype)
    v = torch.randn((T, 2, 8), generator=g).to(dtype)
    backend.write_kv(plan, kv, k, v)
    out = backend.attend(plan, q, kv, scale=0.35)
    return layout, plan, kv, before, q, k, v, out


@pytest.mark.parametrize(
    "cached,qlens,kind",
    [
        ([0, 5, 9], [7, 1, 3], None),  # ragged prefill, one request with an empty cache
        ([3, 8, 0, 12], [1, 1, 1, 1], None),  # decode
        ([2, 9, 4], [4, 4, 4], AttentionKind.VERIFY),  # multi-token decode
    ],
)
def test_torch_backend_matches_naive_attention(cached, qlens, kind):
    layout, plan, kv, before, q, k, v, out = _run_case(cached, qlens, kind)
    expected_kind = kind or (AttentionKind.DECODE if set(qlens) == {1} else AttentionKind.PREFILL)
    assert plan.kind is expected_kind
    start = 0
    for r, (c, n) in enumerate(zip(cached, qlens)):
        # the new K/V landed at positions c..c+n-1, the cached positions kept their contents
        k_ctx, v_ctx = _dense_of(kv, layout.block_tables[r], c + n)
        k_old, _ = _dense_of(before, layout.block_tables[r], c)
        torch.testing.assert_close(k_ctx[:c], k_old)
        torch.testing.assert_close(k_ctx[c:], k[start : start + n])
        torch.testing.assert_close(v_ctx[c:], v[start : start + n])
        ref = _naive(q[start : start + n], k_ctx, v_ctx, range(c, c + n), 0.35)
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=1e-5, rtol=1e-5)
        start += n


def test_write_touches_only_the_planned_slots():
    layout, plan, kv, before, *_ = _run_case([1, 6], [5, 2], None, seed=3)
    changed = (kv != before).flatten(2).any(-1)  # [num_blocks, 2]
    written = set()
    for table, c, n in zip(layout.block_tables, layout.cached_lens, layout.query_lens):
        for pos in range(c, c + n):
            written.add((table[pos // BS], pos % BS))
    diff = (kv != before).any(dim=(3, 4))  # [num_blocks, 2, BS]
    touched = {(int(b), int(o)) for b, _, o in diff.nonzero().tolist()}
    assert touched == written
    assert changed.any()


# the backend's math runs in float32, so float64 gets float32 tolerance
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float64, 1e-5)])
def test_torch_backend_any_dtype(dtype, tol):
    layout, plan, kv, _, q, k, v, out = _run_case([3, 0], [2, 5], None, dtype=dtype, seed=5)
    assert out.dtype == dtype and kv.dtype == dtype
    start = 0
    for r, (c, n) in enumerate(zip(layout.cached_lens, layout.query_lens)):
        k_ctx, v_ctx = _dense_of(kv, layout.block_tables[r], c + n)
        ref = _naive(q[start : start + n], k_ctx, v_ctx, range(c, c + n), 0.35)
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=tol, rtol=tol)
        start += n


def test_plan_metadata_for_the_documented_example():
    # the diagram in attention/base.py: table [7, 2, 9], block size 4, cached 5, query 3
    backend = get_backend("torch", "cpu", GEOM)
    plan = backend.plan(BatchLayout([[7, 2, 9], [4]], [5, 0], [3, 2]))
    assert plan.positions.tolist() == [5, 6, 7, 0, 1]
    assert plan.slot_mapping.tolist() == [2 * BS + 1, 2 * BS + 2, 2 * BS + 3, 4 * BS, 4 * BS + 1]
    assert plan.qo_indptr.tolist() == [0, 3, 5]
    assert plan.kv_lens.tolist() == [8, 2]
    # only pages holding positions < kv_len: page 9 of request 0 is headroom
    assert plan.kv_page_indptr.tolist() == [0, 2, 3]
    assert plan.kv_page_indices.tolist() == [7, 2, 4]
    assert plan.kv_last_page_len.tolist() == [4, 2]
    assert plan.block_tables.tolist() == [[7, 2, 9], [4, -1, -1]]
    assert plan.batch_indices.tolist() == [0, 0, 0, 1, 1]
    assert (plan.max_kv_len, plan.max_query_len, plan.max_block_id) == (8, 3, 9)


def test_plan_cache_reuses_workspaces_and_rejects_stale_plans():
    backend = get_backend("torch", "cpu", GEOM)
    kv = _pool()
    k = torch.zeros((2, 2, 8))
    a = backend.plan(BatchLayout([[1], [2]], [0, 3], [1, 1]))
    assert (backend.stats.hits, backend.stats.misses) == (0, 1)
    verify = backend.plan(BatchLayout([[3, 4], [5, 6]], [1, 2], [3, 3]), AttentionKind.VERIFY)
    assert (backend.stats.hits, backend.stats.misses) == (0, 2)
    b = backend.plan(BatchLayout([[5], [6]], [2, 1], [1, 1]))  # same key as a: decode, batch 2
    assert (backend.stats.hits, backend.stats.misses) == (1, 2)
    assert b.positions.data_ptr() == a.positions.data_ptr()  # the workspace buffers were reused
    with pytest.raises(FailedPrecondition):
        backend.write_kv(a, kv, k, k)  # a's buffers now describe b
    backend.write_kv(b, kv, k, k)  # the newest plan of the key works
    k6 = torch.zeros((6, 2, 8))
    backend.write_kv(verify, kv, k6, k6)  # a plan of another key is untouched by re-planning
    backend.plan(BatchLayout([[5], [6], [7]], [0, 0, 0], [1, 1, 1]))  # batch 3: new key
    assert backend.stats.misses == 3
    other = get_backend("torch", "cpu", GEOM)
    other.plan(BatchLayout([[5], [6]], [2, 1], [1, 1]))  # same key and generation count as b
    with pytest.raises(FailedPrecondition, match="another backend"):
        other.write_kv(b, kv, k, k)


def test_verify_needs_uniform_query_lengths_and_decode_needs_one():
    backend = get_backend("torch", "cpu", GEOM)
    with pytest.raises(InvalidArgument, match="PREFILL"):
        backend.plan(BatchLayout([[1, 2], [3, 4]], [0, 0], [3, 4]), AttentionKind.VERIFY)
    with pytest.raises(InvalidArgument):
        backend.plan(BatchLayout([[1], [3]], [0, 0], [1, 1]), AttentionKind.VERIFY)
    with pytest.raises(InvalidArgument):
        backend.plan(BatchLayout([[1], [3]], [0, 0], [2, 2]), AttentionKind.DECODE)
    # uniform lengths are still prefill unless the caller asks for VERIFY
    assert backend.plan(BatchLayout([[1], [3]], [0, 0], [2, 2])).kind is AttentionKind.PREFILL
    ragged = BatchLayout([[1, 2], [3, 4]], [0, 0], [3, 4])
    assert backend.plan(ragged, AttentionKind.PREFILL).query_len is None


def test_kv_past_reserved_capacity_is_rejected_before_any_write():
    backend = get_backend("torch", "cpu", GEOM)
    # 2 pages = 8 positions; cached 6 + 3 speculative tokens would need a third page
    with pytest.raises(InvalidArgument, match="capacity"):
        backend.plan(BatchLayout([[1, 2]], [6], [3]), AttentionKind.PREFILL)
    with pytest.raises(InvalidArgument, match="capacity"):
        backend.plan(BatchLayout([[1], [2, 3]], [4, 0], [1, 1]))
    assert backend.stats.misses == 0  # rejected before a workspace was made
    backend.plan(BatchLayout([[1, 2]], [6], [2]))  # exactly full is fine


def test_layout_and_call_validation():
    with pytest.raises(InvalidArgument):
        BatchLayout([], [], [])
    with pytest.raises(InvalidArgument):
        BatchLayout([[1]], [0, 1], [1])
    with pytest.raises(InvalidArgument):
        BatchLayout([[1]], [0], [0])
    with pytest.raises(InvalidArgument):
        BatchLayout([[-1]], [0], [1])
    with pytest.raises(InvalidArgument):
        AttentionGeometry(num_qo_heads=3, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(InvalidArgument):
        get_backend("cuda-magic", "cpu", GEOM)
    backend = get_backend("torch", "cpu", GEOM)
    plan = backend.plan(BatchLayout([[30]], [0], [2]))
    with pytest.raises(InvalidArgument, match="outside a pool"):
        backend.write_kv(plan, _pool(num_blocks=24), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))
    plan = backend.plan(BatchLayout([[3]], [0], [2]))
    with pytest.raises(InvalidArgument):
        backend.write_kv(plan, _pool(), torch.zeros(3, 2, 8), torch.zeros(3, 2, 8))
    with pytest.raises(InvalidArgument):
        backend.attend(plan, torch.zeros(2, 2, 8), _pool(), scale=1.0)


def test_cpu_path_never_imports_flashinfer():
    code = (
        "import sys, torch\n"
        "from services.gpuworker.attention import get_backend, AttentionGeometry\n"
        "from services.gpuworker.model import load_model\n"
        "import services.common.tokenizer\n"
        "get_backend('torch', 'cpu', AttentionGeometry(4, 2, 8, 4))\n"
        "load_model('tiny')\n"
        "loaded = [m for m in sys.modules if 'flashinfer' in m]\n"
        "assert not loaded, loaded\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root, env=env)
