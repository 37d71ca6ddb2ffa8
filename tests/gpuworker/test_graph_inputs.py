"""The inputs a padded run or CUDA-graph replay reads (``ForwardGraphs``), on CPU.

Every graph of a forward reads its inputs from one shared buffer of the largest shape, and the
eager "pad" mode reads the same buffers, so what these tests see is what a replay reads:

* the padding rows past this run's requests are zero on every run, whatever an earlier run of
  another (bucket, q) left there. Regression: a fill at q = 4 over 6 requests (bucket 8) left
  ``last[5] = 23``; a later fill at q = 1 over 5 requests in the same bucket replayed
  ``index_select(0, last)`` over 8 rows with it: a device-side assert on the H200 (found under
  session 22's pre-planned fill, which runs most fills at q = k + 1; without it the same mix
  comes from a real draft, whose accepted count, hence the fill's q, changes every step while
  requests finish).
* ``check_inputs`` turns an out-of-range index into an ``InvalidArgument`` naming the row.
* a padded run's outputs are valid until the next padded run of any forward, as a replay's are
  until the next replay of any graph (they are that graph's memory): kept past it, they read as
  poison on the CPU too.
* the engine, padded, with the GPU test's mix (6 sampled/penalized requests at k = 3, requests
  finishing at different steps), runs with every input range-checked.
"""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.gpuworker.attention.base import BatchLayout, get_backend
from services.gpuworker.engine.graphs import ForwardGraphs
from services.gpuworker.engine.local import run_until_done, submit
from services.gpuworker.engine.sampling import SamplingParams
from test_engine_support import make_setup, models, prompts

BS = 4
SCRATCH = 31


def tiny_graphs(check_inputs: bool = False) -> ForwardGraphs:
    """Graphs (pad mode, buckets 1..8) with one forward shaped like the EAGLE-3 fill: ``ids``
    per row, ``last`` per request, logits of rows ``last`` (``index_select``)."""
    target, _ = models("none")
    backend = get_backend("torch", "cpu", target.attention_geometry(BS))
    graphs = ForwardGraphs(backend, scratch_block=SCRATCH, buckets=(1, 2, 4, 8), capture=False,
                           check_inputs=check_inputs)
    table = torch.arange(100, dtype=torch.float32)

    def fn(plan, ids, last):
        hidden = table.index_select(0, ids)  # [B * q]
        return {"hidden": hidden, "logits": hidden.index_select(0, last)}

    graphs.register("fill", fn, {"ids": ((), torch.long), "last": ((), torch.long)}, range(1, BS + 1),
                    per_request=("last", "logits"), bounds={"ids": 100, "last": lambda b, q: b * q})
    return graphs


def layout(batch: int, q: int) -> BatchLayout:
    return BatchLayout(block_tables=[[b] for b in range(batch)], cached_lens=[0] * batch, query_lens=[q] * batch)


def fill_inputs(batch: int, q: int, n: int | None = None) -> dict[str, torch.Tensor]:
    """Row ``b * q + j`` holds token ``10 * b + j``; request b's last real row is ``n - 1``."""
    n = q if n is None else n
    ids = torch.tensor([10 * b + j for b in range(batch) for j in range(q)])
    return {"ids": ids, "last": torch.tensor([b * q + n - 1 for b in range(batch)])}


def test_padding_rows_are_zero_after_a_larger_run_of_another_q():
    graphs = tiny_graphs()
    out, _ = graphs.run("fill", layout(6, 4), fill_inputs(6, 4))  # bucket 8: last[:6] up to 23
    assert out["logits"].tolist() == [10.0 * b + 3 for b in range(6)]
    # bucket 8 again, q = 1: 8 rows; a stale last[5] = 23 would index past them
    out, _ = graphs.run("fill", layout(5, 1), fill_inputs(5, 1))
    assert out["logits"].tolist() == [10.0 * b for b in range(5)]
    staged = graphs._input_buffers["fill"]
    assert staged["last"][5:].eq(0).all() and staged["ids"][5:].eq(0).all()
    # and back up: nothing of the q = 1 run leaks into a larger one either
    out, _ = graphs.run("fill", layout(7, 2), fill_inputs(7, 2, n=1))
    assert out["logits"].tolist() == [10.0 * b for b in range(7)]
    assert staged["last"][7:].eq(0).all() and staged["ids"][14:].eq(0).all()


def test_check_inputs_names_the_out_of_range_row():
    graphs = tiny_graphs(check_inputs=True)
    bad = fill_inputs(3, 2)
    bad["last"][1] = 8  # bucket 4 x q 2 = 8 rows
    with pytest.raises(InvalidArgument, match=r"fill \(bucket 4, q 2\): input 'last' row 1 holds 8, outside \[0, 8\)"):
        graphs.run("fill", layout(3, 2), bad)
    bad = fill_inputs(3, 2)
    bad["ids"][4] = -1  # a PENDING placeholder where a token should be
    with pytest.raises(InvalidArgument, match="input 'ids' row 4 holds -1"):
        graphs.run("fill", layout(3, 2), bad)
    out, _ = graphs.run("fill", layout(3, 2), fill_inputs(3, 2))
    assert out["logits"].tolist() == [1.0, 11.0, 21.0]


