"""Public EAGLE-3 drafts: a checkpoint written here from the layout's definition (the names and
shapes SGLang's / vLLM's ``llama_eagle3.py`` load — not Tandem's save function) loads through
``--draft-model`` and proposes exactly what a reference forward written here from the same
definition proposes: reduced draft vocabulary (d2t/t2d), the draft's own RoPE and eps, both
residual conventions, both conventions of naming the fused target layers. The target's hidden
states of the reference come from transformers, so the aux-layer convention is checked against
an independent implementation. Tandem's own saved drafts load in the same reference, and the
engine's greedy speculative output with such a draft equals plain greedy decoding."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from safetensors.torch import save_file

from services.common.errors import InvalidArgument
from services.common.spec import SpecMode
from services.gpuworker.attention.base import AttentionKind, BatchLayout
from services.gpuworker.engine.local import build_local, generate
from services.gpuworker.model.loader import load_draft, load_model, save_draft, save_model

BS = 4
H, HEADS, KV, HD, INTER, VD = 64, 4, 2, 16, 96, 100  # tiny target geometry; the draft's own MLP/vocab


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """Rotate-half RoPE of ``x`` [T, heads, d] at integer positions ``pos`` [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float()[:, None], torch.cat([ang.sin()] * 2, -1).float()[:, None]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _public_checkpoint(folder, *, seed, theta, eps, norm_before_residual, aux_key, aux_ids, own_embed=False, as_bin=False):
    """Write a public-layout EAGLE-3 draft (config.json + model.safetensors) straight from the
    layout definition. Returns (weights dict, d2t as target ids, config dict)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=0.15: s * torch.randn(*shape, generator=g)  # noqa: E731
    w = {
        "fc.weight": r(H, 3 * H, s=0.08),
        "midlayer.input_layernorm.weight": 1 + r(H, s=0.2),
        "midlayer.hidden_norm.weight": 1 + r(H, s=0.2),
        "midlayer.self_attn.q_proj.weight": r(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, HEADS * HD),
        "midlayer.post_attention_layernorm.weight": 1 + r(H, s=0.2),
        "midlayer.mlp.gate_proj.weight": r(INTER, H),
        "midlayer.mlp.up_proj.weight": r(INTER, H),
        "midlayer.mlp.down_proj.weight": r(H, INTER),
        "norm.weight": 1 + r(H, s=0.2),
        "lm_head.weight": r(VD, H, s=0.5),
    }
    if own_embed:  # some heads ship their own token embedding; then it is used, not the target's
        w["embed_tokens.weight"] = r(512, H, s=1.0)
    target_ids = torch.sort(torch.randperm(512, generator=g)[:VD]).values
    w["d2t"] = target_ids - torch.arange(VD)  # offsets: target id = draft id + d2t[draft id]
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[target_ids] = True
    w["t2d"] = t2d
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "head_dim": HD, "num_hidden_layers": 1, "rms_norm_eps": eps, "rope_theta": theta, "rope_scaling": None,
        "max_position_embeddings": 64, "vocab_size": 512, "draft_vocab_size": VD, "tie_word_embeddings": False,
        "norm_before_residual": norm_before_residual, "torch_dtype": "float32",
    }
    if aux_key == "eagle_config":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    else:
        config["eagle_aux_hidden_state_layer_ids"] = aux_ids
    folder.mkdir(parents=True, exist_ok=True)
    if as_bin:  # EAGLE's own releases are torch pickles
        torch.save({k: v.contiguous() for k, v in w.items()}, str(folder / "pytorch_model.bin"))
    else:
        save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return w, target_ids, config


def _reference_proposals(w, target_ids, config, embed, aux, tokens, k):
    """Reference EAGLE-3 drafting, dense, from the layout definition.

    Fill rows i = 0..n-2 read token t[i+1] and context fc(aux[i]); the last row proposes d1.
    Chain step j reads d_j at position n-2+j with context = the previous row's pre-norm output."""
    eps, theta, nbr = config["rms_norm_eps"], config["rope_theta"], config["norm_before_residual"]
    keys, values = [], []

    def row(pos, tok, ctx):
        e = embed[tok]
        normed = _rms(ctx, w["midlayer.hidden_norm.weight"], eps)
        residual = normed if nbr else ctx
        x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"], eps), normed])
        q = (w["midlayer.self_attn.q_proj.weight"] @ x).view(1, HEADS, HD)
        kk = (w["midlayer.self_attn.k_proj.weight"] @ x).view(1, KV, HD)
        v = (w["midlayer.self_attn.v_proj.weight"] @ x).view(KV, HD)
        p = torch.tensor([pos])
        q, kk = _rope(q, p, theta)[0], _rope(kk, p, theta)[0]
        keys.append(kk)
        values.append(v)
        K, V = torch.stack(keys), torch.stack(values)  # [S, KV, HD]
        att = []
        for hq in range(HEADS):
            hk = hq // (HEADS // KV)
            s = (K[:, hk] @ q[hq]) / math.sqrt(HD)
            att.append(torch.softmax(s, 0) @ V[:, hk])
        h = residual + w["midlayer.self_attn.o_proj.weight"] @ torch.cat(att)
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
        h = h + w["midlayer.mlp.down_proj.weight"] @ (
            torch.nn.functional.silu(w["midlayer.mlp.gate_proj.weight"] @ m) * (w["midlayer.mlp.up_proj.weight"] @ m))
        draft_logits = w["lm_head.weight"] @ _rms(h, w["norm.weight"], eps)
        return h, int(target_ids[int(draft_logits.argmax())])

    n = len(tokens)
    for i in range(n - 1):
        g, d = row(i, tokens[i + 1], w["fc.weight"] @ aux[i])
    out = [d]
    for j in range(1, k):
        g, d = row(n - 2 + j, out[-1], g)
        out.append(d)
    return out


def _tandem_proposals(target, draft, backend, tokens, k):
    """The same through Tandem's paged forwards: a target prefill of t[0..n-1) for the aux
    hiddens, one fill over positions 0..n-2, then k-1 single-position DECODE chain steps."""
    n = len(tokens)
    kv, dkv = target.new_kv_pool(16, BS), draft.new_kv_pool(16, BS)
    table = [7, 3, 11, 0, 5, 9]
    plan = backend.plan(BatchLayout([table], [0], [n - 1]))
    aux = target(torch.tensor(tokens[:-1]), plan, backend, kv, aux_layers=draft.aux_layers).aux_hidden
    out = draft(torch.tensor(tokens[1:]), aux, plan, backend, dkv, context_is_aux=True)
    proposals = [int(out.logits[-1].argmax())]
    g = out.hidden[-1:]
    for j in range(1, k):
        p = backend.plan(BatchLayout([table], [n - 2 + j], [1]), AttentionKind.DECODE)
        o = draft(torch.tensor(proposals[-1:]), g, p, backend, dkv, context_is_aux=False)
        proposals.append(int(o.logits[-1].argmax()))
        g = o.hidden
    return proposals, out.logits


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """The tiny target saved as a folder, and transformers' LlamaForCausalLM reading it."""
    folder = tmp_path_factory.mktemp("target")
    target, _, tok = load_model("tiny")
    save_model(target, folder, tokenizer=tok)
    return folder, transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def _hf_aux(hf, tokens, out_layers):
    """Outputs of target layers ``out_layers`` by transformers (hidden_states[i + 1]; the last
    layer's is not among them: transformers gives it after the final norm)."""
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in out_layers], dim=-1)


