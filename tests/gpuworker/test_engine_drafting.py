"""Draft proposals are fed the right tokens, hidden states and positions.

Proposals of a random draft are arbitrary, so identity tests cannot see a misfed draft; here the
engine's proposals after a prefill (fill + chain, k = 4) are recomputed by hand with the model API
— EAGLE-3 (chain from d1) and MTP with K = 2 (module 2 reads d1 at the last position; the last
module is chained for d3, d4) — and must match exactly.
"""

from __future__ import annotations

import pytest
import torch

from services.gpuworker.attention.base import BatchLayout, get_backend
from services.gpuworker.engine.local import submit
from test_engine_support import make_setup, models, prompts

K_DRAFT = 4
BS = 4


@torch.inference_mode()
def _reference(mode: str, prompt: list[int]) -> tuple[int, list[int], torch.Tensor]:
    target, draft = models(mode)
    n = len(prompt)
    be = get_backend("torch", "cpu", target.attention_geometry(BS))
    nb = 8
    tp, dp = target.new_kv_pool(nb, BS), draft.new_kv_pool(nb, BS)
    table = list(range(nb))
    plan = be.plan(BatchLayout([table], [0], [n]))
    out = target(torch.tensor(prompt), plan, be, tp, aux_layers=draft.aux_layers)
    first = int(torch.argmax(out.logits[-1]))
    seq = prompt + [first]
    drafts: list[int] = []
    if mode == "eagle3":
        d = draft(torch.tensor(seq[1:]), out.aux_hidden, plan, be, dp, context_is_aux=True)
        drafts.append(int(torch.argmax(d.logits[-1])))
        hidden = d.hidden[-1:]
        chain_module = None
    else:
        prev = out.hidden
        for k in (1, 2):  # module k at position i reads t[i+k]; past t[n] that is d_(i+k-n)
            toks = [seq[i + k] if i + k <= n else drafts[i + k - n - 1] for i in range(n)]
            d = draft(k, torch.tensor(toks), prev, plan, be, dp)
            drafts.append(int(torch.argmax(d.logits[-1])))
            prev = d.hidden
        hidden = prev[-1:]
        chain_module = 2
    while len(drafts) < K_DRAFT:
        # EAGLE-3: position n-1+j reads d_j; MTP: module K at position n+j-K reads d_j
        pos = n - 1 + len(drafts) if chain_module is None else n + len(drafts) - chain_module
        plan = be.plan(BatchLayout([table], [pos], [1]))
        tok = torch.tensor(drafts[-1:])
        if chain_module is None:
            d = draft(tok, hidden, plan, be, dp, context_is_aux=False)
        else:
            d = draft(chain_module, tok, hidden, plan, be, dp)
        drafts.append(int(torch.argmax(d.logits[-1])))
        hidden = d.hidden
    return first, drafts, hidden[0]


@pytest.mark.parametrize("mode", ["eagle3", "mtp2"])
def test_fill_and_chain_proposals_match_hand_computation(mode):
    prompt = prompts((11,), seed=21)[0]
    first, drafts, hidden = _reference(mode, prompt)
    setup = make_setup(mode, chunk_size=64)
    submit(setup, "a", prompt, max_new_tokens=20, k=K_DRAFT, headroom=8)
    report = setup.engine.step()
    assert report.results["a"].new_token_ids == [first]
    state = setup.engine.state("a")
    setup.engine.drafter.chain({"a": K_DRAFT}, [state])
    assert state.drafts.tolist() == drafts
    torch.testing.assert_close(state.chain_hidden, hidden, atol=1e-5, rtol=1e-5)
