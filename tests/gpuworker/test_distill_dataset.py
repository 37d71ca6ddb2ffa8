"""``distill-draft --dataset ORG/NAME``: prompts from a Hugging Face dataset repo, fetched through
huggingface_hub (``repo_type="dataset"``) and read offline from a hub cache this test builds in
the real layout (``datasets--org--name/snapshots/<commit>/``, ``refs/<name>``), with
``HF_HUB_OFFLINE=1`` set in a fresh interpreter as users set it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["import", "def", "return", "class", "self", "for", "in", "if", "else", "print"]


def _snapshot(cache: Path, repo: str, commit: str, files: dict[str, str], ref: str) -> None:
    base = cache / f"datasets--{repo.replace('/', '--')}"
    for rel, text in files.items():
        path = base / "snapshots" / commit / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """acme/code-prompts at main (ShareGPT JSONL under data/, a JSON array, a text file and
    metadata JSON) and at v1 (one other prompt file); acme/meta-only with no prompts at all."""
    cache = tmp_path_factory.mktemp("hub") / "cache"
    rows = [{"conversations": [{"from": "human", "value": " ".join(WORDS[(i * j) % 10] for j in range(6))},
                               {"from": "gpt", "value": "ok"}]} for i in range(14)]
    _snapshot(cache, "acme/code-prompts", "a" * 40, {
        "data/train-00000.jsonl": "\n".join(json.dumps(r) for r in rows) + "\n",
        "data/zz-array.json": json.dumps([{"messages": [{"role": "user", "content": "while True: pass"}]}]),
        "notes.txt": "def f(x):\n    return x\n\nclass A:\n    pass\n",
        "dataset_info.json": json.dumps({"features": {"conversations": "list"}, "splits": ["train"]}),
        "README.md": "not a prompt file",
    }, "main")
    _snapshot(cache, "acme/code-prompts", "b" * 40, {"v1.jsonl": json.dumps({"text": "only in v1"}) + "\n"}, "v1")
    _snapshot(cache, "acme/meta-only", "c" * 40, {"dataset_info.json": "{}"}, "main")
    return cache


SCRIPT = r"""
import json, sys
from services.common.errors import TandemError
from services.common.spec import SpecMode
from services.gpuworker.distill import dataset_prompts, distill_draft, main, measure_acceptance
from services.gpuworker.model.loader import load_model
out = {}
for repo, rev in (("acme/code-prompts", None), ("acme/code-prompts", "v1"), ("acme/not-cached", None),
                  ("acme/code-prompts", "v2"), ("acme/meta-only", None), ("not a dataset id", None)):
    try:
        out[f"{repo}@{rev}"] = dataset_prompts(repo, rev)
    except TandemError as exc:
        out[f"{repo}@{rev}"] = ["error", type(exc).__name__, exc.message]
res = distill_draft("tiny", sys.argv[1], 12, spec_mode=SpecMode.EAGLE3, dataset="acme/code-prompts", num_sequences=12,
                    gen_len=12, batch_size=4, eval_prompts=3, k=3, progress=False, prompt_len=16)
target, draft, tok = load_model(sys.argv[1], spec_mode=SpecMode.EAGLE3)
held = [tok.encode(t)[:16] for t in out["acme/code-prompts@None"][-3:]]
out["measured_again"] = measure_acceptance(target, draft, held, k=3, max_new_tokens=12)
out["result"] = [res.acceptance_before, res.acceptance_after, res.loss_first, res.loss_last]
out["cli_uncached"] = main(["tiny", "--out", sys.argv[1] + "-cli", "--dataset", "acme/not-cached", "--steps", "2"])
out["cli_both"] = main(["tiny", "--out", sys.argv[1] + "-cli", "--dataset", "acme/code-prompts", "--stdlib"])
print(json.dumps(out))
"""


def test_distill_draft_reads_a_hub_dataset_offline(hub_cache, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TANDEM_"))}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache),
               HF_HOME=str(hub_cache.parent / "home"), TANDEM_HOME=str(hub_cache.parent / "tandem-home"))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    prompts = out["acme/code-prompts@None"]
    # every prompt file in path order (data/*.jsonl, data/*.json array, notes.txt); metadata and
    # README give none
    first = " ".join(WORDS[0] for _ in range(6))
    assert prompts[0] == first and len(prompts) == 14 + 1 + 2
    assert prompts[14] == "while True: pass"
    assert prompts[-2:] == ["def f(x):\n    return x", "class A:\n    pass"]
    assert out["acme/code-prompts@v1"] == ["only in v1"]  # --dataset-revision picks the snapshot
    assert out["acme/not-cached@None"][:2] == ["error", "NotFound"] and "HF_HUB_OFFLINE" in out["acme/not-cached@None"][2]
    assert out["acme/code-prompts@v2"][:2] == ["error", "NotFound"]
    assert out["acme/meta-only@None"][:2] == ["error", "InvalidArgument"] and "no prompts" in out["acme/meta-only@None"][2]
    assert out["not a dataset id@None"][:2] == ["error", "InvalidArgument"]

    # trained on the dataset's prompts, measured on its last three (held out): the saved draft
    # measures the same again
    before, after, loss_first, loss_last = out["result"]
    assert loss_last < loss_first and 1.0 <= before <= 4.0 and 1.0 <= after <= 4.0
    assert out["measured_again"] == after
    assert out["cli_uncached"] == 2 and "not in the hub cache" in proc.stderr
    assert out["cli_both"] == 2 and "one of --prompts, --dataset and --stdlib" in proc.stderr
    assert not (tmp_path / "out-cli").exists()  # refused runs write nothing
