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


def test_prompts_from_text_and_sharegpt_jsonl(tmp_path):
    from services.gpuworker.distill import read_prompts

    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "first"},
                           {"from": "gpt", "value": "answer"}]},
        {"messages": [{"role": "user", "content": "second"}]},
        {"prompt": "third"}, {"text": "fourth"}, {"other": 1},
    ]) + "\n\n")
    assert read_prompts(tmp_path / "p.jsonl") == ["first", "second", "third", "fourth"]
    (tmp_path / "p.txt").write_text("def a():\n    pass\n\n\nclass B:\n    x = 1\n")
    assert read_prompts(tmp_path / "p.txt") == ["def a():\n    pass", "class B:\n    x = 1"]


def test_distill_on_a_prompt_file_with_a_reduced_draft_vocabulary(tmp_path):
    """Prompts from a JSONL file (the last ones held out), labels from the target's own greedy
    continuations, a draft vocabulary of the 64 ids those use most: saved in the public layout
    with d2t, loaded back, measured on the held-out prompts."""
    from services.gpuworker.model.eagle3_format import is_eagle3_config

    words = ["import", "def", "return", "class", "self", "for", "in", "if", "else", "print"]
    lines = [json.dumps({"text": " ".join(words[(i * j) % 10] for j in range(6))}) for i in range(20)]
    (tmp_path / "p.jsonl").write_text("\n".join(lines))
    res = distill_draft("tiny", str(tmp_path / "out"), 20, spec_mode=SpecMode.EAGLE3, prompts_file=str(tmp_path / "p.jsonl"),
                        draft_vocab=64, num_sequences=12, gen_len=12, batch_size=4, eval_prompts=3, k=3, progress=False,
                        prompt_len=16)
    config = json.loads((tmp_path / "out" / "eagle3" / "config.json").read_text())
    assert is_eagle3_config(config) and config["draft_vocab_size"] == 64
    target, draft, _ = load_model(str(tmp_path / "out"), spec_mode=SpecMode.EAGLE3)
    assert draft.draft_vocab_size == 64 and draft.reduced_vocab
    assert 1.0 <= res.acceptance_after <= 4.0 and res.loss_last < res.loss_first
    from services.gpuworker.distill import read_prompts

    held = [[256, *t.encode()][:16] for t in read_prompts(tmp_path / "p.jsonl")[-3:]]
    assert measure_acceptance(target, draft, held, k=3, max_new_tokens=12) == res.acceptance_after
