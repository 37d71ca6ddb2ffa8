"""``tandem train-demo``: the dense training forward computes what the served paged forward
computes (so the trained weights serve as trained), the stdlib corpus split is deterministic and
disjoint, and a few steps leave a loadable bf16 folder whose loss went down."""

from __future__ import annotations

import json

import torch

from services.gpuworker.attention.base import BatchLayout
from services.gpuworker.model.dense import dense_forward
from services.gpuworker.model.loader import load_model
from services.gpuworker.train_demo import main, split_corpus


def test_dense_forward_equals_the_paged_forward(tiny_target, make_backend):
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    hidden, aux = dense_forward(tiny_target, ids, aux_layers=(0, 2, 3))
    backend = make_backend(tiny_target, 8)
    kv = tiny_target.new_kv_pool(16, 8)
    plan = backend.plan(BatchLayout([[5, 1, 9], [0, 12, 3]], [0, 0], [21, 21]))
    out = tiny_target(ids.reshape(-1), plan, backend, kv, aux_layers=(0, 2, 3))
    torch.testing.assert_close(hidden.reshape(42, -1), out.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux.reshape(42, -1), out.aux_hidden, atol=1e-5, rtol=1e-5)


def test_corpus_split_is_deterministic_and_disjoint():
    train, held = split_corpus()
    assert train and held and not set(train) & set(held)
    assert (train, held) == split_corpus()
    assert all(p.suffix == ".py" and "test" not in p.parts for p in train + held)


def test_a_short_run_saves_a_loadable_model(tmp_path, capsys):
    rc = main(["--out", str(tmp_path), "--steps", "6", "--batch-size", "2", "--seq-len", "32", "--log-every", "3",
               "--save-every", "6", "--threads", "1"])
    assert rc == 0
    log = capsys.readouterr().out
    assert "step 6/6" in log and "held-out" in log and "sample:" in log
    meta = json.loads((tmp_path / "tandem_demo.json").read_text())
    assert meta["steps_done"] == 6 and meta["python"]
    target, _, tok = load_model(tmp_path)
    assert target.config.num_layers == 6 and tok.encode("a", add_special_tokens=False) == [97]
    assert main(["--out", str(tmp_path), "--steps", "0"]) == 2
