"""The worker's record of the published blocks its pages hold (re-announced after a memory
kvstore restart): a block handed out as a request's own block cuts every sequence holding it."""

from __future__ import annotations

from services.gpuworker.cache_ledger import CacheLedger


def _as_tuples(ledger: CacheLedger) -> list[tuple]:
    return sorted((s.cache_salt, tuple(s.block_ids)) for s in ledger.sequences(10**9, max_count=10**6))


def test_a_longer_publish_supersedes_its_prefix_and_an_overwrite_cuts():
    ledger = CacheLedger()
    ledger.published(b"", list(range(40)), [7, 2])
    ledger.published(b"", list(range(40)), [7, 2, 9])  # the same request published one more block
    ledger.published(b"s", list(range(20)), [4])  # another tenant's sequence
    assert _as_tuples(ledger) == [(b"", (7, 2, 9)), (b"s", (4,))]
    ledger.overwritten([2])  # block 2 handed out again: blocks from it on are gone, 7 stays
    assert _as_tuples(ledger) == [(b"", (7,)), (b"s", (4,))]
    ledger.overwritten([7, 4, 99])
    assert _as_tuples(ledger) == [] and len(ledger) == 0


def test_two_sequences_sharing_a_prefix_are_cut_together():
    ledger = CacheLedger()
    ledger.published(b"", [1] * 48, [3, 5, 6])
    ledger.published(b"", [1] * 32 + [2] * 16, [3, 5, 8])
    ledger.overwritten([5])
    assert _as_tuples(ledger) == [(b"", (3,))]


def test_sequences_are_bounded_most_recent_first():
    ledger = CacheLedger()
    for b in range(10):
        ledger.published(b"", [b] * 16, [b])
    recent = ledger.sequences(10**9, max_count=3)
    assert [s.block_ids for s in recent] == [[9], [8], [7]]
    assert len(ledger.sequences(16 * 4, max_count=100)) == 4  # by tokens too
