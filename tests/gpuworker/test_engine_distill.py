"""``distill-draft``: a short run on the tiny model trains the draft, saves a loadable folder, and
reports acceptance lengths measured by the engine."""

from __future__ import annotations

import json

import torch

from services.common.spec import SpecMode
from services.gpuworker.distill import distill_draft, evaluation_prompts, main, measure_acceptance
from services.gpuworker.model.loader import load_model

SMALL = dict(num_sequences=16, gen_len=16, batch_size=4, eval_prompts=3, k=3, progress=False)


def test_distill_trains_saves_and_measures(tmp_path):
    res = distill_draft("tiny", str(tmp_path), 30, spec_mode=SpecMode.EAGLE3, **SMALL)
    assert res.loss_last < res.loss_first
    assert 1.0 <= res.acceptance_before <= 4.0 and 1.0 <= res.acceptance_after <= 4.0
    meta = json.loads((tmp_path / "eagle3" / "config.json").read_text())  # the public layout
    assert meta["architectures"] == ["LlamaForCausalLMEagle3"]
    target, draft, _ = load_model(str(tmp_path), spec_mode=SpecMode.EAGLE3)
    tiny_target, random_draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3)
    for a, b in zip(target.state_dict().values(), tiny_target.state_dict().values()):
        assert torch.equal(a, b)  # the target is saved unchanged
    trained, untrained = draft.draft_state_dict(), random_draft.draft_state_dict()
    assert not torch.equal(trained["fc.weight"], untrained["fc.weight"])
    # the saved draft is the one that was measured: same prompts, same acceptance
    prompts = evaluation_prompts(3, 16, seed=0)
    assert measure_acceptance(target, draft, prompts, k=3, max_new_tokens=16) == res.acceptance_after
    assert measure_acceptance(target, random_draft, prompts, k=3, max_new_tokens=16) == res.acceptance_before


def test_distill_cli_mtp(tmp_path, capsys):
    rc = main(["tiny", "--out", str(tmp_path), "--mode", "mtp", "--mtp-depth", "2", "--steps", "6",
               "--sequences", "8", "--gen-len", "8", "--batch-size", "4", "--k", "2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec_mode"] == "MTP" and out["steps"] == 6
    _, draft, _ = load_model(str(tmp_path), spec_mode=SpecMode.MTP, mtp_depth=2)
    assert draft.num_kv_layers == 2
    assert main(["tiny", "--steps", "0"]) == 2  # bad arguments: a message, not a traceback