def test_inputs_of_the_wrong_name_or_shape_are_refused():
    graphs = tiny_graphs()
    extra = {**fill_inputs(3, 2), "hidden": torch.zeros(6, 4)}
    with pytest.raises(InvalidArgument, match=r"fill: inputs it does not take: \['hidden'\]"):
        graphs.run("fill", layout(3, 2), extra)
    missing = fill_inputs(3, 2)
    del missing["last"]
    with pytest.raises(InvalidArgument, match="fill: input 'last' missing"):
        graphs.run("fill", layout(3, 2), missing)
    short = fill_inputs(3, 2)
    short["ids"] = short["ids"][:5]
    with pytest.raises(InvalidArgument, match=r"fill: input 'ids' has shape \(5,\), expected \(6, \*\(\)\)"):
        graphs.run("fill", layout(3, 2), short)


def test_check_inputs_from_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_CHECK_GRAPH_INPUTS", "1")
    target, _ = models("none")
    backend = get_backend("torch", "cpu", target.attention_geometry(BS))
    assert ForwardGraphs(backend, scratch_block=SCRATCH, buckets=(1, 2), capture=False).check_inputs
    monkeypatch.delenv("TANDEM_CHECK_GRAPH_INPUTS")
    assert not ForwardGraphs(backend, scratch_block=SCRATCH, buckets=(1, 2), capture=False).check_inputs


def test_padded_engine_with_penalties_and_sampling_keeps_every_input_in_range():
    """The mix of the GPU test that hit the assert (greedy and seeded sampling with penalties;
    k = 3; logprobs; here 8 requests, bucket 8), padded, every run's inputs range-checked; fills
    of several q ran in the bucket of 8, a larger q before a smaller one, with padding rows."""
    kinds = {"g": SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3),
             "s": SamplingParams(temperature=0.8, seed=1, presence_penalty=0.7, repetition_penalty=1.2)}
    setup = make_setup("eagle3", chunk_size=32, max_batch_tokens=128, max_batch_size=8, graphs="pad",
                       check_graph_inputs=True)
    graphs = setup.engine.graphs
    assert graphs.check_inputs
    fills, original = [], graphs.run

    def spy(name, layout, inputs, **kw):
        if name == "fill":
            fills.append((graphs.bucket(layout.batch_size), layout.batch_size, layout.arrays.uniform_q))
        return original(name, layout, inputs, **kw)

    graphs.run = spy
    # 8 requests finishing at staggered steps: the batch shrinks inside the bucket of 8 while the
    # fill's q moves between k + 1 and 1
    for i, p in enumerate(prompts((5, 9, 13, 20), seed=3)):
        for name, sampling in kinds.items():
            submit(setup, f"{name}{i}", p, max_new_tokens=24 + 3 * i, k=3, sampling=sampling, logprobs=2)
    done = run_until_done(setup)
    assert len(done) == 8 and all(len(c.tokens) > 0 for c in done.values())
    # the shape of the regression: in one bucket, a padded fill at a smaller q after a larger one
    seen_q: dict[int, int] = {}
    mixed = False
    for bucket, batch, q in fills:
        if batch < bucket and q < seen_q.get(bucket, 0):
            mixed = True
        seen_q[bucket] = max(seen_q.get(bucket, 0), q)
    assert mixed, fills


def test_padded_engine_with_an_eagle3_layer_wider_than_the_target():
    """An EAGLE-3 draft layer may have its own hidden size (``Eagle3Draft``: public checkpoints
    record it); the chain reads that width back, so its shared input buffer has it too (the
    buffer was the target's width: every padded chain step was an ``InvalidArgument``, and a
    capture a shape error at start-up). Padded output equals unpadded output."""
    import dataclasses

    from services.gpuworker.engine.engine import EngineConfig
    from services.gpuworker.engine.local import build_local
    from services.gpuworker.model.draft import build_draft
    from services.gpuworker.model.layers import init_weights

    target, draft = models("eagle3")
    tc = target.config
    wide = build_draft(target, dataclasses.replace(draft.config, layer=dataclasses.replace(tc, hidden_size=2 * tc.hidden_size)))
    init_weights(wide, torch.Generator().manual_seed(5), 0.02)
    wide.eval()
    assert wide.chain_hidden_size == 2 * tc.hidden_size != draft.chain_hidden_size
    runs = {}
    for graphs in ("off", "pad"):
        setup = build_local(models=(target, wide), num_blocks=200, block_size=BS,
                            config=EngineConfig(graphs=graphs, max_batch_size=4, check_graph_inputs=graphs == "pad"))
        for i, p in enumerate(prompts((7, 11, 15), seed=4)):
            submit(setup, f"r{i}", p, max_new_tokens=12, k=3)
        runs[graphs] = {rid: c.tokens for rid, c in run_until_done(setup).items()}
        if graphs == "pad":
            assert setup.engine.graphs.eager_runs > 0
    assert runs["pad"] == runs["off"]


def test_outputs_are_valid_until_the_next_run_of_any_forward():
    graphs = tiny_graphs()
    graphs.register("other", lambda plan, ids: {"out": ids.float() * 2}, {"ids": ((), torch.long)}, (1,))
    out, _plan = graphs.run("fill", layout(2, 1), fill_inputs(2, 1))
    assert out["hidden"].tolist() == [0.0, 10.0] and out["logits"].tolist() == [0.0, 10.0]
    kept = out["hidden"].clone()  # what a caller that needs it later must do
    other, _plan = graphs.run("other", layout(2, 1), {"ids": torch.tensor([3, 4])})
    assert other["out"].tolist() == [6.0, 8.0]
    # the fill's outputs were rewritten by the other forward's run; the copy was not
    assert torch.isnan(out["hidden"]).all() and torch.isnan(out["logits"]).all()
    assert kept.tolist() == [0.0, 10.0]
    again, _plan = graphs.run("fill", layout(2, 1), fill_inputs(2, 1))
    assert again["hidden"].tolist() == [0.0, 10.0] and torch.isnan(other["out"]).all()
