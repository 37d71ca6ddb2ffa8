"""Rejection sampling preserves the target distribution (seeded statistical test).

A toy "language model" over a 4-token vocabulary: the target p(·|prefix) and a deliberately
different draft q(·|prefix) are fixed random tables. Many independent generations of the first 3
tokens run through speculative steps (k = 3 drafts sampled from q, verified with
``accept_sampled_batch``); the empirical joint distribution of those 3 tokens (64 outcomes) is
compared with the exact target joint by a chi-square test. Seeds are fixed, so the test is
deterministic; the threshold is the 0.1 % quantile of chi2(63) ≈ 103.4. Negative controls show the
test has power: forcing acceptance of every draft, or verifying against a wrong q, fails it.

Penalties: the same test with the target's rows penalized by ``apply_penalties`` (presence,
frequency and repetition; the whole prefix counts as generated), row j of a verify counting the
drafts before it, against the exact joint of the penalized target written from the definitions.
Verifying rows that ignore the drafts before them (the bug this guards against) fails it.
"""

from __future__ import annotations

import itertools

import torch

from services.gpuworker.engine.acceptance import accept_sampled_batch
from services.gpuworker.engine.sampling import SamplingParams, apply_penalties, sample_rows

V, K, M = 4, 3, 3  # vocab, drafts per step, tokens compared
N = 40_000  # generations
CHI2_63_Q999 = 103.4


PENALTIES = SamplingParams(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.7)


def _decode(code: int, length: int) -> list[int]:
    out = []
    for _ in range(length):
        out.append(code % V)
        code //= V
    return out[::-1]


def _penalized_row(logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    """The penalized target's p(·|prefix) from the definitions (the prefix is all generated)."""
    x = logits.clone()
    for t in set(prefix):
        c = prefix.count(t)
        x[t] = x[t] / PENALTIES.repetition_penalty if x[t] > 0 else x[t] * PENALTIES.repetition_penalty
        x[t] -= PENALTIES.frequency_penalty * c + PENALTIES.presence_penalty
    return torch.softmax(x, -1)


def _logit_table(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    total = sum(V**length for length in range(M + K + 1))
    return torch.randn(total, V, generator=gen) * 1.5


def _penalized_p_rows(logit_tab, offsets, ln, code, drafts, count_drafts: bool) -> torch.Tensor:
    """The verify rows [n, K+1, V] as the engine builds them: apply_penalties over the raw rows of
    each (prefix, drafts) group, with the prefix's counts."""
    n = ln.numel()
    out = torch.zeros(n, K + 1, V)
    keys: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(ln.tolist(), code.tolist(), map(tuple, drafts.tolist()))):
        keys.setdefault(key, []).append(i)
    for (length, c, ds), rows in keys.items():
        prefix = _decode(c, length)
        raw, cc, cur = [], c, length
        for j in range(K + 1):
            raw.append(logit_tab[offsets[cur] + cc])
            if j < K:
                cc, cur = cc * V + ds[j], cur + 1
        counts = torch.bincount(torch.tensor(prefix, dtype=torch.long), minlength=V).float()
        d = torch.tensor(ds)
        if count_drafts:
            pen = apply_penalties(torch.stack(raw), PENALTIES, counts, None, d)
        else:  # the bug: every row penalized as if it followed the prefix alone
            pen = torch.stack([apply_penalties(r.unsqueeze(0), PENALTIES, counts, None)[0] for r in raw])
        out[rows] = torch.softmax(pen, -1)
    return out


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """p and q rows for every prefix up to length M + K, indexed offset[len] + base-V code."""
    gen = torch.Generator().manual_seed(seed)
    offsets, total = [], 0
    for length in range(M + K + 1):
        offsets.append(total)
        total += V**length
    logits = torch.randn(total, V, generator=gen) * 1.5
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits + torch.randn(total, V, generator=gen) * 1.5, -1)
    return p, q, offsets


