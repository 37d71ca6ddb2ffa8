"""Hub ids and model identity.

Hub: ``org/name`` (+ ``--revision``) resolves through huggingface_hub against a hub cache this
test builds in the real layout (``models--org--name/snapshots/<commit>/``, ``refs/<name>``),
offline (``HF_HUB_OFFLINE=1`` in a fresh interpreter, so the variable is honoured as users set
it). Identity: fingerprints digest the whole content, so two checkpoints that differ only after
their first MiB (frozen-embedding fine-tunes) get different namespaces; the digest is cached by
path, size and mtime; a hub snapshot is named by its commit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.common.spec import SpecMode
from services.gpuworker.model.identity import content_fingerprint, file_digest
from services.gpuworker.model.loader import load_model, save_draft, save_model

ROOT = Path(__file__).resolve().parents[2]
COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


def _snapshot(cache: Path, repo: str, commit: str, folder: Path, refs: tuple[str, ...]) -> None:
    base = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, base / "snapshots" / commit)
    (base / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (base / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A hub cache with acme/tiny-coder at two commits (main, v1: other weights) and a public
    EAGLE-3 draft repo acme/tiny-coder-eagle3."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    for seed, commit, refs in ((0, COMMIT_MAIN, ("main",)), (1, COMMIT_V1, ("v1",))):
        target, draft, tok = load_model("tiny", seed=seed, spec_mode=SpecMode.EAGLE3)
        src = save_model(target, root / f"src{seed}", tokenizer=tok)
        _snapshot(cache, "acme/tiny-coder", commit, src, refs)
        if seed == 0:
            _snapshot(cache, "acme/tiny-coder-eagle3", "c" * 40, save_draft(draft, root / "d", own_folder=True), ("main",))
    return cache


SCRIPT = r"""
import json, sys
from services.common.spec import SpecMode
from services.common.errors import TandemError
from services.gpuworker.model.loader import load_model
out = {}
for name, rev, draft in json.loads(sys.argv[1]):
    try:
        t, d, _ = load_model(name, revision=rev, spec_mode=SpecMode.EAGLE3 if draft else SpecMode.NONE, draft_model=draft)
        out[f"{name}@{rev}"] = [t.fingerprint, float(t.embed_tokens.weight.sum()), d.fingerprint if d else None]
    except TandemError as exc:
        out[f"{name}@{rev}"] = ["error", type(exc).__name__, exc.message]
print(json.dumps(out))
"""


def _run_offline(cache: Path, cases) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TANDEM_"))}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache.parent / "home"),
               TANDEM_HOME=str(cache.parent / "tandem-home"))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hub_ids_and_revisions_resolve_offline(hub_cache):
    out = _run_offline(hub_cache, [
        ["acme/tiny-coder", None, None], ["acme/tiny-coder", "v1", None], ["acme/tiny-coder", COMMIT_MAIN, None],
        ["acme/not-cached", None, None],
        ["acme/tiny-coder", "v2", None],
    ])
    main, v1, by_commit = out["acme/tiny-coder@None"], out["acme/tiny-coder@v1"], out[f"acme/tiny-coder@{COMMIT_MAIN}"]
    assert main[0] != "error" and v1[0] != "error"
    assert main[1] != v1[1]  # v1 has other weights ...
    assert main[0] != v1[0]  # ... and another namespace (the commit names it)
    assert by_commit[:2] == main[:2]  # a commit hash is a revision too
    missing = out["acme/not-cached@None"]
    assert missing[:2] == ["error", "NotFound"] and "not in the hub cache" in missing[2] and "HF_HUB_OFFLINE" in missing[2]
    bad_rev = out["acme/tiny-coder@v2"]
    assert bad_rev[:2] == ["error", "NotFound"]


def test_hub_draft_id_loads_offline(hub_cache):
    out = _run_offline(hub_cache, [["acme/tiny-coder", None, "acme/tiny-coder-eagle3"]])
    fp, _, draft_fp = out["acme/tiny-coder@None"]
    assert fp != "error" and draft_fp and draft_fp != fp  # a public EAGLE-3 draft fetched by hub id


def _checkpoint(folder: Path, tail_value: float) -> Path:
    """config + one weights file of > 1 MiB whose tensors are equal but for the last one."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    g = torch.Generator().manual_seed(0)
    state = {"a.embed": torch.randn(512, 1024, generator=g), "z.tail": torch.full((4,), tail_value)}
    save_file(state, str(folder / "model.safetensors"))
    assert (folder / "model.safetensors").stat().st_size > (1 << 21)
    return folder


def test_checkpoints_differing_after_the_first_mib_get_different_fingerprints(tmp_path):
    a, b = _checkpoint(tmp_path / "a", 1.0), _checkpoint(tmp_path / "b", 2.0)
    fa, fb = (a / "model.safetensors").read_bytes(), (b / "model.safetensors").read_bytes()
    first_diff = next(i for i, (x, y) in enumerate(zip(fa, fb)) if x != y)
    assert first_diff > 1 << 20 and len(fa) == len(fb)  # same header, same first MiB, same size
    cache = tmp_path / "fp.json"
    files = lambda f: [f / "config.json", f / "model.safetensors"]  # noqa: E731
    assert content_fingerprint(files(a), cache_path=cache) != content_fingerprint(files(b), cache_path=cache)
    # cached by path, size and mtime: a rewrite with new content (new mtime) is hashed again
    before = file_digest(a / "model.safetensors", cache)
    assert json.loads(cache.read_text())[str((a / "model.safetensors").resolve())]["sha256"] == before
    shutil.copy(b / "model.safetensors", a / "model.safetensors")
    os.utime(a / "model.safetensors", ns=(1, 1))
    assert file_digest(a / "model.safetensors", cache) == file_digest(b / "model.safetensors", cache) != before


def test_model_namespaces_follow_content_and_served_name(tmp_path):
    """Through the loader: two saved models equal but for one value deep in the last layer get
    different fingerprints; --served-model-name is mixed in; reloading is stable."""
    target, _, tok = load_model("tiny")
    a = save_model(target, tmp_path / "a", tokenizer=tok)
    with torch.no_grad():
        target.layers[-1].mlp.down_proj.weight[-1, -1] += 1.0
    b = save_model(target, tmp_path / "b", tokenizer=tok)
    fa, fb = load_model(a)[0].fingerprint, load_model(b)[0].fingerprint
    assert fa != fb and load_model(a)[0].fingerprint == fa
    named = load_model(a, served_model_name="coder-v1")[0].fingerprint
    assert named not in (fa, fb) and load_model(a, served_model_name="coder-v1")[0].fingerprint == named
