"""Speculative-decoding modes and their lookahead span D (DESIGN §1).

The span is the single fact that the kvstore (key scheme) and the gpuworker (draft inputs) must
agree on, so it lives here and nowhere else.

    position:        i      i+1   ...   i+D
    target KV at i:  t[i]
    draft  KV at i:  t[i] ... t[i+D]      (depends on D tokens past i)

A block may only be published once every draft input it depends on is final, which is why the
trailing D positions of a prompt never get a key.
"""

from __future__ import annotations

import enum

# k (draft tokens per step) when nothing more specific says: a worker whose draft records none,
# and a router facing a worker that advertises none. Short chains: a longer one costs a draft
# forward and more planning per step for ever less likely tokens (docs/benchmarks.md, demo model:
# k = 3 is 1.60x plain decoding on CPU; on an H200 k = 2 and 3 were at parity with plain decoding)
DEFAULT_DRAFT_TOKENS = 3


def check_draft_tokens(num_draft_tokens: int | None, max_draft_tokens: int) -> None:
    """A configured default k must fit the largest k the same service allows (pure; worker and
    router settings). Raises ``ValueError`` naming both flags."""
    if num_draft_tokens is not None and num_draft_tokens > max_draft_tokens:
        raise ValueError(f"--num-draft-tokens {num_draft_tokens} exceeds --max-draft-tokens {max_draft_tokens}")


class SpecMode(enum.Enum):
    """How the draft of a worker reads its context. Values match ``tandem.common.v1.SpecMode``."""

    NONE = 1  # no draft model
    EAGLE3 = 2  # one draft layer over [embedding of t[i+1] ; fused target hidden h[i]]
    MTP = 3  # K chained modules; module k consumes t[i+k]
    PARD = 4  # draft reads the prompt verbatim


def lookahead_span(mode: SpecMode, mtp_depth: int = 1) -> int:
    """Return D, how many tokens past position i the draft KV at i depends on.

    ``mtp_depth`` (K) only matters for MTP. Raises ``ValueError`` for a bad depth.
    """
    if mode is SpecMode.NONE or mode is SpecMode.PARD:
        return 0
    if mode is SpecMode.EAGLE3:
        return 1
    if mode is SpecMode.MTP:
        if not isinstance(mtp_depth, int) or mtp_depth < 1:
            raise ValueError(f"MTP depth must be a positive integer, got {mtp_depth!r}")
        return mtp_depth
    raise ValueError(f"unknown spec mode {mode!r}")
