"""Prefill batching (``EngineConfig.prefill_wait_steps`` / ``prefill_batch``, TGI's
``max_waiting_tokens``): a new prompt waits while others decode, at most ``wait`` steps or until
``batch`` prompts wait, so one forward prefills several; output never changes.

    step:        a      a+1    a+2    a+3
    new prompt:  held   held   held   prefilled         (wait = 3, fewer than ``batch`` waiting)
"""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.gpuworker.engine.engine import EngineConfig
from services.gpuworker.engine.local import submit
from test_engine_support import make_setup, plain_greedy, prompts

WAIT = 3


def setup_with(wait: int = WAIT, batch: int = 4, mode: str = "none"):
    return make_setup(mode, chunk_size=64, max_batch_tokens=256, prefill_wait_steps=wait, prefill_batch=batch)


def decoding(setup, rid: str, prompt) -> None:
    """Submit ``rid`` and step until it decodes (its prompt prefilled)."""
    submit(setup, rid, prompt, max_new_tokens=40)
    for _ in range(len(prompt)):  # a chunk of at least one position a step
        if not setup.engine.state(rid).in_prefill:
            return
        setup.engine.step()
    raise AssertionError(f"{rid} never finished its prefill")


def started(setup, rid: str) -> bool:
    return setup.engine.state(rid).target_len > 0


def step_counting_holds(setup, tokens: dict[str, list[int]], finished: set[str] | None = None) -> int:
    """One engine step: collects each request's new tokens into ``tokens``, releases (and adds to
    ``finished``) the requests that ended; returns how many prompts it held (new before the
    step, still admitted and not started after it)."""
    new = [rid for rid in setup.engine.request_ids() if not started(setup, rid)]
    report = setup.engine.step()
    held = sum(not started(setup, rid) for rid in new if rid in setup.engine.request_ids())
    for rid, r in report.results.items():
        tokens.setdefault(rid, []).extend(r.new_token_ids)
        if r.finished:
            if finished is not None:
                finished.add(rid)
            setup.source.release(rid)
    return held


def test_a_new_prompt_waits_while_others_decode_then_starts():
    setup = setup_with()
    a, b = prompts((9, 7), seed=1)
    decoding(setup, "r0", a)
    submit(setup, "r1", b, max_new_tokens=4)
    for _ in range(WAIT):
        setup.engine.step()
        assert not started(setup, "r1")
        assert not setup.engine.state("r0").in_prefill  # r0 decodes on meanwhile
    setup.engine.step()
    assert started(setup, "r1")


def test_enough_waiting_prompts_start_together_at_once():
    setup = setup_with(batch=3)
    ps = prompts((9, 5, 6, 7), seed=2)
    decoding(setup, "r0", ps[0])
    submit(setup, "r1", ps[1])
    setup.engine.step()
    assert not started(setup, "r1")
    for i in (2, 3):
        submit(setup, f"r{i}", ps[i])
    setup.engine.step()  # three wait now: one forward prefills all of them
    assert all(started(setup, f"r{i}") for i in (1, 2, 3))


def test_nothing_decoding_means_no_wait_and_zero_means_off():
    p = prompts((9,), seed=3)[0]
    for setup in (setup_with(), setup_with(wait=0)):
        submit(setup, "r0", p)
        setup.engine.step()
        assert started(setup, "r0")
    off = setup_with(wait=0)
    a, b = prompts((9, 7), seed=1)
    decoding(off, "r0", a)
    submit(off, "r1", b)
    off.engine.step()
    assert started(off, "r1")


def test_a_partly_prefilled_prompt_is_not_held():
    """Chunked prefill: once a prompt's first chunk ran it is not new, so it never waits again."""
    setup = make_setup("none", chunk_size=4, max_batch_tokens=16, prefill_wait_steps=WAIT, prefill_batch=4)
    a, b = prompts((5, 30), seed=4)
    decoding(setup, "r0", a)
    submit(setup, "r1", b, max_new_tokens=4)
    for _ in range(WAIT + 1):
        setup.engine.step()
    assert started(setup, "r1")
    before = setup.engine.state("r1").target_len
    setup.engine.step()
    assert setup.engine.state("r1").target_len > before  # its next chunk ran at once


