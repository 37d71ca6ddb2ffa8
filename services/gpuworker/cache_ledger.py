"""What this worker's KV pages hold that it published: the worker's own record of its part of the
shared cache, re-announced to a kvstore that forgot it (memory backend restarted), so the cache is
rebuilt from the workers instead of lost.

The kvstore decides which published blocks stay cached and evicts them without telling the
worker. The worker does not need to know: a page's content changes only when a step of this
worker writes it, and every write goes to a block that the kvstore handed out as a request's
own (unpublished) block. So the worker keeps each published sequence (cache salt, the tokens
its Publish sent, the block ids holding its key blocks) and forgets a sequence from a block on
as soon as that block is adopted as an own block (``overwritten``), before any step writes it::

    published(salt, tokens, [7, 2, 9])      7 2 9      sequence ending at 9
    overwritten([2])  (handed out again)    7          cut before 2: ends at 7

What remains is true of the pages, whatever the kvstore evicted meanwhile. Sequences are keyed
by their last block (a block's content fixes its whole prefix), so there are at most as many
sequences as blocks. Engine thread only; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Sequence:
    cache_salt: bytes
    tokens: list[int]  # the sequence as the kvstore held it (keys of every listed block)
    block_ids: list[int]  # block_ids[j] holds key block j
    tick: int  # when it was last extended (recent sequences are announced first)


class CacheLedger:
    """Published sequences by last block id, and which sequences each block is in."""

    def __init__(self) -> None:
        self._sequences: dict[int, Sequence] = {}
        self._holders: dict[int, set[int]] = {}  # block id -> last block ids of sequences holding it
        self._tick = 0

    def __len__(self) -> int:
        return len(self._sequences)

    def published(self, cache_salt: bytes, tokens: list[int], block_ids: list[int]) -> None:
        """Blocks ``block_ids`` hold key blocks 0.. of ``tokens`` (a Publish sent them). A shorter
        sequence it extends is dropped: this one says the same and more."""
        if not block_ids:
            return
        self._tick += 1
        ids = list(block_ids)
        for j in range(len(ids) - 1):
            prev = self._sequences.get(ids[j])
            if prev is not None and prev.block_ids == ids[: j + 1] and prev.cache_salt == cache_salt:
                self._remove(ids[j])
        last = ids[-1]
        if last in self._sequences:
            self._remove(last)
        self._sequences[last] = Sequence(cache_salt, list(tokens), ids, self._tick)
        for b in ids:
            self._holders.setdefault(b, set()).add(last)

    def overwritten(self, block_ids: Iterable[int]) -> None:
        """These blocks are own blocks of a request now (a step will write them): every sequence
        holding one is cut just before it."""
        for b in block_ids:
            holders = self._holders.get(b)
            if not holders:
                continue
            for last in list(holders):
                seq = self._sequences.get(last)
                if seq is None:
                    continue
                self._remove(last)
                cut = seq.block_ids.index(b)
                if cut and seq.block_ids[cut - 1] not in self._sequences:
                    kept = seq.block_ids[:cut]
                    self._sequences[kept[-1]] = Sequence(seq.cache_salt, seq.tokens, kept, seq.tick)
                    for k in kept:
                        self._holders.setdefault(k, set()).add(kept[-1])

    def sequences(self, max_tokens: int, max_count: int) -> list[Sequence]:
        """The sequences, most recently published first, up to ``max_tokens`` tokens and
        ``max_count`` sequences in all (what one re-registration may carry)."""
        out, total = [], 0
        for seq in sorted(self._sequences.values(), key=lambda s: -s.tick):
            total += len(seq.tokens)
            if total > max_tokens or len(out) >= max_count:
                break
            out.append(seq)
        return out

    def _remove(self, last: int) -> None:
        seq = self._sequences.pop(last)
        for b in seq.block_ids:
            holders = self._holders.get(b)
            if holders is not None:
                holders.discard(last)
                if not holders:
                    del self._holders[b]
