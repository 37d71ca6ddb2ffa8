"""``tandem train-demo``: the dense training forward computes what the served paged forward
computes (so the trained weights serve as trained), the stdlib corpus split is deterministic and
disjoint, and a few steps leave a loadable bf16 folder whose loss went down."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from services.gpuworker.attention.base import BatchLayout
from services.gpuworker.model.dense import dense_forward
from services.gpuworker.model.loader import load_model
from services.gpuworker.model.config import LlamaConfig
from services.gpuworker.model.layers import init_weights
from services.gpuworker.model.llama import TargetModel
from services.gpuworker.train_demo import lr_at, main, split_corpus, widen_heads


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


def test_widening_the_heads_keeps_what_the_model_computes():
    """A head_dim-16 model widened to 32 (rotate-half RoPE slots, q scaled for the new attention
    scale) gives the same logits; noise on the new dims moves them only a little."""
    small = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_seq_len=128)
    wide = dataclasses.replace(small, head_dim=32)
    old, new = TargetModel(small), TargetModel(wide)
    init_weights(old, torch.Generator().manual_seed(1), 0.2)  # large weights: a wrong slot shows
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = old.lm_head(dense_forward(old, ids)[0])
        widen_heads(old, new, noise_std=0.0)
        torch.testing.assert_close(new.lm_head(dense_forward(new, ids)[0]), ref, atol=1e-4, rtol=1e-4)
        widen_heads(old, new, noise_std=1e-3)
        assert 0 < (new.lm_head(dense_forward(new, ids)[0]) - ref).abs().max() < 0.05
        assert new.layers[0].self_attn.q_proj.weight.abs().min() > 0  # no dead (all-zero) new dims
    swapped = TargetModel(dataclasses.replace(small, head_dim=32, num_heads=2, num_kv_heads=1))
    with pytest.raises(ValueError, match="doubles head_dim"):
        widen_heads(old, swapped)


def test_the_schedule_warms_up_and_anneals_to_zero():
    lrs = [lr_at(s, 100, 1e-3, warmup=10) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # decays monotonically after warm-up
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)


def test_widening_the_eagle3_draft_keeps_its_logits():
    """The tiny model's EAGLE-3 draft widened with its target (heads 16 -> 32) gives the same
    draft logits on the same aux hiddens (the paged forward the engine runs)."""
    from services.common.spec import SpecMode
    from services.gpuworker.attention.base import get_backend
    from services.gpuworker.model.loader import load_model
    from services.gpuworker.train_demo import widen_draft

    target, draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3, seed=3)
    for p in draft.parameters():  # the random draft's weights are small: make a wrong slot show
        torch.nn.init.normal_(p, std=0.2) if p.dim() == 2 else None
    wide = TargetModel(dataclasses.replace(target.config, head_dim=2 * target.config.head_dim))
    widen_heads(target, wide, noise_std=0.0)
    wide_draft = widen_draft(draft, wide, noise_std=0.0)
    assert wide_draft.layer_config.head_dim == 2 * draft.layer_config.head_dim
    T = 20
    ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(4))
    aux = torch.randn(T, 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(5))
    outs = []
    for t, d in ((target, draft), (wide, wide_draft)):
        backend = get_backend("torch", "cpu", t.attention_geometry(8))
        plan = backend.plan(BatchLayout([[0, 1, 2]], [0], [T]))
        with torch.no_grad():
            outs.append(d(ids, aux, plan, backend, d.new_kv_pool(4, 8), context_is_aux=True).logits)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
