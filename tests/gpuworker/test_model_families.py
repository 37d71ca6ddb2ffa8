"""Llama-shaped families: Qwen2/2.5 (bias on q/k/v), Qwen3 (RMSNorm per q/k head) and Mistral
load from checkpoints transformers writes and give transformers' logits (<= 1e-4, float32),
three config variants each, through the paged KV with shuffled block ids."""

from __future__ import annotations

import pytest
import torch
import transformers

from services.gpuworker.model.config import LlamaConfig
from services.gpuworker.model.loader import load_model
from tests.gpuworker.test_model_llama import _hf_logits, _paged_logits

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}
VARIANTS = {
    "qwen2": [dict(), dict(tie_word_embeddings=True, rope_theta=1e6), dict(num_key_value_heads=1, num_hidden_layers=4)],
    "qwen3": [dict(head_dim=16), dict(head_dim=8, attention_bias=True), dict(tie_word_embeddings=True, head_dim=16,
                                                                           num_key_value_heads=4)],
    "mistral": [dict(), dict(sliding_window=None, rope_theta=1e6), dict(head_dim=16, num_key_value_heads=1)],
}


def _write(folder, family, seed, **overrides):
    """A random model of ``family`` saved by transformers, weights rescaled so logits are O(1)."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **overrides})).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 + 0.2 * torch.randn(p.shape, generator=g)) if "norm" in name else 0.15 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    (folder / "tandem_tokenizer.json").write_text('{"type": "byte"}')
    return model


@pytest.mark.parametrize("family, variant", [(f, i) for f in FAMILIES for i in range(3)],
                         ids=[f"{f}-{i}" for f in FAMILIES for i in range(3)])
def test_family_logits_match_transformers(tmp_path, family, variant, make_backend, shuffled_tables):
    overrides = VARIANTS[family][variant]
    hf = _write(tmp_path, family, seed=variant, **overrides)
    target, _, _ = load_model(tmp_path)
    c = target.config
    assert c.model_type == family and c.qkv_bias == (family == "qwen2") and c.qk_norm == (family == "qwen3")
    if family == "qwen2":
        assert target.layers[0].self_attn.q_proj.bias is not None and target.layers[0].self_attn.o_proj.bias is None
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (70, 9, 33)]
    for ids, mine in zip(seqs, _paged_logits(target, make_backend, shuffled_tables, seqs)):
        ref = _hf_logits(hf, ids)
        assert ref.abs().max() > 0.5
        assert (mine - ref).abs().max().item() <= 1e-4


def test_sliding_window_caps_the_served_length():
    """Mistral's sliding window: full attention equals it only inside the window, so the model
    is served up to the window, not past it; configs round-trip through to_hf."""
    common = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  max_position_embeddings=8192)
    assert LlamaConfig.from_hf({**common, "model_type": "mistral", "sliding_window": 4096}).max_seq_len == 4096
    assert LlamaConfig.from_hf({**common, "model_type": "mistral", "sliding_window": None}).max_seq_len == 8192
    assert LlamaConfig.from_hf({**common, "model_type": "qwen2", "sliding_window": 4096,
                                "use_sliding_window": False}).max_seq_len == 8192
    for family in FAMILIES:
        c = LlamaConfig.from_hf({**common, "model_type": family})
        assert LlamaConfig.from_hf(c.to_hf()) == c


def test_eagle3_drafts_of_other_families_round_trip_in_the_public_layout(tmp_path):
    """A draft Tandem builds for a Qwen3 target is a plain Llama layer (the public layout), so it
    saves and loads back; speculative greedy output equals plain greedy output."""
    from services.common.spec import SpecMode
    from services.gpuworker.engine.local import build_local, generate
    from services.gpuworker.model.loader import load_draft, save_draft

    _write(tmp_path / "m", "qwen3", seed=3, head_dim=16, num_hidden_layers=4)
    target, draft, _ = load_model(tmp_path / "m", spec_mode=SpecMode.EAGLE3, draft_model="random")
    assert draft.midlayer.self_attn.q_norm is None and draft.midlayer.self_attn.q_proj.bias is None
    save_draft(draft, tmp_path / "d", own_folder=True)
    again = load_draft(target, tmp_path / "d", spec_mode=SpecMode.EAGLE3)
    for k, v in draft.draft_state_dict().items():
        assert torch.equal(again.draft_state_dict()[k], v), k
    prompts = [[1, 5, 9, 2], [7, 7, 3]]
    plain = generate(build_local(models=(target, None), num_blocks=32), prompts, max_new_tokens=12)
    spec = generate(build_local(models=(target, again), num_blocks=32), prompts, max_new_tokens=12, k=3)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
