"""Input validation for the kvstore verbs: pure functions that either return a normalized value
or raise ``InvalidArgument`` (nothing here touches store state).

Limits enforced: counts are integers (bools and floats rejected) within range; block sizes are
powers of two in [1, 1024]; token lists are non-empty, at most ``max_tokens`` long, within the
worker's ``max_seq_len`` and vocabulary; ``final_positions`` never exceeds the known tokens or
the reserved capacity.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from services.common.errors import InvalidArgument
from services.common.spec import SpecMode

from .keys import KeyStream, token_array
from .types import WorkerSpec

MAX_BLOCKS_PER_WORKER = 1 << 24  # bounds one registration's memory (and the block-id field of heap keys)
MAX_ID_BYTES = 128  # worker, request and reservation ids
MAX_TEXT_BYTES = 256  # address, model id
MAX_ITEMS_PER_CALL = 4096  # Extend / Trim items: one call must not hold the loop for long
SHOWN_ID_CHARS = 48  # ids echoed in error messages are cut to this


def shown(value: object) -> str:
    """``value`` for an error message: repr, cut to a bounded length (ids come from callers)."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > SHOWN_ID_CHARS:
        return repr(text[:SHOWN_ID_CHARS]) + f"... ({len(text)} chars)"
    return repr(text)


def ident(name: str, value: object, *, limit: int = MAX_ID_BYTES) -> str:
    """A non-empty string of at most ``limit`` UTF-8 bytes."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty string")
    if len(value) > limit or len(value.encode("utf-8", "surrogatepass")) > limit:
        raise InvalidArgument(f"{name} {shown(value)} is longer than {limit} bytes")
    return value


def items(values: list, limit: int) -> list:
    """A batch of at most ``limit`` items."""
    if len(values) > limit:
        raise InvalidArgument(f"{len(values)} items in one call exceed the limit of {limit}")
    return values


def count(name: str, value: object, *, minimum: int = 0) -> int:
    """An integer >= ``minimum``."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{name} must be an integer, got {value!r}") from None
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")
    return value


def salt(cache_salt: object) -> bytes:
    if not isinstance(cache_salt, (bytes, bytearray, memoryview)):
        raise InvalidArgument("cache_salt must be bytes")
    return bytes(cache_salt)


def worker_spec(spec: WorkerSpec, max_blocks: int = MAX_BLOCKS_PER_WORKER) -> WorkerSpec:
    """The spec with ``spec_mode`` as a ``SpecMode`` and ``mtp_depth`` normalized (1 unless MTP;
    0 means 1 for MTP, as on the wire)."""
    if not isinstance(spec, WorkerSpec):
        raise InvalidArgument("spec must be a WorkerSpec")
    ident("worker_id", spec.worker_id)
    if not isinstance(spec.address, str) or not isinstance(spec.model_id, str):
        raise InvalidArgument("address and model_id must be strings")
    for name in ("address", "model_id"):
        if len(getattr(spec, name).encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
            raise InvalidArgument(f"{name} is longer than {MAX_TEXT_BYTES} bytes")
    try:
        mode = spec.spec_mode if isinstance(spec.spec_mode, SpecMode) else SpecMode(spec.spec_mode)
    except ValueError:
        raise InvalidArgument(f"unknown spec mode {spec.spec_mode!r}") from None
    depth = count("mtp_depth", spec.mtp_depth)
    depth = max(depth, 1) if mode is SpecMode.MTP else 1
    block_size = count("block_size", spec.block_size, minimum=1)
    if block_size > 1024 or block_size & (block_size - 1):
        raise InvalidArgument(f"block_size must be a power of two in [1, 1024], got {block_size}")
    num_blocks = count("num_blocks", spec.num_blocks, minimum=1)
    if num_blocks > min(max_blocks, MAX_BLOCKS_PER_WORKER):
        raise InvalidArgument(f"num_blocks must be <= {min(max_blocks, MAX_BLOCKS_PER_WORKER)}, got {num_blocks}")
    vocab = count("vocab_size", spec.vocab_size, minimum=1)
    if vocab > 1 << 32:
        raise InvalidArgument("vocab_size must be <= 2**32")
    count("max_seq_len", spec.max_seq_len, minimum=1)
    return dataclasses.replace(spec, spec_mode=mode, mtp_depth=depth)


def prompt(tokens: object, max_tokens: int) -> tuple[bytes, np.ndarray]:
    """Tokens as (packed little-endian buffer, uint32 view); empty or too long is invalid."""
    if isinstance(tokens, bytes):
        if len(tokens) % 4:
            raise InvalidArgument(f"packed tokens must be a multiple of 4 bytes, got {len(tokens)}")
        buf = tokens
        arr = np.frombuffer(buf, dtype="<u4")
    else:
        arr = token_array(tokens)
        buf = arr.tobytes()
    if not len(arr):
        raise InvalidArgument("tokens must not be empty")
    if len(arr) > max_tokens:
        raise InvalidArgument(f"{len(arr)} tokens exceed the limit of {max_tokens}")
    return buf, arr


def fits_worker(spec: WorkerSpec, arr: np.ndarray, total: int) -> None:
    """A sequence of ``total`` tokens ending in ``arr`` is servable by the worker."""
    if total > spec.max_seq_len:
        raise InvalidArgument(f"{total} tokens exceed max_seq_len {spec.max_seq_len} of {spec.worker_id!r}")
    if len(arr) and int(arr.max()) >= spec.vocab_size:
        raise InvalidArgument(f"token id {int(arr.max())} is not below vocab_size {spec.vocab_size}")


def appended(stream: KeyStream, new_tokens: object, spec: WorkerSpec, max_tokens: int) -> KeyStream:
    """``stream`` with ``new_tokens`` appended. The sequence may run one token past
    ``max_seq_len``: the last sampled token, which never gets a KV position."""
    if type(new_tokens) in (tuple, list, bytes) and not new_tokens:
        return stream  # the usual Release/Publish without new tokens: skip the array round trip
    arr = token_array(new_tokens)
    if not len(arr):
        return stream
    total = stream.n + len(arr)
    if total > max_tokens:
        raise InvalidArgument(f"{total} tokens exceed the limit of {max_tokens}")
    if total > spec.max_seq_len + 1:
        raise InvalidArgument(f"{total} tokens exceed max_seq_len {spec.max_seq_len} (+1) of {spec.worker_id!r}")
    fits_worker(spec, arr, 0)
    return stream.appended(arr.tobytes())


def final_positions(value: object, stream: KeyStream, capacity_positions: int) -> int:
    """Leading positions whose KV the worker says is final: at most the known tokens and the
    reserved capacity."""
    final = count("final_positions", value)
    if final > stream.n:
        raise InvalidArgument(f"final_positions {final} exceeds the {stream.n} known tokens")
    if final > capacity_positions:
        raise InvalidArgument(f"final_positions {final} exceeds the capacity {capacity_positions}")
    return final


def resent_tokens(stream: KeyStream, new_tokens: object, known: int) -> object:
    """``new_tokens`` of a Publish that says the sequence held ``known`` tokens before them: as
    given if it does, nothing if they are already there (a resend of a call that landed, or
    of one that a worker's re-announced sequence already covers: later tokens may follow them),
    InvalidArgument otherwise."""
    if stream.n == known:
        return new_tokens
    arr = token_array(new_tokens)
    added = len(arr)
    if stream.n >= known + added and stream.buf[known * 4 : (known + added) * 4] == arr.tobytes():
        return ()
    raise InvalidArgument(f"the reservation holds {stream.n} tokens, the call assumes {known}")
