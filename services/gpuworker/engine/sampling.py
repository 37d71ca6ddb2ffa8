"""Token sampling: per-request sampling parameters, their probability transform, seeded draws.

Everything random in the engine goes through a per-request ``torch.Generator`` on the CPU, and
every draw is an inverse-CDF lookup of a uniform number from that generator. That makes a request's
tokens depend only on its own seed and its own logits — not on the batch it shares a step with,
and not on the device (uniforms are drawn on the CPU and moved, never drawn on the GPU).

Transform order (the same for target and draft, which rejection sampling relies on):

    logits ──/ temperature──▶ top-k mask ──▶ softmax ──▶ min-p mask ──▶ top-p (nucleus) mask ──▶ renormalise

Greedy (temperature 0) bypasses all of it: the token is the argmax, ties to the lowest id.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from services.common.errors import InvalidArgument


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

    def __post_init__(self) -> None:
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
