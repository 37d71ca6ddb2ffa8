"""Overlapped steps (``EngineConfig.overlap``) change when the host learns a token, never which.

With overlap on, a step whose rows are all plain greedy decodes leaves its tokens on the device
and the next step is launched with them as inputs; the host reads them back one step later.
So a report may say ``verified`` with no new tokens, and a stop token is seen one step late
(the extra token is dropped). These tests run the same workloads with overlap off and on and
compare every emitted token, finish reason and published block; they also check that lagging
steps really happened (otherwise the comparison would be vacuous).
"""

from __future__ import annotations

import pytest

from services.gpuworker.engine.local import run_until_done, submit
from services.gpuworker.engine.request import FinishReason
from services.gpuworker.engine.sampling import SamplingParams
from test_engine_published_kv import PublishWatcher
from test_engine_support import MODES, make_setup, plain_greedy, prompts

MAX_NEW = 13
BS = 4
_IDS = ("plain", "stops", "kept", "sampled", "spec", "late")


class LagCounter:
    """Counts reports with a verified step that emitted nothing (the token is still on the device)."""

    def __init__(self, then=None):
        self.lagged = 0
        self.then = then

    def __call__(self, report) -> None:
        self.lagged += sum(1 for r in report.results.values() if r.verified and not r.new_token_ids)
        if self.then is not None:
            self.then(report)


def _run(mode: str, overlap: bool, chunk: int, *, k_spec: int, stop_at: int):
    """Three greedy k = 0 requests (one with a stop token ``stop_at`` tokens in), one sampled and,
    for draft modes, one speculating request; then a late request reusing a kept prefix."""
    ps = prompts((5, 11, 17, 8), seed=21)
    stop = plain_greedy(ps[1], MAX_NEW)[stop_at]
    setup = make_setup(mode, chunk_size=chunk, max_batch_tokens=24, overlap=overlap)
    lags = LagCounter(PublishWatcher(setup, MODES[mode][1] if mode.startswith("mtp") else 1)
                      if mode != "none" else None)
    submit(setup, "plain", ps[0], max_new_tokens=MAX_NEW)
    submit(setup, "stops", ps[1], max_new_tokens=MAX_NEW, stop_ids=(stop,))
    submit(setup, "kept", ps[2], max_new_tokens=MAX_NEW)
    submit(setup, "sampled", ps[3], max_new_tokens=5, sampling=SamplingParams(temperature=0.9, seed=3))
    if mode != "none":
        submit(setup, "spec", ps[3], max_new_tokens=5, k=k_spec)
    # every reservation is kept until the end: a released block could be reused and rewritten
    # before PublishWatcher compares it
    done = run_until_done(setup, keep=list(_IDS), on_step=lags)
    reused = 2 * BS
    late = ps[2][: reused + 2] + prompts((4,), seed=8)[0]
    submit(setup, "late", late, max_new_tokens=MAX_NEW,
           prefix_blocks=done["kept"].block_table[: reused // BS], reused_positions=reused)
    done.update(run_until_done(setup, keep=list(_IDS), on_step=lags))
    return done, lags, setup, {"plain": ps[0], "stops": ps[1], "kept": ps[2], "late": late}


@pytest.mark.parametrize("chunk", [3, 64])
@pytest.mark.parametrize("mode", ["none", "eagle3", "mtp2"])
def test_overlap_gives_the_same_tokens(mode, chunk):
    sync, sync_lags, _, ps = _run(mode, False, chunk, k_spec=2, stop_at=10)
    over, lags, setup, _ = _run(mode, True, chunk, k_spec=2, stop_at=10)
    assert sync_lags.lagged == 0
    assert lags.lagged > 0, "no step overlapped: the comparison would say nothing"
    assert set(over) == set(sync)
    for rid in sync:
        assert over[rid].tokens == sync[rid].tokens, rid
        assert over[rid].finish_reason == sync[rid].finish_reason, rid
        assert over[rid].decode_steps == sync[rid].decode_steps, rid
    for rid in ("plain", "kept", "late"):
        assert over[rid].tokens == plain_greedy(ps[rid], MAX_NEW)
        assert over[rid].finish_reason is FinishReason.LENGTH
    # the stop token ends the request where plain decoding met it, and is the last token sent
    assert over["stops"].finish_reason is FinishReason.STOP
    full = plain_greedy(ps["stops"], MAX_NEW)
    assert over["stops"].tokens == full[: full.index(full[10]) + 1]
    # the published KV is the reference KV (PublishWatcher), and nothing is left reserved
    if mode != "none":
        watch = lags.then
        for rid in ("plain", "kept", "late"):
            n = watch.check(rid, ps[rid] + over[rid].tokens, mode)
            assert n == over[rid].publishable_positions // BS > 0
    assert not setup.engine.has_work()
    for rid in over:
        setup.source.release(rid)
    assert len(setup.source._free) == setup.engine.num_blocks


def test_abort_while_a_token_is_on_the_device():
    """An abort between steps drops a request whose last token was never read back: nothing of
    it is emitted later, its blocks go back, the other requests still match plain decoding."""
    ps = prompts((6, 9), seed=5)
    setup = make_setup("none", chunk_size=64, max_batch_tokens=64, overlap=True)
    submit(setup, "a", ps[0], max_new_tokens=MAX_NEW)
    submit(setup, "b", ps[1], max_new_tokens=MAX_NEW)
    got = {"a": [], "b": []}
    for _ in range(4):  # prefill, then decodes that lag
        for rid, r in setup.engine.step().results.items():
            got[rid] += r.new_token_ids
    pending = setup.engine._states["a"].pending_token
    assert pending is not None, "the test needs a token in flight"
    setup.engine.abort("a")
    setup.source.release("a")
    done = run_until_done(setup)
    assert "a" not in done
    assert got["b"] + done["b"].tokens == plain_greedy(ps[1], MAX_NEW)
    assert got["a"] == plain_greedy(ps[0], MAX_NEW)[: len(got["a"])]
    assert len(setup.source._free) == setup.engine.num_blocks


def test_max_seq_len_ends_a_lagging_request():
    """A request that reaches the engine's max_seq_len on a lagging token is not scheduled again:
    it ends with that token, like in synchronous steps."""
    prompt = prompts((9,), seed=2)[0]
    out = {}
    for overlap in (False, True):
        setup = make_setup("none", chunk_size=64, max_batch_tokens=64, overlap=overlap, max_seq_len=16)
        submit(setup, "r", prompt, max_new_tokens=MAX_NEW)
        out[overlap] = run_until_done(setup)["r"]
    assert out[True].tokens == out[False].tokens == plain_greedy(prompt, 16 - 9)
    assert out[True].finish_reason is out[False].finish_reason is FinishReason.MAX_SEQ_LEN
