"""A validated generation request (:class:`GenerateJob`) and the checks that produce it. Pure.

Everything a client can get wrong is rejected here with INVALID_ARGUMENT, before the router
touches the kvstore (so a bad request changes no counter anywhere).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from services.common.errors import InvalidArgument
from services.common.tokenizer import Tokenizer
from services.router.stops import validate_stop_strings

MAX_REQUEST_ID_CHARS = 96  # + tenant scope (13), "#15" (a sample), "~9" (a retry): at most 128 bytes downstream
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit; the worker's too)
MAX_SAMPLES = 16  # ``n``


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the router accepts (from its settings and tokenizer)."""

    vocab_size: int
    max_new_tokens: int
    max_prompt_tokens: int
    default_draft_tokens: int | None  # None: the chosen worker's default (resolved by the dispatcher)
    max_draft_tokens: int
    eos_token_ids: frozenset[int] = frozenset()  # always stops, whatever the request says


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling parameters as the worker receives them (normalized: top_p 0 → 1)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None  # None = unseeded
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...] = ()  # ended by the router (``stops``), never sent to the worker
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top alternatives per token; None = no logprobs


@dataclass(frozen=True, slots=True)
class GenerateJob:
    """One accepted request. ``prompt`` is a read-only uint32 array."""

    request_id: str
    prompt: np.ndarray
    sampling: Sampling
    # the request's own k, else the router's setting; None: the chosen worker's default, which
    # only the dispatcher knows (Worker.Info) and resolves before it reserves
    num_draft_tokens: int | None

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt.size)


def headroom_positions(num_draft_tokens: int) -> int:
    """Capacity to reserve past the prompt for a first step of ``num_draft_tokens`` drafts: the
    drafts plus the step's bonus token."""
    return num_draft_tokens + 1


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, got {value}")
    return float(value)


def _request_id(request_id: str, new_id: Callable[[], str], sample: int = 0) -> str:
    """The caller's id, validated, with ``#sample`` for samples after the first; a fresh one
    when the caller gave none."""
    if not request_id:
        return new_id()
    if len(request_id.encode("utf-8", "surrogatepass")) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID_CHARS} bytes")
    if not request_id.isprintable() or any(c.isspace() for c in request_id):
        raise InvalidArgument("request_id must be printable and contain no whitespace")
    return f"{request_id}#{sample}" if sample else request_id