@pytest.mark.parametrize("variant", [
    dict(theta=500000.0, eps=1e-6, norm_before_residual=False, aux_key="eagle_config", aux_ids=[0, 1, 2]),
    dict(theta=10000.0, eps=1e-5, norm_before_residual=True, aux_key="eagle_config", aux_ids=[2, 0, 1]),
    # vLLM's top-level key counts layer INPUTS: ids 1, 2, 3 are the outputs of layers 0, 1, 2
    dict(theta=20000.0, eps=1e-5, norm_before_residual=False, aux_key="top", aux_ids=[1, 2, 3]),
    dict(theta=10000.0, eps=1e-5, norm_before_residual=False, aux_key="eagle_config", aux_ids=[0, 1, 2],
         own_embed=True, as_bin=True),
])
def test_public_eagle3_checkpoint_proposes_what_the_reference_proposes(tmp_path, hf_target, make_backend, variant):
    folder, hf = hf_target
    w, target_ids, config = _public_checkpoint(tmp_path / "draft", seed=5, **variant)
    target, draft, _ = load_model(folder, spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "draft")
    out_layers = variant["aux_ids"] if variant["aux_key"] == "eagle_config" else [i - 1 for i in variant["aux_ids"]]
    assert draft.aux_layers == tuple(out_layers) and draft.draft_vocab_size == VD
    backend = make_backend(target, BS)
    embed = w.get("embed_tokens.weight", target.embed_tokens.weight.detach())
    assert (draft.embed_tokens is target.embed_tokens) == ("embed_tokens.weight" not in w)
    for seed in range(3):
        tokens = [256] + torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(seed)).tolist()
        aux = _hf_aux(hf, tokens[:-1], out_layers)
        want = _reference_proposals(w, target_ids, config, embed, aux, tokens, k=4)
        got, logits = _tandem_proposals(target, draft, backend, tokens, k=4)
        assert got == want
        assert all(t in set(target_ids.tolist()) for t in got)
        # the engine sees target-vocabulary logits: -inf exactly outside the draft vocabulary
        outside = torch.ones(512, dtype=torch.bool)
        outside[target_ids] = False
        assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, target_ids]).all()


