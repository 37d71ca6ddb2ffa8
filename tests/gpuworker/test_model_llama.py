"""The target model: logits equal transformers' LlamaForCausalLM on checkpoints written by
transformers (llama3 rope scaling, tied embeddings, sharded index), and paged/chunked/batched
forwards equal one dense prefill."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from services.common.errors import InvalidArgument
from services.common.spec import SpecMode
from services.gpuworker.attention.base import AttentionKind, BatchLayout
from services.gpuworker.model.config import LlamaConfig
from services.gpuworker.model.loader import load_model


BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _write_hf_checkpoint(folder, seed=0, shard=False, **overrides):
    """A random LlamaForCausalLM saved by transformers itself, with weights rescaled so logits
    are O(1) (a wrong op then shows far above the 1e-4 tolerance), and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**BASE, **overrides})
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    kwargs = {"max_shard_size": "20KB"} if shard else {}
    model.save_pretrained(folder, **kwargs)
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return model


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _paged_logits(target, make_backend, shuffled_tables, seqs, block_size=8, num_blocks=64):
    """All sequences prefilled in ONE ragged batch through the paged KV (shuffled block ids)."""
    backend = make_backend(target, block_size)
    kv = target.new_kv_pool(num_blocks, block_size)
    tables = shuffled_tables([len(s) for s in seqs], block_size, num_blocks, seed=len(seqs))
    plan = backend.plan(BatchLayout(tables, [0] * len(seqs), [len(s) for s in seqs]))
    out = target(torch.tensor([t for s in seqs for t in s]), plan, backend, kv)
    return list(torch.split(out.logits, [len(s) for s in seqs]))


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(  # llama3 scaling bites: positions run far past original_max_position_embeddings
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            attention_bias=True,
        ),
        dict(tie_word_embeddings=True, head_dim=16),  # tied head; head_dim != hidden / heads
        dict(shard=True),  # model.safetensors.index.json + several shards
    ],
    ids=["plain", "llama3-rope", "tied", "sharded"],
)
def test_logits_match_transformers(tmp_path, variant, make_backend, shuffled_tables):
    shard = variant.pop("shard", False)
    hf = _write_hf_checkpoint(tmp_path, shard=shard, **variant)
    if shard:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    target, draft, tokenizer = load_model(tmp_path)
    assert draft is None
    assert tokenizer.encode("w5 w7", add_special_tokens=False) == [5, 7]
    if variant.get("tie_word_embeddings"):
        assert target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (70, 9, 33)]
    ours = _paged_logits(target, make_backend, shuffled_tables, seqs)
    for ids, mine in zip(seqs, ours):
        ref = _hf_logits(hf, ids)
        assert ref.abs().max() > 0.5  # the comparison is not between near-zero numbers
        assert (mine - ref).abs().max().item() <= 1e-4


