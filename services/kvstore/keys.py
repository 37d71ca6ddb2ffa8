"""The reuse key scheme of DESIGN §1: namespaces, the shifted key stream, block contents and keys.

For a lookahead span D the key of position 0 is a digest of ``t[0..D]`` (D+1 tokens) and the key
of position ``i >= 1`` is ``t[i+D]``, so a key covers every token the target KV *and* the draft
KV at that position depend on. Only positions ``i < n - D`` have a key::

    n = 10, block_size = 4, D = 1
    tokens    t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    keys      k0 t2 t3 t4 | t5 t6 t7 t8 | t9  .      k0 = blake2b-256(t0 t1); position 9 has none
              '- block 0 -' '- block 1 -' '-- not full: never published

Two equivalent views of the same stream:

* **content bytes** (the hot path): block 0 is ``tokens[0 : bs+D]`` and block ``j >= 1`` is
  ``tokens[j*bs+D : (j+1)*bs+D]``, as slices of one little-endian uint32 buffer. The radix trie is
  keyed by these exact bytes (dict lookup = keyed SipHash + full compare, so no collision can ever
  serve another prompt's KV).
* **digest view**: ``position_keys()`` spells out ``[k0, t[1+D], ...]``; the 256-bit ``BlockKey``
  of a block is ``blake2b-256(parent key || k0-or-nothing || the block's uint32 keys)``, chained
  from the namespace root ``blake2b-256(encoded namespace)``. The trie computes it at publish
  only when block events are on; the content view alone serves Match/Reserve/Publish.

Nothing here mutates shared state; ``KeyStream`` is immutable (``appended`` returns a new one).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import NewType

import numpy as np

from services.common.errors import InvalidArgument
from services.common.spec import SpecMode

BlockKey = NewType("BlockKey", bytes)
"""A 256-bit chained block key (blake2b digest); identifies a block across services and events."""

DIGEST_SIZE = 32
_TOKEN = np.dtype("<u4")
_U32_MAX = (1 << 32) - 1


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything two workers must agree on to share a cached block (one trie root each)."""

    model_id: str
    block_size: int
    spec_mode: SpecMode
    span: int
    cache_salt: bytes = b""

    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Looked up on every Match/Reserve (trie roots, per-call walks): hash the fields once.
        object.__setattr__(self, "_hash", hash((self.model_id, self.block_size, self.spec_mode, self.span, self.cache_salt)))

    def __hash__(self) -> int:
        return self._hash

    def encode(self) -> bytes:
        """Unambiguous byte encoding (length-prefixed strings), the input of the root key."""
        model = self.model_id.encode("utf-8")
        return b"".join(
            (
                b"tandem-kv-namespace-v1",
                struct.pack("<I", len(model)),
                model,
                struct.pack("<IIII", self.block_size, self.spec_mode.value, self.span, len(self.cache_salt)),
                bytes(self.cache_salt),
            )
        )

    def root_key(self) -> BlockKey:
        """``blake2b-256(encode())``: the parent key of every block 0 in this namespace."""
        return BlockKey(_digest(self.encode()))


def chain_key(parent: BlockKey, material: bytes) -> BlockKey:
    """``blake2b-256(parent || material)``; ``material`` comes from ``KeyStream.block_key_material``."""
    return BlockKey(_digest(parent + material))


def first_block_material(content: bytes, span: int) -> bytes:
    """Key material of block 0 from its content bytes (``tokens[0 : bs+D]``): the leading digest
    of its first D+1 tokens, then the other positions' uint32 keys."""
    head = (span + 1) << 2
    return _digest(content[:head]) + content[head:]