def test_tandem_saves_the_public_layout(tmp_path, hf_target, make_backend):
    """A draft Tandem saves has the public names and config keys, and the reference reads it."""
    folder, hf = hf_target
    _public_checkpoint(tmp_path / "pub", seed=9, theta=10000.0, eps=1e-5, norm_before_residual=False,
                       aux_key="eagle_config", aux_ids=[0, 2, 1])
    target, draft, _ = load_model(folder, spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "pub")
    save_draft(draft, tmp_path / "mine", own_folder=True)
    from safetensors.torch import load_file

    w = load_file(str(tmp_path / "mine" / "model.safetensors"))
    config = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == VD
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 1]
    assert set(w) == set(load_file(str(tmp_path / "pub" / "model.safetensors")))
    target_ids = torch.arange(VD) + w["d2t"]
    backend = make_backend(target, BS)
    tokens = [256] + list(b"def f(x): return")
    aux = _hf_aux(hf, tokens[:-1], [0, 2, 1])
    want = _reference_proposals(w, target_ids, config, target.embed_tokens.weight.detach(), aux, tokens, k=3)
    assert _tandem_proposals(target, draft, backend, tokens, 3)[0] == want
    again = load_draft(target, tmp_path / "mine", spec_mode=SpecMode.EAGLE3)
    assert _tandem_proposals(target, again, backend, tokens, 3)[0] == want


def test_reduced_vocab_draft_keeps_greedy_output_identical(tmp_path, hf_target):
    """Verification with a reduced-vocabulary draft: speculative greedy == plain greedy."""
    folder, _ = hf_target
    _public_checkpoint(tmp_path / "d", seed=3, theta=10000.0, eps=1e-5, norm_before_residual=False,
                       aux_key="eagle_config", aux_ids=[0, 1, 3])
    target, draft, _ = load_model(folder, spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "d")
    prompts = [[256, *b"import os\n"], [256, *b"class A:"]]
    plain = generate(build_local(models=(target, None), num_blocks=64), prompts, max_new_tokens=20)
    spec = generate(build_local(models=(target, draft), num_blocks=64), prompts, max_new_tokens=20, k=3)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    assert sum(c.proposed_drafts for c in spec) > 0


def test_public_drafts_that_do_not_fit_are_refused(tmp_path, hf_target):
    folder, _ = hf_target
    base = dict(seed=1, theta=10000.0, eps=1e-5, norm_before_residual=False, aux_key="eagle_config")
    _public_checkpoint(tmp_path / "far", aux_ids=[0, 1, 9], **base)
    with pytest.raises(InvalidArgument, match="fuses target layers"):
        load_model(folder, spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "far")
    _public_checkpoint(tmp_path / "d", aux_ids=[0, 1, 2], **base)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    with pytest.raises(InvalidArgument, match="vocabulary of 1000"):
        load_model(folder, spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    with pytest.raises(InvalidArgument, match="must match the target"):
        load_model(folder, spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "d")
    with pytest.raises(InvalidArgument, match="holds an EAGLE-3 draft"):
        load_model(folder, spec_mode=SpecMode.MTP, draft_model=tmp_path / "far")
    with pytest.raises(InvalidArgument, match="has no EAGLE3 draft"):
        load_model(folder, spec_mode=SpecMode.EAGLE3)  # never a silent random draft


def test_a_draft_config_may_record_its_best_k(tmp_path, hf_target):
    """``num_draft_tokens`` in a draft's config (EAGLE-3 ``config.json``, MTP ``tandem_draft.json``)
    is read from configuration alone, survives a re-save, and a bad one is refused; the shipped
    demo draft records 3."""
    from services.gpuworker.model.config import DraftConfig
    from services.gpuworker.model.loader import plan_model

    assert plan_model("demo", spec_mode=SpecMode.EAGLE3).draft_config.num_draft_tokens == 3
    folder, _ = hf_target
    _public_checkpoint(tmp_path / "d", seed=2, theta=10000.0, eps=1e-5, norm_before_residual=False,
                       aux_key="eagle_config", aux_ids=[0, 1, 2])
    assert plan_model(folder, spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "d").draft_config.num_draft_tokens is None
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "num_draft_tokens": 2}))
    target, draft, _ = load_model(folder, spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "d")
    assert draft.config.num_draft_tokens == 2
    save_draft(draft, tmp_path / "again", own_folder=True)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["num_draft_tokens"] == 2
    for bad in (-1, 2.5, "3", True):
        (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "num_draft_tokens": bad}))
        with pytest.raises(InvalidArgument, match="num_draft_tokens must be an integer >= 0"):
            plan_model(folder, spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "d")
    mtp = DraftConfig(SpecMode.MTP, 2, 64, num_draft_tokens=4)
    assert DraftConfig.from_json(mtp.to_json()) == mtp
    assert "num_draft_tokens" not in DraftConfig(SpecMode.MTP, 2, 64).to_json()  # unrecorded: left out