def _generate(mode: str, seed: int = 0) -> torch.Tensor:
    p_tab, q_tab, offsets = _tables(1234)
    logit_tab = _logit_table(99)
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(N, M + K + 1, dtype=torch.long)
    length = torch.zeros(N, dtype=torch.long)
    off = torch.tensor(offsets)
    while True:
        active = (length < M).nonzero().squeeze(-1)
        if active.numel() == 0:
            break
        n = active.numel()
        ln = length[active]
        code = torch.zeros(n, dtype=torch.long)
        for j in range(M):  # base-V code of the current prefix (tokens past ln ignored)
            code = torch.where(j < ln, code * V + out[active, j], code)
        num_drafts = torch.randint(0, K + 1, (n,), generator=gen)  # ragged batch, padded to K
        drafts = torch.zeros(n, K, dtype=torch.long)
        q_rows = torch.zeros(n, K, V)
        p_rows = torch.zeros(n, K + 1, V)
        c, cur = code.clone(), ln.clone()
        for j in range(K + 1):
            idx = off[cur] + c
            p_rows[:, j] = p_tab[idx]
            if j == K:
                break
            q_rows[:, j] = q_tab[idx]
            drafts[:, j] = sample_rows(q_rows[:, j], torch.rand(n, generator=gen, dtype=torch.float64))
            c, cur = c * V + drafts[:, j], cur + 1
        if mode in ("penalized", "penalized_ignoring_drafts"):
            p_rows = _penalized_p_rows(logit_tab, offsets, ln, code, drafts, mode == "penalized")
        q_claimed = torch.full_like(q_rows, 1.0 / V) if mode == "wrong_q" else q_rows
        forced = num_drafts.clone() if mode == "force_all" else None
        accepted, token = accept_sampled_batch(
            drafts, q_claimed, p_rows, num_drafts,
            torch.rand(n, K, generator=gen, dtype=torch.float64),
            torch.rand(n, generator=gen, dtype=torch.float64), forced,
        )
        assert bool((accepted <= num_drafts).all())
        for j in range(K + 1):  # write accepted drafts then the final token
            pos = ln + j
            val = torch.where(j < accepted, drafts[:, min(j, K - 1)], token)
            keep = j <= accepted
            out[active[keep], pos[keep]] = val[keep]
        length[active] = ln + accepted + 1
    return out[:, :M]


def _chi_square(samples: torch.Tensor, penalized: bool = False) -> float:
    p_tab, _, offsets = _tables(1234)
    logit_tab = _logit_table(99)
    codes = (samples[:, 0] * V + samples[:, 1]) * V + samples[:, 2]
    counts = torch.bincount(codes, minlength=V**M).double()
    chi2 = 0.0
    for seq in itertools.product(range(V), repeat=M):
        prob, code = 1.0, 0
        for length, tok in enumerate(seq):
            row = _penalized_row(logit_tab[offsets[length] + code], list(seq[:length])) if penalized \
                else p_tab[offsets[length] + code]
            prob *= float(row[tok])
            code = code * V + tok
        expected = prob * samples.shape[0]
        chi2 += float((counts[code] - expected) ** 2 / expected)
    return chi2


def test_rejection_sampling_matches_target_joint_distribution():
    chi2 = _chi_square(_generate("correct"))
    assert chi2 < CHI2_63_Q999, f"chi2={chi2:.1f} over 63 dof: speculative output is not distributed as the target"


def test_negative_controls_fail_the_same_test():
    assert _chi_square(_generate("force_all")) > 3 * CHI2_63_Q999
    assert _chi_square(_generate("wrong_q")) > 3 * CHI2_63_Q999


def test_different_seed_also_passes():
    assert _chi_square(_generate("correct", seed=7)) < CHI2_63_Q999


def test_penalized_verification_matches_the_penalized_target():
    chi2 = _chi_square(_generate("penalized"), penalized=True)
    assert chi2 < CHI2_63_Q999, f"chi2={chi2:.1f}: penalized speculative output is not the penalized target's"
    assert _chi_square(_generate("penalized_ignoring_drafts"), penalized=True) > 3 * CHI2_63_Q999