def build_job(
    *,
    text: str | None,
    token_ids: np.ndarray | None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    num_draft_tokens: int | None = None,
    stop_token_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    ignore_eos: bool = False,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logprobs: int | None = None,
    request_id: str = "",
    limits: RequestLimits,
    tokenizer: Tokenizer,
    new_request_id: Callable[[], str] = lambda: uuid.uuid4().hex,
) -> GenerateJob:
    """Validate a request and tokenize its prompt (exactly one of ``text`` / ``token_ids``).

    Raises InvalidArgument for: no or empty prompt, a prompt longer than the limit, token ids
    (prompt or stop) outside the vocabulary, ``max_new_tokens`` 0 or above the limit, sampling
    values out of range, too many draft tokens, a malformed request id. An empty ``request_id``
    gets a fresh uuid4 (more samples of it: ``sample_jobs``). Pure apart from ``new_request_id``.
    """
    if (text is None) == (token_ids is None):
        raise InvalidArgument("exactly one of text and token_ids must be given")
    if text is not None:
        if not text:
            raise InvalidArgument("prompt text is empty")
        prompt = np.asarray(tokenizer.encode(text), dtype=np.uint32)
    else:
        prompt = np.asarray(token_ids, dtype=np.uint32)
    if prompt.size == 0:
        raise InvalidArgument("prompt is empty")
    if prompt.size > limits.max_prompt_tokens:
        raise InvalidArgument(f"prompt has {prompt.size} tokens; the limit is {limits.max_prompt_tokens}")
    top = int(prompt.max())
    if top >= limits.vocab_size:
        raise InvalidArgument(f"prompt token id {top} is outside the vocabulary (size {limits.vocab_size})")
    prompt.setflags(write=False)

    if not 1 <= max_new_tokens <= limits.max_new_tokens:
        raise InvalidArgument(f"max_new_tokens must be in 1..{limits.max_new_tokens}, got {max_new_tokens}")
    temperature = _finite("temperature", temperature)
    if temperature < 0:
        raise InvalidArgument(f"temperature must be >= 0, got {temperature}")
    top_p = _finite("top_p", top_p)
    if not 0 <= top_p <= 1:
        raise InvalidArgument(f"top_p must be in [0, 1] (0 means 1), got {top_p}")
    if seed is not None and not 0 <= seed < 1 << 64:
        raise InvalidArgument(f"seed must be in 0..2**64-1, got {seed}")
    min_p = _finite("min_p", min_p)
    if not 0 <= min_p <= 1:
        raise InvalidArgument(f"min_p must be in [0, 1], got {min_p}")
    if top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0, got {top_k}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -2 <= _finite(name, value) <= 2:
            raise InvalidArgument(f"{name} must be in [-2, 2], got {value}")
    repetition_penalty = _finite("repetition_penalty", repetition_penalty)
    if not 0 < repetition_penalty <= 100:
        raise InvalidArgument(f"repetition_penalty must be in (0, 100], got {repetition_penalty}")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be in 0..{MAX_LOGPROBS}, got {logprobs}")

    draft = limits.default_draft_tokens if num_draft_tokens is None else num_draft_tokens
    if draft is not None and not 0 <= draft <= limits.max_draft_tokens:
        raise InvalidArgument(f"num_draft_tokens must be in 0..{limits.max_draft_tokens}, got {draft}")

    stops = list(dict.fromkeys(int(t) for t in stop_token_ids))  # de-duplicated, order kept
    bad = [t for t in stops if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidArgument(f"stop token id {bad[0]} is outside the vocabulary (size {limits.vocab_size})")
    if not ignore_eos:
        stops.extend(sorted(limits.eos_token_ids - set(stops)))  # end-of-sequence stops unless ignore_eos

    return GenerateJob(
        request_id=_request_id(request_id, new_request_id),
        prompt=prompt,
        sampling=Sampling(
            temperature=temperature,
            top_p=top_p or 1.0,
            top_k=int(top_k),
            seed=None if seed is None else int(seed),
            max_new_tokens=int(max_new_tokens),
            stop_token_ids=tuple(stops),
            stop_strings=validate_stop_strings(stop_strings),
            min_p=min_p,
            presence_penalty=float(presence_penalty),
            frequency_penalty=float(frequency_penalty),
            repetition_penalty=repetition_penalty,
            logprobs=None if logprobs is None else int(logprobs),
        ),
        num_draft_tokens=None if draft is None else int(draft),
    )


def sample_jobs(n: int, build: Callable[..., GenerateJob], *, seed: int | None, request_id: str = "",
                new_request_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> list[GenerateJob]:
    """``n`` samples of one request: ``build(seed=..., request_id=...)`` validates and tokenizes
    it once; samples i > 0 are that job with seed + i (seeded requests) and the caller's request
    id + ``#i``, added after the id was validated (a fresh id when the caller gave none), so a
    long prompt is not tokenized n times. InvalidArgument for n outside 1..MAX_SAMPLES."""
    if not 1 <= n <= MAX_SAMPLES:
        raise InvalidArgument(f"n must be in 1..{MAX_SAMPLES}, got {n}")

    def seed_of(i: int) -> int | None:
        return None if seed is None else (seed + i) % (1 << 64)

    first = build(seed=seed_of(0), request_id=request_id)
    return [first] + [replace(first, request_id=_request_id(request_id, new_request_id, i),
                              sampling=replace(first.sampling, seed=seed_of(i))) for i in range(1, n)]
