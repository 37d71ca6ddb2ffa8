"""Which worker should serve a prompt: prefix reuse weighed against load. Pure and deterministic.

For every healthy worker serving the request's model::

    cost(w) = α · missing(w)      prompt blocks w would have to compute (not reusable there)
            + β · active(w)       blocks in use on w (held by running requests)
            + γ · queued(w)       requests running or waiting on w

Lowest cost first; equal costs are ordered by a seeded random draw, so the same seed gives the
same order (tests) while real ties still spread over workers. The result is the full preference
order: the router falls through to the next worker when a Reserve answers RESOURCE_EXHAUSTED.

``missing(w) = ceil(prompt_tokens / block_size(w)) − reusable_blocks(w)``::

    prompt (10 blocks)  |##########|
    reusable on w       |######----|   reusable_blocks = 6 (published, resident on w)
    missing(w)                 ^^^^    4 blocks of prefill

Default weights (settings ``policy_alpha`` / ``policy_beta`` / ``policy_gamma``): α = 1 (a block
of prefill is the unit), β = 0.01 (100 busy blocks weigh like one block of prefill: memory
pressure only matters near a full pool), γ = 2 (each request ahead costs about two blocks of
prefill in time to first token).

Worked example, prompt of 160 tokens, block size 16 (10 blocks), default weights:

    worker  reusable  active  queued   cost
    gpu0        8       300      3     1·2  + 0.01·300 + 2·3 = 11.0   third
    gpu1        0        20      0     1·10 + 0.01·20  + 2·0 = 10.2   second
    gpu2        8       100      2     1·2  + 0.01·100 + 2·2 =  7.0   first

Reuse wins over an idle but cold worker (gpu2 before gpu1), and gpu0's longer queue and fuller
pool outweigh the same reuse as gpu2's.

``round_robin`` (setting ``policy``) is the baseline that ignores reuse and load: request number
``turn`` starts at eligible worker ``turn mod n`` (workers sorted by id) and wraps around, so
consecutive requests land on consecutive workers and a full pool still falls through to the next.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

from services.common.errors import InvalidArgument


RoutingPolicy = Literal["kv_aware", "round_robin"]
ROUTING_POLICIES: tuple[str, ...] = ("kv_aware", "round_robin")


@dataclass(frozen=True, slots=True)
class PolicyWeights:
    """α, β, γ of the cost function (see the module docstring); finite and ≥ 0."""

    alpha: float = 1.0
    beta: float = 0.01
    gamma: float = 2.0

    def __post_init__(self):
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"policy weight {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class WorkerCandidate:
    """What the policy knows about one worker for one prompt (from kvstore Match + the router)."""

    worker_id: str
    model_id: str
    block_size: int
    reusable_blocks: int  # leading prompt blocks cached on the worker now
    active_blocks: int  # blocks in use there
    queued: int  # requests running or waiting there
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class RankedWorker:
    """One entry of the preference order."""

    worker_id: str
    cost: float
    missing_blocks: int


def missing_blocks(prompt_tokens: int, block_size: int, reusable_blocks: int) -> int:
    """Prompt blocks that are not reusable (to be computed) on a worker. Pure."""
    return max(0, -(-prompt_tokens // block_size) - reusable_blocks)


def worker_cost(candidate: WorkerCandidate, prompt_tokens: int, weights: PolicyWeights) -> float:
    """cost(w) of the module docstring. Pure."""
    return (
        weights.alpha * missing_blocks(prompt_tokens, candidate.block_size, candidate.reusable_blocks)
        + weights.beta * candidate.active_blocks
        + weights.gamma * candidate.queued
    )


def _check_prompt_tokens(prompt_tokens: int) -> None:
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise InvalidArgument(f"prompt_tokens must be a positive integer, got {prompt_tokens!r}")


def _eligible(candidates: Iterable[WorkerCandidate], model_id: str, exclude: Collection[str]) -> list[WorkerCandidate]:
    """Healthy, compatible, not excluded candidates (input order); raises on impossible figures."""
    out = []
    for c in candidates:
        if not c.healthy or c.worker_id in exclude or (model_id and c.model_id != model_id):
            continue
        if c.block_size < 1 or c.reusable_blocks < 0 or c.active_blocks < 0 or c.queued < 0:
            raise InvalidArgument(f"inconsistent load figures for worker {c.worker_id!r}: {c}")
        out.append(c)
    return out


def rank_workers(
    candidates: Iterable[WorkerCandidate],
    *,
    prompt_tokens: int,
    weights: PolicyWeights,
    rng: random.Random,
    model_id: str = "",
    exclude: Collection[str] = (),
) -> list[RankedWorker]:
    """Workers in preference order (lowest cost first, ties in seeded random order).

    Leaves out unhealthy workers, workers whose ``model_id`` differs from a non-empty
    ``model_id``, and ids in ``exclude``. Consumes one draw of ``rng`` per eligible worker
    (the only state it touches), so a fixed seed reproduces the order.
    """
    _check_prompt_tokens(prompt_tokens)
    ranked: list[tuple[float, float, RankedWorker]] = []
    for c in _eligible(candidates, model_id, exclude):
        cost = worker_cost(c, prompt_tokens, weights)
        entry = RankedWorker(c.worker_id, cost, missing_blocks(prompt_tokens, c.block_size, c.reusable_blocks))
        ranked.append((cost, rng.random(), entry))
    ranked.sort(key=lambda t: (t[0], t[1]))
    return [entry for _, _, entry in ranked]


def rotate_workers(
    candidates: Iterable[WorkerCandidate],
    *,
    prompt_tokens: int,
    turn: int,
    model_id: str = "",
    exclude: Collection[str] = (),
) -> list[RankedWorker]:
    """Round-robin preference order: eligible workers sorted by id, rotated to start at
    ``turn mod n``. Ignores reuse and load (``cost`` is the position in the order); leaves out the
    same workers as ``rank_workers``. Pure: the caller owns and advances ``turn``.

        sorted ids   [a, b, c]      turn 0 → a b c    turn 1 → b c a    turn 5 → c a b
    """
    _check_prompt_tokens(prompt_tokens)
    if isinstance(turn, bool) or not isinstance(turn, int) or turn < 0:
        raise InvalidArgument(f"turn must be an integer >= 0, got {turn!r}")
    eligible = sorted(_eligible(candidates, model_id, exclude), key=lambda c: c.worker_id)
    if not eligible:
        return []
    start = turn % len(eligible)
    rotated = eligible[start:] + eligible[:start]
    return [
        RankedWorker(c.worker_id, float(i), missing_blocks(prompt_tokens, c.block_size, c.reusable_blocks))
        for i, c in enumerate(rotated)
    ]