def token_array(tokens: object) -> np.ndarray:
    """Normalize tokens to a 1-D little-endian uint32 array. Accepts an integer ``np.ndarray``,
    ``bytes``/``bytearray``/``memoryview`` of packed little-endian uint32, or a sequence of ints.
    Raises ``InvalidArgument`` for anything else or for ids outside ``[0, 2**32)``."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (bytes, bytearray, memoryview)):
        if len(tokens) % 4:
            raise InvalidArgument(f"packed tokens must be a multiple of 4 bytes, got {len(tokens)}")
        return np.frombuffer(tokens, dtype=_TOKEN)
    else:
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidArgument(f"tokens must be integers: {exc}") from None
        if arr.size == 0:
            return np.zeros(0, dtype=_TOKEN)
    if arr.ndim != 1:
        raise InvalidArgument(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == _TOKEN:
        return arr
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _U32_MAX):
        raise InvalidArgument("token ids must be in [0, 2**32)")
    return arr.astype(_TOKEN)


def token_bytes(tokens: object) -> bytes:
    """Tokens as one packed little-endian uint32 buffer (no copy if already ``bytes``)."""
    if isinstance(tokens, bytes):
        if len(tokens) % 4:
            raise InvalidArgument(f"packed tokens must be a multiple of 4 bytes, got {len(tokens)}")
        return tokens
    return token_array(tokens).tobytes()


class KeyStream:
    """The key stream of one token sequence for span D and a block size (immutable).

    ``buf`` is the packed little-endian uint32 token buffer; ``n`` the token count.
    """

    __slots__ = ("buf", "n", "span", "block_size")

    def __init__(self, buf: bytes, span: int, block_size: int):
        self.buf = buf
        self.n = len(buf) >> 2
        self.span = span
        self.block_size = block_size

    @classmethod
    def from_tokens(cls, tokens: object, span: int, block_size: int) -> KeyStream:
        return cls(token_bytes(tokens), span, block_size)

    @property
    def num_keyed_blocks(self) -> int:
        """Full blocks whose every position has a key: ``(n - D) // block_size``."""
        keyed = self.n - self.span
        return keyed // self.block_size if keyed > 0 else 0

    @property
    def reusable_block_cap(self) -> int:
        """Most blocks a Reserve may reuse: ``min(n - D, n - 1) // block_size`` (the last position
        is always recomputed for its logits)."""
        limit = self.n - max(self.span, 1)
        return limit // self.block_size if limit > 0 else 0

    def block_content(self, j: int) -> bytes:
        """Exact bytes of block ``j`` in the content view (the trie's dict key)."""
        bs, d = self.block_size, self.span
        if j < 0 or j >= self.num_keyed_blocks:
            raise IndexError(f"block {j} is not a full keyed block (have {self.num_keyed_blocks})")
        start = 0 if j == 0 else (j * bs + d) << 2
        return self.buf[start : ((j + 1) * bs + d) << 2]

    def block_contents(self, start: int, stop: int) -> list[bytes]:
        """Contents of blocks ``start .. stop-1`` in one pass (``stop <= num_keyed_blocks``)."""
        if stop > self.num_keyed_blocks or start < 0:
            raise IndexError(f"blocks {start}..{stop} not all keyed (have {self.num_keyed_blocks})")
        if start >= stop:
            return []
        buf, step, d4 = self.buf, self.block_size << 2, self.span << 2
        out = [buf[: step + d4]] if start == 0 else []
        out.extend([buf[s + d4 : s + step + d4] for s in range(max(start, 1) * step, stop * step, step)])
        return out

    def leading_digest(self) -> bytes:
        """Key of position 0: ``blake2b-256(t[0..D])`` (D+1 tokens)."""
        if self.n < self.span + 1:
            raise IndexError("position 0 has no key: fewer than D+1 tokens")
        return _digest(self.buf[: (self.span + 1) << 2])

    def position_keys(self) -> list[bytes | int]:
        """The digest view, one key per keyed position: ``[k0, t[1+D], ..., t[n-1]]``."""
        if self.n < self.span + 1:
            return []
        tokens = np.frombuffer(self.buf, dtype=_TOKEN)
        return [self.leading_digest(), *(int(t) for t in tokens[self.span + 1 :])]

    def block_key_material(self, j: int) -> bytes:
        """Bytes hashed after the parent key for block ``j``: the block's position keys, with k0
        written as its 32-byte digest (block 0) and the others as little-endian uint32."""
        content = self.block_content(j)
        return first_block_material(content, self.span) if j == 0 else content

    def appended(self, tokens: object) -> KeyStream:
        """A new stream with ``tokens`` appended (used as generation proceeds)."""
        extra = token_bytes(tokens)
        return self if not extra else KeyStream(self.buf + extra, self.span, self.block_size)

    def tokens(self) -> np.ndarray:
        """The token sequence as a read-only uint32 array."""
        return np.frombuffer(self.buf, dtype=_TOKEN)