@pytest.mark.parametrize("mode", ["none", "eagle3"])
def test_outputs_equal_plain_greedy_with_staggered_arrivals(mode):
    ps = prompts((9, 13, 5, 22, 7), seed=5)
    setup = setup_with(mode=mode, batch=2)
    tokens: dict[str, list[int]] = {}
    held = 0
    for i, p in enumerate(ps):
        submit(setup, f"r{i}", p, max_new_tokens=12, k=0 if mode == "none" else 3)
        for _ in range(2):  # arrivals two steps apart, beside running decodes
            held += step_counting_holds(setup, tokens)
    while setup.engine.has_work():
        held += step_counting_holds(setup, tokens)
    assert held > 0, "no prompt waited: the test did not exercise the batching"
    for i, p in enumerate(ps):
        assert tokens[f"r{i}"] == plain_greedy(p, 12), i


@pytest.mark.parametrize("kw", [dict(prefill_wait_steps=-1), dict(prefill_batch=0), dict(prefill_wait_steps=1.5)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(InvalidArgument):
        EngineConfig(**kw)


@pytest.mark.parametrize("mode,k,overlap,num_blocks", [
    ("none", 0, True, 40),     # overlapped steps, too few blocks for every request at once
    ("eagle3", 3, False, 40),  # verify steps beside held prompts, same shortage
    ("eagle3", 0, True, 400),
])
def test_a_closed_loop_of_staggered_requests_always_finishes(mode, k, overlap, num_blocks):
    """serve_bench's engine-alone loop in small: 16 requests kept admitted, a new one joining as
    soon as one finishes (so prompts are held while others decode and while others finish),
    admission refused while blocks are short. Guards against a held prompt that is never
    released: every request must end within a bounded number of steps, each a greedy prefix."""
    from services.common.errors import ResourceExhausted

    setup = make_setup(mode, chunk_size=8, max_batch_tokens=32, prefill_wait_steps=4, prefill_batch=16,
                       overlap=overlap, num_blocks=num_blocks)
    lengths = [3 + (7 * i) % 28 for i in range(48)]
    news = [1 + (5 * i) % 12 for i in range(48)]
    ps = prompts(lengths, seed=7)
    pending = list(range(len(ps)))
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    held = refused = 0
    for _ in range(len(ps) * 8):  # a few steps per request, holds included; far fewer suffice
        while pending and len(setup.engine.request_ids()) < 16:
            i = pending[0]
            try:
                submit(setup, f"r{i}", ps[i], max_new_tokens=news[i], k=k, headroom=k + 1)
            except ResourceExhausted:
                refused += 1
                break  # retried after a request finishes and gives its blocks back
            pending.pop(0)
        if not setup.engine.has_work():
            break
        held += step_counting_holds(setup, tokens, finished)
    assert not pending and len(finished) == len(ps), f"{len(finished)}/{len(ps)} finished, {len(pending)} never admitted"
    assert held > 0 and (refused > 0) == (num_blocks < 100), (held, refused)  # the rig did what it says
    for i, p in enumerate(ps):
        got = tokens[f"r{i}"]
        assert got and got == plain_greedy(p, news[i])[: len(got)], i


def test_a_released_batch_that_does_not_fit_one_step_is_not_held_again():
    """``batch`` prompts wait, so they are released; the step's budget (32 positions) prefills
    one and a part of the next. The third must start in the next step beside that part, not
    wait ``WAIT`` more steps as a new prompt held on its own."""
    setup = make_setup("none", chunk_size=64, max_batch_tokens=32, prefill_wait_steps=WAIT, prefill_batch=3)
    ps = prompts((5, 20, 20, 20), seed=1)
    decoding(setup, "r0", ps[0])
    for i in (1, 2, 3):
        submit(setup, f"r{i}", ps[i], max_new_tokens=4)
    setup.engine.step()  # three wait: released, but only r1 and a part of r2 fit
    assert started(setup, "r1") and started(setup, "r2") and not started(setup, "r3")
    setup.engine.step()
    assert started(setup, "r3")


def test_a_prompt_waits_its_steps_beside_continued_fused_steps():
    """With overlapped fused steps, the steps launched from the last verdict (``_continue_fused``)
    hold a new prompt exactly as scheduled steps do, and the step that releases it prefills it
    beside the continued decodes."""
    setup = make_setup("eagle3", chunk_size=64, max_batch_tokens=256, prefill_wait_steps=WAIT, prefill_batch=4,
                       graphs="pad", overlap=True)
    engine = setup.engine
    a, b = prompts((9, 7), seed=1)
    submit(setup, "r0", a, max_new_tokens=60, k=3, headroom=64)
    while engine.continued_steps < 1:
        engine.step()
    submit(setup, "r1", b, max_new_tokens=4, k=3)
    before = engine.continued_steps
    for _ in range(WAIT):
        engine.step()
        assert not started(setup, "r1")
    engine.step()
    assert started(setup, "r1")
    assert engine.continued_steps - before == WAIT + 1
