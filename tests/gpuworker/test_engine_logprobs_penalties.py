"""Logprobs and penalties in the engine, with and without speculation.

* Logprobs are the target's raw log-probabilities: equal to ``log_softmax`` (fp32, CPU) of a
  from-scratch forward over the final sequence, for every emitted token and its top-N, at k = 0
  and k = 3 (scripted drafts, so accepted drafts and bonus tokens both occur).
* Penalties (presence / frequency / repetition) change greedy output as a from-scratch reference
  written here says, and speculative greedy decoding with them is token-identical to plain
  decoding (property test: random penalty values, stop sets, draft miss rates and request ids,
  which change where the scripted draft is wrong).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gpuworker.attention.base import BatchLayout, get_backend
from services.gpuworker.engine.local import run_until_done, submit
from services.gpuworker.engine.sampling import SamplingParams, apply_penalties
from test_engine_support import make_setup, models, prompts


@torch.inference_mode()
def full_logits(tokens: list[int]) -> torch.Tensor:
    """The target's logits [n, V] (fp32) of one unchunked from-scratch prefill of ``tokens``."""
    target, _ = models("eagle3")
    n = len(tokens)
    nb = -(-n // 4)
    backend = get_backend("torch", "cpu", target.attention_geometry(4))
    pool = target.new_kv_pool(nb, 4)
    out = target(torch.tensor(tokens), backend.plan(BatchLayout([list(range(nb))], [0], [n])), backend, pool)
    return out.logits.float()


def reference_penalized(logits: torch.Tensor, prompt: list[int], generated: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM/OpenAI penalties from their definitions, one token at a time (independent of apply_penalties)."""
    x = logits.clone()
    counts: dict[int, int] = {}
    for t in generated:
        counts[t] = counts.get(t, 0) + 1
    for t in set(prompt) | set(counts):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in counts.items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def run(mode, prompt, *, k, max_new, sampling=SamplingParams(), stop_ids=(), logprobs=None, rid="r", expected=None,
        miss_percent=25):
    scripted = {rid: expected} if expected is not None else None
    setup = make_setup(mode, scripted=scripted, miss_percent=miss_percent, chunk_size=5, max_batch_tokens=32)
    submit(setup, rid, prompt, max_new_tokens=max_new, k=k, sampling=sampling, stop_ids=stop_ids, logprobs=logprobs)
    return run_until_done(setup)[rid]


def test_logprobs_are_the_targets_raw_log_softmax_plain_and_speculative():
    prompt = prompts((11,), seed=4)[0]
    plain = run("eagle3", prompt, k=0, max_new=12, logprobs=3)
    seq = prompt + plain.tokens
    spec = run("eagle3", prompt, k=3, max_new=12, logprobs=3, expected=seq)
    assert spec.tokens == plain.tokens
    assert spec.accepted_drafts > 0 and spec.accepted_drafts < spec.proposed_drafts
    ref = torch.log_softmax(full_logits(seq), -1)[len(prompt) - 1 : len(seq) - 1]
    for done in (plain, spec):
        assert [lp.token_id for lp in done.logprobs] == done.tokens
        for i, lp in enumerate(done.logprobs):
            assert abs(lp.logprob - float(ref[i, lp.token_id])) < 1e-4, (i, lp.logprob)
            vals, ids = torch.topk(ref[i], 3)
            assert [t for t, _ in lp.top] == ids.tolist()
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), vals, atol=1e-4)


def test_logprobs_under_sampling_with_temperature_are_still_raw():
    prompt = prompts((9,), seed=6)[0]
    sampling = SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5)
    done = run("eagle3", prompt, k=2, max_new=8, sampling=sampling, logprobs=0)
    ref = torch.log_softmax(full_logits(prompt + done.tokens), -1)[len(prompt) - 1 : -1]
    assert len(done.logprobs) == len(done.tokens) and all(lp.top == () for lp in done.logprobs)
    for i, lp in enumerate(done.logprobs):
        assert abs(lp.logprob - float(ref[i, lp.token_id])) < 1e-4


def test_apply_penalties_matches_reference_per_verify_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=gen)
    p = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.6)
    prompt, generated, drafts = [1, 2, 2], [2, 5, 5, 7], [5, 9, 1]
    counts = torch.bincount(torch.tensor(generated), minlength=12).float()
    mask = torch.zeros(12, dtype=torch.bool)
    mask[prompt] = True
    got = apply_penalties(logits, p, counts, mask, torch.tensor(drafts))
    for j in range(4):  # row j follows the drafts before it
        want = reference_penalized(logits[j], prompt, generated + drafts[:j], p)
        assert torch.allclose(got[j], want, atol=1e-6), j


def greedy_reference(prompt, max_new, p: SamplingParams) -> list[int]:
    """Greedy decoding with penalties by full recompute each token (no engine)."""
    seq = list(prompt)
    for _ in range(max_new):
        row = reference_penalized(full_logits(seq)[-1], prompt, seq[len(prompt):], p)
        seq.append(int(torch.argmax(row)))
    return seq[len(prompt):]


def test_verify_rows_count_the_drafts_before_them():
    """Drafts that follow the unpenalized (repetitive) output: a penalty must reject a repeat
    inside one verify step's accepted run, exactly as plain decoding does."""
    prompt = prompts((7,), seed=1)[0]
    free = run("eagle3", prompt, k=0, max_new=16).tokens
    assert len(set(free)) < len(free), "the unpenalized output should repeat tokens"
    p = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)
    plain = run("eagle3", prompt, k=0, max_new=16, sampling=p)
    spec = run("eagle3", prompt, k=4, max_new=16, sampling=p, expected=prompt + free, miss_percent=0)
    assert spec.tokens == plain.tokens
    assert spec.accepted_drafts > 0


def test_penalized_greedy_matches_reference_and_changes_output():
    prompt = prompts((8,), seed=2)[0]
    p = SamplingParams(presence_penalty=1.5, frequency_penalty=0.8, repetition_penalty=1.8)
    done = run("none", prompt, k=0, max_new=10, sampling=p)
    assert done.tokens == greedy_reference(prompt, 10, p)
    assert done.tokens != run("none", prompt, k=0, max_new=10).tokens, "the penalties changed nothing"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    presence=st.floats(-2, 2), frequency=st.floats(-2, 2), repetition=st.floats(0.5, 2.5),
    k=st.integers(1, 4), miss=st.integers(0, 100), rid=st.text("abcdef", min_size=1, max_size=4),
    mode=st.sampled_from(["eagle3", "mtp2"]), stop_pick=st.lists(st.integers(0, 9), max_size=3),
    seed=st.integers(0, 5), script_unpenalized=st.booleans(),
)
def test_speculative_greedy_with_penalties_and_stops_equals_plain(presence, frequency, repetition, k, miss, rid,
                                                                   mode, stop_pick, seed, script_unpenalized):
    prompt = prompts((7,), seed=seed)[0]
    p = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    unstopped = run(mode, prompt, k=0, max_new=10, sampling=p)
    stops = tuple(unstopped.tokens[i] for i in stop_pick if i < len(unstopped.tokens))
    plain = run(mode, prompt, k=0, max_new=10, sampling=p, stop_ids=stops)
    # drafts that follow the unpenalized output propose the repeats a penalty forbids
    script = run(mode, prompt, k=0, max_new=10).tokens if script_unpenalized else unstopped.tokens
    spec = run(mode, prompt, k=k, max_new=10, sampling=p, stop_ids=stops, rid=rid,
               expected=prompt + script, miss_percent=miss)
    assert spec.tokens == plain.tokens
    assert spec.finish_reason == plain.finish_reason


def test_logprobs_out_of_range_are_refused_and_change_nothing():
    import pytest

    from services.common.errors import InvalidArgument

    setup = make_setup("none")
    for bad in (-1, 21):
        with pytest.raises(InvalidArgument):
            submit(setup, "x", prompts((5,))[0], logprobs=bad)
    assert not setup.engine.has_work() and len(setup.source._free) == setup.source.num_blocks
