"""Token sampling: per-request sampling parameters, their probability transform, seeded draws.

Everything random in the engine goes through a per-request ``torch.Generator`` on the CPU, and
every draw is an inverse-CDF lookup of a uniform number from that generator. That makes a request's
tokens depend only on its own seed and its own logits — not on the batch it shares a step with,
and not on the device (uniforms are drawn on the CPU and moved, never drawn on the GPU).

Transform order (the same for target and draft, which rejection sampling relies on):

    logits ──/ temperature──▶ top-k mask ──▶ softmax ──▶ min-p mask ──▶ top-p (nucleus) mask ──▶ renormalise

Greedy (temperature 0) bypasses all of it: the token is the argmax, ties to the lowest id.

Penalties come first, on the target's raw logits, for greedy and sampled requests alike
(``apply_penalties``; vLLM's order and semantics)::

    logits ──repetition (prompt + generated: divide a positive logit, multiply a negative one)
           ──frequency (− f · count in the generated tokens) ──presence (− p · [count > 0])──▶

Under speculation the row that verifies draft ``d_j`` counts the drafts ``d_1 .. d_(j-1)`` before it
as generated (they are, if ``d_j`` is reached), so verification stays exact. Drafts are proposed
from the draft's own unpenalized distribution: rejection sampling only needs the proposals to come
from the q it is given, and greedy verification only compares with the target's penalized argmax.

Logprobs (``token_logprobs``) are of the raw target distribution — ``log_softmax`` of the model's
logits before penalties and temperature — as vLLM's default (``raw_logprobs``) and OpenAI report.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from services.common.errors import InvalidArgument
from services.common.logprobs import TokenLogprob


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. Immutable.

    ``temperature == 0`` means greedy. ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` switch
    those filters off (``min_p``: drop tokens less likely than ``min_p`` × the most likely one's).
    ``seed`` fixes the request's random stream; ``None`` derives one from the request id.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI: over generated tokens, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI: over generated tokens, in [-2, 2]
    repetition_penalty: float = 1.0  # vLLM/HF: over prompt + generated tokens, > 0 (1 = off)

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or not 0.0 < rp <= 100.0:
            raise InvalidArgument(f"repetition_penalty must be in (0, 100], got {rp!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature or self.temperature == float("inf"):
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgument(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidArgument(f"seed must be a non-negative integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


GREEDY = SamplingParams()


def make_generator(params: SamplingParams, request_id: str) -> torch.Generator:
    """A fresh CPU generator for one request (seeded from ``params.seed`` or the request id)."""
    if params.seed is not None:
        seed = params.seed
    else:
        # A stable digest, not hash(): Python salts str hashes per process.
        seed = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed & ((1 << 63) - 1))
    return gen


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Row-wise sampling distribution ``[n, V]`` (float32) for a non-greedy request. Pure.

    Rows are exactly normalised over the tokens that survive top-k / top-p; filtered tokens get
    probability 0 (so they can neither be drafted nor sampled).
    """
    if params.greedy:
        raise InvalidArgument("probs_from_logits is for temperature > 0; greedy requests use argmax")
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.min_p > 0.0:  # the most likely token always survives (its ratio is 1)
        probs = probs * (probs >= params.min_p * probs.max(dim=-1, keepdim=True).values)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token if the mass strictly before it is < top_p: the smallest set reaching top_p,
        # and never empty (the most likely token has zero mass before it).
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = before < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw_uniforms(gen: torch.Generator, n: int) -> torch.Tensor:
    """``n`` uniforms in [0, 1) from a request's generator (CPU, float64). Advances ``gen``."""
    return torch.rand(n, generator=gen, dtype=torch.float64)


def sample_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: token ``j`` of row ``r`` where ``cdf[j-1] <= u[r]·total < cdf[j]``. Pure.

    Rows need not be normalised (a residual ``max(0, p - q)`` is used as is); a token of
    probability 0 is never chosen. ``uniforms`` may live on the CPU; it is moved to ``probs``.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[..., -1:]
    u = uniforms.to(device=probs.device, dtype=torch.float64).reshape(total.shape) * total
    idx = torch.searchsorted(cdf, u, right=True)
    # u·total < total, so idx < V except for rounding at the very end; clamp onto the last
    # token that has mass rather than past the vocabulary.
    last_nonzero = probs.shape[-1] - 1 - torch.argmax((probs.flip(-1) > 0).int(), dim=-1, keepdim=True)
    return torch.minimum(idx, last_nonzero).squeeze(-1)


def sample_tokens(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` ``[n, V]``. Greedy ⇒ argmax (``gen`` untouched); otherwise
    one uniform per row is drawn from ``gen`` (mutates the generator's state)."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    probs = probs_from_logits(logits, params)
    return sample_rows(probs, draw_uniforms(gen, probs.shape[0]))


def apply_penalties(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor,
                    prompt_mask: torch.Tensor | None, drafts: torch.Tensor | None = None) -> torch.Tensor:
    """Penalized rows ``[n, V]`` (float32) of one request. Pure.

    ``counts [V]``: how often each token was generated before row 0; ``prompt_mask [V]`` (bool):
    the prompt's tokens (needed only for a repetition penalty); ``drafts``: the tokens that row
    ``j`` follows after row 0 (``drafts[:j]`` count as generated for row ``j``), at least n-1.
    """
    n, vocab = logits.shape
    c = counts.to(logits.device, torch.float32).expand(n, vocab)
    if n > 1:
        if drafts is None or drafts.numel() < n - 1:
            raise InvalidArgument(f"{n} penalized rows need {n - 1} draft tokens")
        seen_before = torch.nn.functional.one_hot(drafts[: n - 1].to(logits.device), vocab).cumsum(0)
        c = c + torch.cat([torch.zeros(1, vocab, device=logits.device, dtype=c.dtype), seen_before.float()])
    x = logits.float()
    if params.repetition_penalty != 1.0:
        seen = c > 0
        if prompt_mask is not None:
            seen = seen | prompt_mask.to(logits.device)
        rp = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if params.frequency_penalty:
        x = x - params.frequency_penalty * c
    if params.presence_penalty:
        x = x - params.presence_penalty * (c > 0).float()
    return x


def token_logprobs(logits: torch.Tensor, tokens, top_n: int) -> list[TokenLogprob]:
    """``TokenLogprob`` of ``tokens[i]`` under row ``i`` of ``logits`` (raw, fp32 log_softmax).
    Pure; one host read for all rows."""
    n = len(tokens)
    if n == 0:
        return []
    lp = torch.log_softmax(logits[:n].float(), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1).tolist()
    if top_n > 0:
        vals, idx = torch.topk(lp, min(top_n, lp.shape[-1]), dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
        return [TokenLogprob(int(t), chosen[i], tuple(zip(idx[i], vals[i]))) for i, t in enumerate(tokens)]
    return [TokenLogprob(int(t), chosen[i]) for i, t in enumerate(tokens)]
