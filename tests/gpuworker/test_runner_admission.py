"""Which admissions must wait for Publish answers (``runner.BlocksInFlight``)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from services.gpuworker.runner import BlocksInFlight


def test_only_a_table_holding_a_block_in_flight_waits():
    f = BlocksInFlight()
    assert not f.touches([1, 2, 3])
    f.add([4, 5])
    f.add([5, 6])  # a second Publish of an overlapping range before the first answered
    assert f.touches([9, 5]) and f.touches([6]) and not f.touches([1, 2, 3, 7])
    f.discard([4, 5])
    assert f.touches([5]) and not f.touches([4])  # 5 is still named by the second Publish
    f.discard([5, 6])
    assert not f.touches([4, 5, 6]) and len(f) == 0


@given(st.lists(st.lists(st.integers(0, 20), max_size=6), max_size=8), st.lists(st.integers(0, 20), max_size=10))
def test_in_flight_is_the_multiset_of_unanswered_publishes(publishes, table):
    f = BlocksInFlight()
    for blocks in publishes:
        f.add(blocks)
    answered = publishes[: len(publishes) // 2]
    for blocks in answered:
        f.discard(blocks)
    pending = {b for blocks in publishes[len(publishes) // 2 :] for b in blocks}
    assert f.touches(table) == bool(pending & set(table))
    assert len(f) == len(pending)
