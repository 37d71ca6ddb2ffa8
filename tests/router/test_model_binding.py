"""The router serves one model: workers serving another are refused (never gibberish), and with
``--model auto`` the model and tokenizer come from the workers themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router_rig import TIMEOUT, collect, wait_serving
from services.router.model_binding import incompatibility


def test_incompatibility_names_the_difference():
    assert incompatibility("tiny", 512, "tiny", 512) is None
    assert incompatibility("tiny", 512, "", 512) is None  # a worker that names no model: vocabulary decides
    assert incompatibility("tiny", 512, "/models/llama", 512) == "it serves model '/models/llama', this router serves 'tiny'"
    assert incompatibility("tiny", 512, "tiny", 128256) == "its vocabulary has 128256 tokens, this router's tokenizer 512"


def test_a_worker_with_another_vocabulary_is_refused_and_a_matching_one_serves(rig, caplog):
    rig.worker("other", vocab_size=128256)
    router = rig.router(wait=False)
    time.sleep(0.5)
    health = health_pb2_grpc.HealthStub(router.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == health_pb2.HealthCheckResponse.NOT_SERVING
    _, err = collect(router, text="hello", max_new_tokens=2)
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    assert any("not routing to worker other" in r.getMessage() and "128256 tokens" in r.getMessage() for r in caplog.records)
    rig.worker("good")
    wait_serving(router.channel)
    for _ in range(4):  # every request lands on the compatible worker
        messages, err = collect(router, text="hello", max_new_tokens=2)
        assert err is None and messages[-1].usage.worker_id == "good"


HUB_SCRIPT = r"""
import asyncio, json
from services.common.errors import TandemError
from services.common.tokenizer import load_tokenizer
from services.router.directory import WorkerEntry
from services.router.model_binding import AUTO, ModelBinding

def entry(vocab):
    return WorkerEntry("w0", 1, "127.0.0.1:1", "m", 1, 0, 16, 64, 0, vocab, 1024)

async def worker_model(_entry):
    return "acme/coder"

out = {"main": load_tokenizer("acme/coder").vocab_size, "v1": load_tokenizer("acme/coder", "v1").vocab_size}
try:
    load_tokenizer("tiny", "v1")
except TandemError as exc:
    out["tiny@v1"] = type(exc).__name__
for rev in ("v1", None):  # --model auto: the tokenizer is fetched at the router's --revision
    binding = ModelBinding(AUTO, None, worker_model, revision=rev)
    ok = asyncio.run(binding.review([entry(512)]))
    out[f"auto@{rev}"] = [binding.model, binding.tokenizer.vocab_size, len(ok)]
print(json.dumps(out))
"""


def test_a_hub_tokenizer_is_fetched_at_the_routers_revision(tmp_path):
    """A hub model whose tokenizer changed between revisions (main: a 7-token word tokenizer;
    v1: the byte tokenizer, 512 ids): the router learns the model from a worker and fetches the
    tokenizer at its --revision, not at main (offline, from a hub cache the test builds)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cache = tmp_path / "cache"
    base = cache / "models--acme--coder"
    for commit, ref in (("a" * 40, "main"), ("b" * 40, "v1")):
        snap = base / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
        if ref == "main":
            vocab = {"<s>": 0, "</s>": 1, "def": 2, "return": 3, "(": 4, ")": 5, "[UNK]": 6}
            tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
            tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            tok.save(str(snap / "tokenizer.json"))
        else:
            (snap / "tandem_tokenizer.json").write_text(json.dumps({"type": "byte"}))
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / ref).write_text(commit)
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TANDEM_"))}
    env.update(PYTHONPATH=str(root), HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["main"] == 7 and out["v1"] == 512
    assert out["tiny@v1"] == "InvalidArgument"
    assert out["auto@v1"] == ["acme/coder", 512, 1]  # v1's byte tokenizer: the 512-id worker is served
    assert out["auto@None"] == ["acme/coder", 7, 0]  # at main the vocabularies differ: refused, not gibberish
