"""The shared planner (``AttentionBackend._common_plan``) against a per-token reference written
from the documented semantics, over random layouts of every kind; the flat K/V rows it hands to
index-copy writers; and the address stability that CUDA-graph replays rely on."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from services.common.errors import InvalidArgument
from services.gpuworker.attention.base import AttentionGeometry, AttentionKind, BatchLayout, get_backend

BS = 4
GEOM = AttentionGeometry(num_qo_heads=4, num_kv_heads=2, head_dim=8, block_size=BS)


def reference_plan(layout: BatchLayout, bs: int) -> dict:
    """Every plan field, token by token and request by request in plain Python."""
    positions, slots, k_rows, v_rows, batch = [], [], [], [], []
    qo, page_indptr, page_indices, last = [0], [0], [], []
    kv_lens = []
    for r, (table, c, n) in enumerate(zip(layout.block_tables, layout.cached_lens, layout.query_lens)):
        for p in range(c, c + n):
            page, off = table[p // bs], p % bs
            positions.append(p)
            slots.append(page * bs + off)
            k_rows.append(page * 2 * bs + off)
            v_rows.append(page * 2 * bs + bs + off)
            batch.append(r)
        kv = c + n
        kv_lens.append(kv)
        qo.append(qo[-1] + n)
        used = -(-kv // bs)
        page_indices.extend(table[:used])
        page_indptr.append(page_indptr[-1] + used)
        last.append(kv - (used - 1) * bs)
    width = max(1, max(len(t) for t in layout.block_tables))
    tables = [list(t) + [-1] * (width - len(t)) for t in layout.block_tables]
    return {
        "positions": positions,
        "slot_mapping": slots,
        "k_rows": k_rows,
        "v_rows": v_rows,
        "batch_indices": batch,
        "qo_indptr": qo,
        "kv_lens": kv_lens,
        "kv_page_indptr": page_indptr,
        "kv_page_indices": page_indices,
        "kv_last_page_len": last,
        "block_tables": tables,
        "num_tokens": len(positions),
        "batch_size": len(kv_lens),
        "max_query_len": max(layout.query_lens),
        "max_kv_len": max(kv_lens),
        "max_block_id": max(b for t in layout.block_tables for b in t),
    }


DTYPES = {"positions": torch.int64, "slot_mapping": torch.int64, "k_rows": torch.int64, "v_rows": torch.int64}


def random_layout(rng: random.Random, kind: AttentionKind, num_blocks: int = 400) -> BatchLayout:
    B = rng.randint(1, 9)
    q = {AttentionKind.DECODE: [1] * B, AttentionKind.VERIFY: [rng.randint(2, 5)] * B}.get(
        kind, [rng.randint(1, 13) for _ in range(B)]
    )
    cached = [rng.randint(0, 40) for _ in range(B)]
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-(c + n) // BS) + rng.randint(0, 3))] for c, n in zip(cached, q)]
    return BatchLayout(tables, cached, q)


@pytest.mark.parametrize("kind", list(AttentionKind))
def test_planner_matches_the_per_token_reference(kind):
    rng = random.Random(kind.value)  # str seeds are deterministic (unlike hash())
    backend = get_backend("torch", "cpu", GEOM)
    for _ in range(30):
        layout = random_layout(rng, kind)
        plan = backend.plan(layout, kind)
        want = reference_plan(layout, BS)
        for name, value in want.items():
            got = getattr(plan, name)
            if isinstance(got, torch.Tensor):
                assert got.dtype == DTYPES.get(name, torch.int32), name
                got = got.tolist()
            assert got == value, (name, layout)
        assert plan.query_len == (None if kind is AttentionKind.PREFILL else layout.query_lens[0])
        # the host copies agree with the device tensors FlashInfer's planner would otherwise read
        for name in ("qo_indptr", "kv_lens", "kv_page_indptr", "kv_last_page_len"):
            assert plan.host[name].tolist() == want[name], name
        assert plan.host["used_pages"].tolist() == [b - a for a, b in zip(want["kv_page_indptr"], want["kv_page_indptr"][1:])]


def test_flat_rows_address_the_same_cells_as_the_slot_mapping():
    backend = get_backend("torch", "cpu", GEOM)
    layout = BatchLayout([[5, 1, 7], [2, 0]], [6, 1], [3, 4])
    plan = backend.plan(layout)
    pool = torch.zeros(8, 2, BS, 2, 8)
    flat = pool.view(-1, 2, 8)
    k = torch.arange(1, 8, dtype=torch.float32).view(7, 1, 1).expand(7, 2, 8)
    flat.index_copy_(0, plan.k_rows, k)
    flat.index_copy_(0, plan.v_rows, -k)
    pages, offs = plan.slot_mapping // BS, plan.slot_mapping % BS
    assert torch.equal(pool[pages, 0, offs], k) and torch.equal(pool[pages, 1, offs], -k)
    assert int((pool != 0).sum()) == 2 * k.numel()  # nothing else was touched


def test_replans_keep_per_layer_tensors_at_stable_addresses():
    """Re-planning a DECODE/VERIFY key with longer tables and more pages moves no tensor a
    captured forward reads (positions, slots, K/V rows, request metadata)."""
    backend = get_backend("torch", "cpu", GEOM)
    stable = ("positions", "slot_mapping", "k_rows", "v_rows", "batch_indices", "qo_indptr", "kv_lens",
              "kv_page_indptr", "kv_last_page_len")
    first = backend.plan(BatchLayout([[1], [2]], [0, 1], [2, 2]), AttentionKind.VERIFY)
    addresses = {n: getattr(first, n).data_ptr() for n in stable}
    tables = [list(range(10, 60)), list(range(60, 110))]
    second = backend.plan(BatchLayout(tables, [150, 190], [2, 2]), AttentionKind.VERIFY)
    assert {n: getattr(second, n).data_ptr() for n in stable} == addresses
    assert second.positions.tolist() == [150, 151, 190, 191]
    assert second.kv_page_indices.numel() == 38 + 48


# -- BatchLayout: lists or arrays, vectorized checks, the same errors ---------------------------


def _plans_equal(a, b) -> None:
    for name in ("positions", "slot_mapping", "k_rows", "v_rows", "batch_indices", "qo_indptr", "kv_lens",
                 "kv_page_indptr", "kv_page_indices", "kv_last_page_len", "block_tables"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("kind", "num_tokens", "query_len", "max_query_len", "max_kv_len", "max_block_id"):
        assert getattr(a, name) == getattr(b, name), name


def test_array_layouts_plan_like_lists():
    tables = [[9, 4, 7], [3, 11, 5]]
    as_lists = BatchLayout(tables, [5, 2], [3, 3])
    rect = BatchLayout(np.array(tables, dtype=np.int32), np.array([5, 2]), np.array([3, 3], dtype=np.uint8))
    ragged_lists = BatchLayout([[9, 4], [3, 11, 5, 8]], [5, 2], [3, 1])
    ragged_rows = BatchLayout([np.array([9, 4]), np.array([3, 11, 5, 8])], np.array([5, 2]), [3, 1])
    for kind in (AttentionKind.VERIFY, AttentionKind.PREFILL):
        _plans_equal(get_backend("torch", "cpu", GEOM).plan(as_lists, kind),
                     get_backend("torch", "cpu", GEOM).plan(rect, kind))
    _plans_equal(get_backend("torch", "cpu", GEOM).plan(ragged_lists),
                 get_backend("torch", "cpu", GEOM).plan(ragged_rows))
    assert rect.kv_lens == [8, 5] and rect.capacities(BS) == [12, 12] and rect.num_tokens == 6
    assert ragged_rows.arrays.tables.tolist() == [[9, 4, -1, -1], [3, 11, 5, 8]]
    assert ragged_rows.arrays.widths.tolist() == [2, 4]


def test_layout_keeps_caller_arrays_writable_and_its_own_read_only():
    tables = np.arange(6, dtype=np.int64).reshape(2, 3)
    layout = BatchLayout(tables, np.zeros(2, dtype=np.int64), np.ones(2, dtype=np.int64))
    tables[0, 0] = 0  # the caller's array is still the caller's
    with pytest.raises(ValueError):
        layout.arrays.tables[0, 0] = 5


@pytest.mark.parametrize("to_array", [False, True], ids=["lists", "arrays"])
@pytest.mark.parametrize(
    "tables,cached,qlens,message",
    [
        ([[1], [2]], [0, 0], [1, 0], "request 1: query_len must be >= 1, got 0"),
        ([[1], [2]], [0, -3], [1, 1], "request 1: cached_len must be >= 0, got -3"),
        ([[1, 2], [-1, 4]], [0, 0], [1, 1], "request 1: block ids must be non-negative integers"),
        ([[1, 2], [3]], [0, 0], [2, 1], None),  # valid (ragged)
    ],
)
def test_layout_errors_name_the_first_bad_request(to_array, tables, cached, qlens, message):
    if to_array:
        rows = [np.array(t) for t in tables]
        tables = np.array(tables) if len({len(t) for t in tables}) == 1 else rows
        cached, qlens = np.array(cached), np.array(qlens)
    if message is None:
        assert BatchLayout(tables, cached, qlens).batch_size == 2
        return
    with pytest.raises(InvalidArgument) as err:
        BatchLayout(tables, cached, qlens)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "tables,cached,qlens",
    [
        ([[1.0]], [0], [1]),  # a float block id is not silently cast
        ([["3"]], [0], [1]),
        ([[1]], [0.5], [1]),
        ([[1]], [0], [True]),
        ([[1], [[2]]], [0, 0], [1, 1]),  # a nested table
        ([1], [0], [1]),  # a table that is no sequence
        (np.array([[1.5, 2.0]]), [0], [1]),
        ([[1]], np.zeros((1, 1), dtype=np.int64), [1]),
        ([[2**31]], [0], [1]),  # ids and lengths must fit the int32 plans
        ([[1]], [2**31 - 1], [1]),
        ([[1]], [2**70], [1]),
        ([], [], []),
        ([[1]], [0, 0], [1]),
    ],
)
def test_layout_rejects_non_integers_and_out_of_range_values(tables, cached, qlens):
    with pytest.raises(InvalidArgument):
        BatchLayout(tables, cached, qlens)


def test_capacity_error_names_the_request():
    backend = get_backend("torch", "cpu", GEOM)
    layout = BatchLayout(np.array([[1, 2], [3, 4]]), np.array([4, 6]), np.array([3, 3]))
    with pytest.raises(InvalidArgument, match=r"request 1: kv_len 9 \(cached 6 \+ query 3\) exceeds reserved "
                                              r"capacity 8 \(2 blocks of 4\)"):
        backend.plan(layout, AttentionKind.VERIFY)


def test_shifted_and_padded_layouts_plan_like_layouts_built_from_scratch():
    """``shifted`` (a speculative step's chain positions), ``padded`` (a graph bucket's rows) and
    ``with_cached_lens`` (the next fused step of the same batch) reuse the validated tables; their
    plans equal those of layouts validated from lists."""
    rng = random.Random("derived")
    for _ in range(20):
        base = random_layout(rng, AttentionKind.VERIFY)
        tables, cached = base.block_tables, base.cached_lens
        for delta, q in ((0, 1), (2, 1), (1, 3)):
            fits = all(c + delta + q <= len(t) * BS for t, c in zip(tables, cached))
            got = base.shifted(delta, q)
            want = BatchLayout(tables, [c + delta for c in cached], [q] * len(tables))
            kind = AttentionKind.DECODE if q == 1 else AttentionKind.VERIFY
            if fits:
                _plans_equal(get_backend("torch", "cpu", GEOM).plan(got, kind),
                             get_backend("torch", "cpu", GEOM).plan(want, kind))
            else:  # the capacity check still sees the shifted lengths
                with pytest.raises(InvalidArgument, match="exceeds reserved capacity"):
                    get_backend("torch", "cpu", GEOM).plan(got, kind)
        q = min(base.query_lens[0], BS)  # a padding row holds one page
        base = base.shifted(0, q)
        got = base.padded(3, 399, q)
        want = BatchLayout(list(tables) + [[399]] * 3, list(cached) + [0] * 3, [q] * (len(tables) + 3))
        _plans_equal(get_backend("torch", "cpu", GEOM).plan(got, AttentionKind.VERIFY),
                     get_backend("torch", "cpu", GEOM).plan(want, AttentionKind.VERIFY))
        assert got.arrays.widths.tolist() == want.arrays.widths.tolist()
        assert base.padded(0, 399, q).arrays.tables.tolist() == base.arrays.tables.tolist()
        # the next step of the same batch: new cached lengths (some fit, some may not)
        moved = np.array([rng.randrange(0, len(t) * BS) for t in tables], dtype=np.int64)
        got = base.with_cached_lens(moved)
        want = BatchLayout(tables, moved.tolist(), [q] * len(tables))
        if all(c + q <= len(t) * BS for t, c in zip(tables, moved.tolist())):
            _plans_equal(get_backend("torch", "cpu", GEOM).plan(got, AttentionKind.VERIFY),
                         get_backend("torch", "cpu", GEOM).plan(want, AttentionKind.VERIFY))
        else:
            with pytest.raises(InvalidArgument, match="exceeds reserved capacity"):
                get_backend("torch", "cpu", GEOM).plan(got, AttentionKind.VERIFY)


def test_shifted_and_padded_refuse_bad_arguments_and_leave_the_layout_alone():
    base = BatchLayout([[5, 1], [2]], [3, 0], [2, 2])
    for bad in ((-1, 1), (0, 0), (0.5, 1), (0, True)):
        with pytest.raises(InvalidArgument):
            base.shifted(*bad)
    for bad in ((-1, 3, 2), (1, -2, 2), (1.0, 3, 2), (1, 3, 0), (1, 3, -4), (1, 3, 1.7), (1, 3, True)):
        with pytest.raises(InvalidArgument):
            base.padded(*bad)
    lens = np.array([4, 1], dtype=np.int64)
    moved = base.with_cached_lens(lens)
    lens[0] = 9  # the caller's array stays the caller's: the layout copied it
    assert moved.arrays.cached.tolist() == [4, 1] and moved.kv_lens == [6, 3] and not moved.arrays.cached.flags.writeable
    assert lens.flags.writeable
    for bad in ([4, 1], np.array([4.0, 1.0]), np.array([4, 1], dtype=np.int32), np.array([4, 1, 0]), np.array([4, -1])):
        with pytest.raises(InvalidArgument):
            base.with_cached_lens(bad)
    assert base.arrays.cached.tolist() == [3, 0] and base.arrays.q.tolist() == [2, 2]
    shifted = base.shifted(1, 1)
    assert shifted.arrays.cached.tolist() == [4, 1] and shifted.kv_lens == [5, 2] and shifted.arrays.uniform_q == 1
    assert not shifted.arrays.cached.flags.writeable
