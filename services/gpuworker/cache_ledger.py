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


@dataclass(eq=False, slots=True)  # compared and hashed by identity: block holders are sets of them
class Sequence:
    cache_salt: bytes
    stream: list[int]  # a request's tokens, only ever appended to: the first ``length`` are this sequence
    length: int
    block_ids: list[int]  # block_ids[j] holds key block j
    tick: int  # when it was last extended (recent sequences are announced first)

    @property
    def tokens(self) -> list[int]:
        """The sequence as the kvstore held it (keys of every listed block)."""
        return self.stream[: self.length]


class CacheLedger:
    """Published sequences by last block id, and which sequences each block is in."""

    def __init__(self) -> None:
        self._sequences: dict[int, Sequence] = {}  # last block id -> sequence
        self._holders: dict[int, set[Sequence]] = {}  # block id -> sequences holding it
        self._tick = 0

    def __len__(self) -> int:
        return len(self._sequences)

    def published(self, cache_salt: bytes, tokens: list[int], block_ids: list[int]) -> None:
        """Blocks ``block_ids`` hold key blocks 0.. of ``tokens`` (a Publish sent them). A shorter
        sequence it extends is dropped: this one says the same and more. The usual case, a
        request publishing more of its own sequence, extends that sequence in place: only the
        new blocks are touched (a Publish per request every few steps, at every batch size).
        ``tokens`` is kept by reference with its length now (a copy of a long request's tokens
        per Publish cost more than the rest of this): the caller only ever appends to it."""
        if not block_ids:
            return
        self._tick += 1
        ids = list(block_ids)
        last = ids[-1]
        if last in self._sequences:
            self._remove(self._sequences[last])
        grown: Sequence | None = None  # the longest sequence this one extends
        # the blocks of ours that end a sequence (usually one: our own last Publish), found by a
        # set intersection instead of a lookup per block (16 Publishes a step at c 64 k 3)
        ends = self._sequences.keys() & ids
        ends.discard(last)
        for j in sorted((ids.index(b) for b in ends), reverse=True):
            prev = self._sequences[ids[j]]
            if prev.cache_salt != cache_salt or len(prev.block_ids) != j + 1 or prev.block_ids != ids[: j + 1]:
                continue
            if grown is None:
                grown = prev
            else:
                self._remove(prev)
        if grown is None:
            seq = Sequence(cache_salt, tokens, len(tokens), ids, self._tick)
            new_blocks = ids
        else:
            del self._sequences[grown.block_ids[-1]]
            new_blocks = ids[len(grown.block_ids):]
            grown.stream, grown.length, grown.block_ids, grown.tick = tokens, len(tokens), ids, self._tick
            seq = grown
        self._sequences[last] = seq
        for b in new_blocks:
            self._holders.setdefault(b, set()).add(seq)

    def overwritten(self, block_ids: Iterable[int]) -> None:
        """These blocks are own blocks of a request now (a step will write them): every sequence
        holding one is cut just before the first of them it holds, as if they were overwritten
        one by one. Each sequence is cut once: the kvstore hands out evicted blocks deepest first,
        and cutting a 40-block sequence again for each of its last 25 blocks cost ~130 µs an
        admission (quadratic), against ~10 now."""
        cuts: dict[Sequence, int] = {}  # sequence -> the first position it loses
        for b in block_ids:
            holders = self._holders.get(b)
            if not holders:
                continue
            for seq in holders:
                cut = seq.block_ids.index(b)
                if cut < cuts.get(seq, cut + 1):
                    cuts[seq] = cut
        for seq in cuts:
            self._remove(seq)
        for seq, cut in cuts.items():  # a prefix another sequence ends at is said already
            if cut and seq.block_ids[cut - 1] not in self._sequences:
                kept = Sequence(seq.cache_salt, seq.stream, seq.length, seq.block_ids[:cut], seq.tick)
                self._sequences[kept.block_ids[-1]] = kept
                for k in kept.block_ids:
                    self._holders.setdefault(k, set()).add(kept)

    def sequences(self, max_tokens: int, max_count: int) -> list[Sequence]:
        """The sequences, most recently published first, up to ``max_tokens`` tokens and
        ``max_count`` sequences in all (what one re-registration may carry)."""
        out, total = [], 0
        for seq in sorted(self._sequences.values(), key=lambda s: -s.tick):
            total += seq.length
            if total > max_tokens or len(out) >= max_count:
                break
            out.append(seq)
        return out

    def _remove(self, seq: Sequence) -> None:
        del self._sequences[seq.block_ids[-1]]
        for b in seq.block_ids:
            holders = self._holders.get(b)
            if holders is not None:
                holders.discard(seq)
                if not holders:
                    del self._holders[b]
