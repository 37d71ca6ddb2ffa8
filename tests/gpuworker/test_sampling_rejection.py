"""Rejection sampling preserves the target distribution (seeded statistical test).

A toy "language model" over a 4-token vocabulary: the target p(·|prefix) and a deliberately
different draft q(·|prefix) are fixed random tables. Many independent generations of the first 3
tokens run through speculative steps (k = 3 drafts sampled from q, verified with
``accept_sampled_batch``); the empirical joint distribution of those 3 tokens (64 outcomes) is
compared with the exact target joint by a chi-square test. Seeds are fixed, so the test is
deterministic; the threshold is the 0.1 % quantile of chi2(63) ≈ 103.4. Negative controls show the
test has power: forcing acceptance of every draft, or verifying against a wrong q, fails it.
"""

from __future__ import annotations

import itertools

import torch

from services.gpuworker.engine.acceptance import accept_sampled_batch
from services.gpuworker.engine.sampling import sample_rows

V, K, M = 4, 3, 3  # vocab, drafts per step, tokens compared
N = 40_000  # generations
CHI2_63_Q999 = 103.4


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


def _chi_square(samples: torch.Tensor) -> float:
    p_tab, _, offsets = _tables(1234)
    codes = (samples[:, 0] * V + samples[:, 1]) * V + samples[:, 2]
    counts = torch.bincount(codes, minlength=V**M).double()
    chi2 = 0.0
    for seq in itertools.product(range(V), repeat=M):
        prob, code = 1.0, 0
        for length, tok in enumerate(seq):
            prob *= float(p_tab[offsets[length] + code, tok])
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