def test_config_reads_transformers_v4_and_v5_spellings():
    rope = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    common = dict(
        model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=64, eos_token_id=[3, 4],
    )
    v4 = LlamaConfig.from_hf({**common, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **rope}})
    v5_rope = {"rope_type": "llama3", "rope_theta": 5e5, **rope}
    v5 = LlamaConfig.from_hf({**common, "rope_parameters": v5_rope})
    assert v4 == v5
    assert v4.rope_type == "llama3" and v4.rope_theta == 5e5 and v4.num_kv_heads == 2
    assert v4.eos_token_ids == (3, 4)
    assert LlamaConfig.from_hf(v4.to_hf()) == v4
    with pytest.raises(InvalidArgument):
        LlamaConfig.from_hf({**common, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(InvalidArgument):
        LlamaConfig.from_hf({**common, "model_type": "gpt2"})


def test_missing_weights_are_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    _write_hf_checkpoint(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidArgument, match="lacks"):
        load_model(tmp_path)


def test_chunked_and_decoded_paged_forward_equals_dense_prefill(tiny_target, make_backend, shuffled_tables):
    """Request A: chunks of 13 and 16 tokens, then one token per step, batched with request B
    (prefill in one go, then verify-style 3-token steps). Logits and KV equal a dense prefill."""
    target, bs, nb = tiny_target, 4, 96
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, 256, (37,), generator=g).tolist()
    b = torch.randint(0, 256, (23,), generator=g).tolist()

    dense = {}
    for name, ids in (("a", a), ("b", b)):
        backend = make_backend(target, bs)
        kv = target.new_kv_pool(nb, bs)
        table = list(range(-(-len(ids) // bs)))
        plan = backend.plan(BatchLayout([table], [0], [len(ids)]))
        dense[name] = (target(torch.tensor(ids), plan, backend, kv).logits, kv, table)

    backend = make_backend(target, bs)
    kv = target.new_kv_pool(nb, bs)
    ta, tb = shuffled_tables([len(a), len(b)], bs, nb, seed=11)
    # (a_start, a_len, b_start, b_len, kind) per step; b joins late and finishes with VERIFY steps
    steps = [(0, 13, None, 0, None), (13, 16, 0, 14, None)]
    steps += [(29 + i, 1, 14 + 3 * i, 3, None) for i in range(3)]
    steps += [(32 + i, 1, None, 0, AttentionKind.DECODE) for i in range(5)]
    got_a, got_b = {}, {}
    for a0, an, b0, bn, kind in steps:
        tables, cached, qlens, ids = [ta], [a0], [an], a[a0 : a0 + an]
        if b0 is not None:
            tables, cached, qlens, ids = [ta, tb], [a0, b0], [an, bn], ids + b[b0 : b0 + bn]
        out = target(torch.tensor(ids), backend.plan(BatchLayout(tables, cached, qlens), kind), backend, kv)
        for j in range(an):
            got_a[a0 + j] = out.logits[j]
        for j in range(bn):
            got_b[b0 + j] = out.logits[an + j]
    assert sorted(got_a) == list(range(len(a))) and sorted(got_b) == list(range(len(b)))
    for got, name, table in ((got_a, "a", ta), (got_b, "b", tb)):
        ref_logits, ref_kv, ref_table = dense[name]
        mine = torch.stack([got[i] for i in sorted(got)])
        torch.testing.assert_close(mine, ref_logits, atol=1e-5, rtol=1e-5)
        n = len(a if name == "a" else b)
        for pos in range(n):
            mine = kv.data[:, table[pos // bs], :, pos % bs]
            ref = ref_kv.data[:, ref_table[pos // bs], :, pos % bs]
            torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


def test_verify_batch_equals_prefill(tiny_target, make_backend, shuffled_tables):
    target, bs = tiny_target, 8
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 11, 30)]
    ref = _paged_logits(target, make_backend, shuffled_tables, seqs, block_size=bs)
    backend = make_backend(target, bs)
    kv = target.new_kv_pool(64, bs)
    tables = shuffled_tables([len(s) for s in seqs], bs, 64, seed=5)
    pre = [len(s) - 4 for s in seqs]
    prefix = torch.tensor([t for s, p in zip(seqs, pre) for t in s[:p]])
    target(prefix, backend.plan(BatchLayout(tables, [0] * 3, pre)), backend, kv)
    plan = backend.plan(BatchLayout(tables, pre, [4, 4, 4]), AttentionKind.VERIFY)
    out = target(torch.tensor([t for s, p in zip(seqs, pre) for t in s[p:]]), plan, backend, kv)
    for i, (r, p) in enumerate(zip(ref, pre)):
        torch.testing.assert_close(out.logits[4 * i : 4 * i + 4], r[p:], atol=1e-5, rtol=1e-5)


def test_logits_indices_aux_and_limits(tiny_target, make_backend):
    target = tiny_target
    backend = make_backend(target, 16)
    kv = target.new_kv_pool(8, 16)
    ids = torch.arange(10)
    plan = backend.plan(BatchLayout([[0]], [0], [10]))
    full = target(ids, plan, backend, kv, aux_layers=(0, 3))
    part = target(ids, plan, backend, kv, logits_indices=torch.tensor([9, 2]))
    torch.testing.assert_close(part.logits, full.logits[[9, 2]])
    assert full.aux_hidden.shape == (10, 2 * target.config.hidden_size)
    # the final hidden is normed: every row has RMS ~ 1 (norm weights are ones in the tiny init)
    rms = full.hidden.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=2e-2, rtol=0)  # eps shaves a bit
    torch.testing.assert_close(target.compute_logits(full.hidden), full.logits)
    with pytest.raises(InvalidArgument):
        target(ids[:9], plan, backend, kv)
    with pytest.raises(InvalidArgument):
        target(ids, plan, backend, kv, aux_layers=(4,))
    with pytest.raises(InvalidArgument):
        target(ids, plan, backend, target.new_kv_pool(8, 16).__class__(2, 8, 16, 2, 16))
    long_backend = make_backend(target, 1024)
    big = long_backend.plan(BatchLayout([[0, 1, 2]], [2047], [2]))  # positions 2047, 2048
    with pytest.raises(InvalidArgument, match="max_seq_len"):
        target(torch.tensor([1, 2]), big, long_backend, target.new_kv_pool(3, 1024))


def test_tiny_model_is_seeded(tiny_target):
    again, _, _ = load_model("tiny", seed=0)
    other, _, _ = load_model("tiny", seed=1)
    w = tiny_target.layers[2].mlp.up_proj.weight
    assert torch.equal(again.layers[2].mlp.up_proj.weight, w)
    assert not torch.equal(other.layers[2].mlp.up_proj.weight, w)
    assert again.fingerprint == tiny_target.fingerprint != other.fingerprint
    with pytest.raises(InvalidArgument):
        load_model("tiny", spec_mode=SpecMode.PARD)
