"""One generated token's log-probability, as the engine computes it and the router relays it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """``token_id``'s natural-log probability under the raw target distribution and the ``top``
    most likely tokens there as (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
