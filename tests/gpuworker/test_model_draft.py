"""Draft layers: EAGLE-3 and MTP run over paged plans, write only the draft pool (at exactly the
planned positions), follow the documented token/position alignment, give the same final draft KV
whether computed in one go or step by step, and save/load next to the model."""

from __future__ import annotations

import logging

import pytest
import torch

from services.common.errors import InvalidArgument, NotFound
from services.common.spec import SpecMode, lookahead_span
from services.gpuworker.attention.base import AttentionKind, BatchLayout
from services.gpuworker.model.config import DraftConfig, tiny_config
from services.gpuworker.model.draft import Eagle3Draft, MTPDraft
from services.gpuworker.model.loader import load_model, save_draft, save_model
from services.common.tokenizer import ByteTokenizer

BS, NB = 4, 48


@pytest.fixture(scope="module")
def eagle():
    target, draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3)
    return target, draft


@pytest.fixture(scope="module")
def mtp3():
    target, draft, _ = load_model("tiny", spec_mode=SpecMode.MTP, mtp_depth=3)
    return target, draft


def _tokens(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _slots(table, positions):
    return {(table[p // BS], p % BS) for p in positions}


def _written(after, before):
    """{(layer, block, offset)} whose K or V changed."""
    diff = (after != before).any(dim=(-1, -2))  # [layers, blocks, 2, bs]
    return {(l, b, o) for l, b, _, o in diff.nonzero().tolist()}


def test_draft_attributes_follow_the_spec_module(eagle, mtp3):
    _, e = eagle
    _, m = mtp3
    assert isinstance(e, Eagle3Draft) and e.span == lookahead_span(SpecMode.EAGLE3) == 1
    assert e.num_kv_layers == 1 and len(e.aux_layers) == 3
    assert isinstance(m, MTPDraft) and m.span == lookahead_span(SpecMode.MTP, 3) == 3
    assert m.num_kv_layers == 3 and m.aux_layers == ()
    with pytest.raises(InvalidArgument):
        DraftConfig(SpecMode.EAGLE3, 1, 64, (0, 1))
    with pytest.raises(InvalidArgument):
        DraftConfig.default_for(tiny_config(), SpecMode.MTP, 0)


def test_eagle3_fill_and_drafting_write_only_their_draft_positions(eagle, make_backend):
    target, draft = eagle
    backend = make_backend(target, BS)
    kv, dkv = target.new_kv_pool(NB, BS), draft.new_kv_pool(NB, BS)
    t = _tokens(23, seed=1)  # prompt t[0..21], t[22] plays the sampled token
    n = 22
    table = [5, 17, 2, 40, 9, 33, 21]
    plan = backend.plan(BatchLayout([table], [0], [n]))
    out = target(torch.tensor(t[:n]), plan, backend, kv, aux_layers=draft.aux_layers)
    assert out.aux_hidden.shape == (n, 3 * target.config.hidden_size)

    target_before, draft_before = kv.data.clone(), dkv.data.clone()
    with torch.inference_mode():
        fill = draft(torch.tensor(t[1 : n + 1]), out.aux_hidden, plan, backend, dkv, context_is_aux=True)
    assert torch.equal(kv.data, target_before)  # the target pool is never touched by a draft
    assert _written(dkv.data, draft_before) == {(0, b, o) for b, o in _slots(table, range(n))}
    assert fill.hidden.shape == (n, 64) and fill.logits.shape == (n, 512)

    # drafting step at position n: token d1, the draft's own hidden g[n-1] as context
    d1 = int(fill.logits[-1].argmax())
    step = backend.plan(BatchLayout([table], [n], [1]))
    assert step.kind is AttentionKind.DECODE
    before = dkv.data.clone()
    with torch.inference_mode():
        out2 = draft(torch.tensor([d1]), fill.hidden[-1:], step, backend, dkv, context_is_aux=False)
    assert _written(dkv.data, before) == {(0, b, o) for b, o in _slots(table, [n])}
    assert out2.logits.shape == (1, 512)
    with pytest.raises(InvalidArgument):  # flag and width disagree
        draft(torch.tensor([d1]), fill.hidden[-1:], step, backend, dkv, context_is_aux=True)
    with pytest.raises(InvalidArgument):  # an MTP-sized pool
        wrong_pool = target.new_kv_pool(NB, BS)
        draft(torch.tensor([d1]), fill.hidden[-1:], step, backend, wrong_pool, context_is_aux=False)


def test_eagle3_chunked_fill_equals_one_fill(eagle, make_backend):
    """Chunk boundaries feed the REAL next prompt token (DESIGN §1): then chunked and unchunked
    fills write the same draft KV and the same last-row logits."""
    target, draft = eagle
    t = _tokens(31, seed=2)
    n = 30
    table = [11, 3, 29, 7, 0, 19, 44, 38]

    def run(chunks):
        backend = make_backend(target, BS)
        kv, dkv = target.new_kv_pool(NB, BS), draft.new_kv_pool(NB, BS)
        for a, b in chunks:
            plan = backend.plan(BatchLayout([table], [a], [b - a]))
            out = target(torch.tensor(t[a:b]), plan, backend, kv, aux_layers=draft.aux_layers)
            with torch.inference_mode():
                nxt = torch.tensor(t[a + 1 : b + 1])  # t[b] at a boundary: the real prompt token
                d = draft(nxt, out.aux_hidden, plan, backend, dkv, context_is_aux=True)
        return dkv, d.logits[-1]

    one_kv, one_logits = run([(0, n)])
    many_kv, many_logits = run([(0, 9), (9, 10), (10, 25), (25, n)])
    torch.testing.assert_close(many_kv.data, one_kv.data, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(many_logits, one_logits, atol=1e-5, rtol=1e-5)
    # and the alignment matters: a different token at i+1 changes the draft KV at i
    backend = make_backend(target, BS)
    kv, dkv = target.new_kv_pool(NB, BS), draft.new_kv_pool(NB, BS)
    plan = backend.plan(BatchLayout([table], [0], [n]))
    out = target(torch.tensor(t[:n]), plan, backend, kv, aux_layers=draft.aux_layers)
    shifted = t[1 : n + 1]
    shifted[12] = (shifted[12] + 1) % 256  # the token fed at position 12
    with torch.inference_mode():
        draft(torch.tensor(shifted), out.aux_hidden, plan, backend, dkv, context_is_aux=True)
    def at(pool, p):
        return pool.data[0, table[p // BS], :, p % BS]

    pos_diff = [p for p in range(n) if not torch.equal(at(dkv, p), at(one_kv, p))]
    assert pos_diff == [12]


def _lookahead(t, first, last, K, known_upto):
    """[rows, K] with t[i+k] for rows i = first..last when i+k <= known_upto, else -1."""
    rows = []
    for i in range(first, last + 1):
        rows.append([t[i + k] if i + k <= known_upto else -1 for k in range(1, K + 1)])
    return torch.tensor(rows, dtype=torch.int64)


def test_mtp_chain_equals_hand_assembled_module_calls(mtp3, make_backend):
    target, draft = mtp3
    K = 3
    t = _tokens(19, seed=4)
    n = 18  # prompt t[0..17]; t[18] is the token sampled from the target at 17
    tables = [[1, 2, 3, 4, 5], [30, 31, 32]]
    lens = [n, 10]  # a second request with its own window (prompt u[0..9], u[10] sampled)
    u = _tokens(11, seed=5)

    def fresh():
        backend = make_backend(target, BS)
        kv, dkv = target.new_kv_pool(NB, BS), draft.new_kv_pool(NB, BS)
        plan = backend.plan(BatchLayout(tables, [0, 0], lens))
        out = target(torch.tensor(t[:n] + u[:10]), plan, backend, kv)
        return backend, kv, dkv, plan, out

    backend, kv, dkv, plan, out = fresh()
    look = torch.cat([_lookahead(t, 0, n - 1, K, n), _lookahead(u, 0, 9, K, 10)])
    target_before, draft_before = kv.data.clone(), dkv.data.clone()
    greedy = lambda k, logits: logits.argmax(-1)  # noqa: E731
    with torch.inference_mode():
        proposals, logits = draft.run_chain(look, out.hidden, plan, backend, dkv, greedy)
    assert proposals.shape == (2, K) and len(logits) == K and logits[0].shape == (2, 512)
    assert torch.equal(kv.data, target_before)
    expected = {(k, b, o) for k in range(K) for r in range(2) for b, o in _slots(tables[r], range(lens[r]))}
    assert _written(dkv.data, draft_before) == expected

    # by hand: module k at row i reads t[i+k], or proposal d_{i+k-n} of its request past the end
    backend, kv, dkv2, plan, out = fresh()
    prev, mine = out.hidden, [[], []]
    streams = [t[: n + 1], u[:11]]
    with torch.inference_mode():
        for k in range(1, K + 1):
            ids = []
            for r, (s, length) in enumerate(zip(streams, lens)):
                ext = s + mine[r]
                ids += [ext[i + k] for i in range(length)]
            o = draft(k, torch.tensor(ids), prev, plan, backend, dkv2)
            for r, last in enumerate([n - 1, n + 9]):
                mine[r].append(int(o.logits[last].argmax()))
            prev = o.hidden
    assert proposals.tolist() == mine
    torch.testing.assert_close(dkv2.data, dkv.data)

    bad = look.clone()
    bad[3, 0] = -1  # t[4] is known: nothing of this step can stand in for it
    with pytest.raises(InvalidArgument, match="lookahead"):
        draft.run_chain(bad, out.hidden, plan, backend, dkv, greedy)
    with pytest.raises(InvalidArgument):
        draft(K + 1, torch.tensor([1]), prev[:1], plan, backend, dkv)


def test_mtp_step_by_step_final_kv_equals_one_pass(mtp3, make_backend):
    """The protocol in model/draft.py: a later window restarts K-1 positions early (carrying the
    target hidden of those rows); every draft KV entry whose lookahead tokens are final equals a
    single pass over the whole stream."""
    target, draft = mtp3
    K, N, a = 3, 26, 15
    t = _tokens(N + 1, seed=6)
    table = [8, 16, 24, 32, 40, 1, 9]
    greedy = lambda k, logits: logits.argmax(-1)  # noqa: E731

    backend = make_backend(target, BS)
    kv, ref = target.new_kv_pool(NB, BS), draft.new_kv_pool(NB, BS)
    plan = backend.plan(BatchLayout([table], [0], [N]))
    out = target(torch.tensor(t[:N]), plan, backend, kv)
    with torch.inference_mode():
        draft.run_chain(_lookahead(t, 0, N - 1, K, N), out.hidden, plan, backend, ref, greedy)

    backend = make_backend(target, BS)
    kv, dkv = target.new_kv_pool(NB, BS), draft.new_kv_pool(NB, BS)
    plan = backend.plan(BatchLayout([table], [0], [a]))
    out1 = target(torch.tensor(t[:a]), plan, backend, kv)
    with torch.inference_mode():
        draft.run_chain(_lookahead(t, 0, a - 1, K, a), out1.hidden, plan, backend, dkv, greedy)
    tplan = backend.plan(BatchLayout([table], [a], [N - a]))
    out2 = target(torch.tensor(t[a:N]), tplan, backend, kv)
    start = a - (K - 1)
    hidden = torch.cat([out1.hidden[start:], out2.hidden])  # carried rows first
    wplan = backend.plan(BatchLayout([table], [start], [N - start]))
    with torch.inference_mode():
        draft.run_chain(_lookahead(t, start, N - 1, K, N), hidden, wplan, backend, dkv, greedy)

    for k in range(1, K + 1):
        for i in range(N - k + 1):  # t[i+k] final
            page, off = table[i // BS], i % BS
            mine, want = dkv.data[k - 1, page, :, off], ref.data[k - 1, page, :, off]
            torch.testing.assert_close(mine, want, atol=1e-5, rtol=1e-5)


def test_draft_saved_next_to_the_model_loads_back(tmp_path, caplog):
    target, draft, tok = load_model("tiny", spec_mode=SpecMode.EAGLE3, seed=3)
    with torch.no_grad():  # stand-in for distill-draft training
        draft.fc.weight.mul_(-2.0)
    save_model(target, tmp_path, draft=draft, tokenizer=tok)
    t2, d2, tok2 = load_model(tmp_path, spec_mode=SpecMode.EAGLE3)
    assert isinstance(tok2, ByteTokenizer)
    assert torch.equal(t2.layers[1].self_attn.k_proj.weight, target.layers[1].self_attn.k_proj.weight)
    for name, w in draft.draft_state_dict().items():
        assert torch.equal(d2.draft_state_dict()[name], w), name
    assert not any(k.startswith(("embed", "target_lm_head")) for k in d2.draft_state_dict())
    assert load_model(tmp_path, spec_mode=SpecMode.EAGLE3)[1].fingerprint == d2.fingerprint
    with torch.no_grad():
        d2.fc.weight.add_(1.0)
    save_draft(d2, tmp_path)
    assert load_model(tmp_path, spec_mode=SpecMode.EAGLE3)[1].fingerprint != d2.fingerprint
    # a folder without a draft of the mode asked for is an error, never a silent random draft
    with pytest.raises(InvalidArgument, match="has no MTP draft.*--draft-model random"):
        load_model(tmp_path, spec_mode=SpecMode.MTP, mtp_depth=2)
    _, other, _ = load_model(tmp_path, spec_mode=SpecMode.MTP, mtp_depth=2, draft_model="random")
    assert isinstance(other, MTPDraft)
    assert load_model(tmp_path)[1] is None


def test_draft_autograd_only_in_train_mode(make_backend):
    target, draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3, seed=2)
    backend = make_backend(target, BS)
    kv, dkv = target.new_kv_pool(NB, BS), draft.new_kv_pool(NB, BS)
    t = _tokens(9, seed=9)
    plan = backend.plan(BatchLayout([[4, 6, 8]], [0], [8]))
    aux = target(torch.tensor(t[:8]), plan, backend, kv, aux_layers=draft.aux_layers).aux_hidden
    out = draft(torch.tensor(t[1:9]), aux, plan, backend, dkv, context_is_aux=True)  # eval mode
    assert not out.logits.requires_grad and dkv.data.grad_fn is None
    draft.train()
    out = draft(torch.tensor(t[1:9]), aux, plan, backend, dkv, context_is_aux=True)
    out.logits.logsumexp(-1).sum().backward()
    assert draft.fc.weight.grad is not None and draft.fc.weight.grad.abs().sum() > 0
    assert draft.midlayer.self_attn.k_proj.weight.grad.abs().sum() > 0  # through the paged KV


def test_draft_from_its_own_folder(tmp_path):
    """--draft-model: the draft comes from another folder than the model's; an empty one is an error."""
    target, draft, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3, seed=3)
    with torch.no_grad():
        draft.fc.weight.mul_(-2.0)
    save_draft(draft, tmp_path / "draft", own_folder=True)
    _, d2, _ = load_model("tiny", spec_mode=SpecMode.EAGLE3, seed=3, draft_model=tmp_path / "draft")
    for name, w in draft.draft_state_dict().items():
        assert torch.equal(d2.draft_state_dict()[name], w), name
    assert d2.fingerprint != load_model("tiny", spec_mode=SpecMode.EAGLE3, seed=3)[1].fingerprint
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFound, match="no draft in"):
        load_model("tiny", spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "empty")
    with pytest.raises(NotFound, match="neither a folder nor a hub id"):
        load_model("tiny", spec_mode=SpecMode.EAGLE3, draft_model=tmp_path / "missing")


def test_mtp_draft_from_its_own_folder(tmp_path):
    """The MTP layout (docs/drafts.md) loads from a folder of its own, paired with the target;
    another depth there is refused, not replaced by random weights."""
    target, draft, _ = load_model("tiny", spec_mode=SpecMode.MTP, mtp_depth=2, seed=4)
    with torch.no_grad():
        draft.mtp[1].eh_proj.weight.mul_(3.0)
    save_draft(draft, tmp_path / "mtp")
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "mtp" / "draft.safetensors")))
    assert "mtp.1.eh_proj.weight" in names and not any(n.startswith(("embed", "lm_head")) for n in names)
    _, d2, _ = load_model("tiny", spec_mode=SpecMode.MTP, mtp_depth=2, seed=4, draft_model=tmp_path / "mtp")
    for name, w in draft.draft_state_dict().items():
        assert torch.equal(d2.draft_state_dict()[name], w), name
    assert d2.num_kv_layers == 2
    with pytest.raises(InvalidArgument, match="MTP draft of 2 modules"):
        load_model("tiny", spec_mode=SpecMode.MTP, mtp_depth=3, draft_model=tmp_path / "mtp")
