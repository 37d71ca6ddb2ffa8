"""A Publish whose answer was lost (a kvstore failover) can be resent: with ``known_tokens`` the
store recognises a resend that had landed and appends nothing twice."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument


def test_a_resent_publish_appends_nothing_twice(store, make_spec, fingerprint):
    w = store.register_worker(make_spec(num_blocks=16))
    r = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="q", tokens=list(range(10)), headroom_positions=8)
    first = store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, new_tokens=[10, 11],
                          final_positions=12, known_tokens=10)
    assert first.reservation.num_tokens == 12 and first.reservation.published_blocks == 3
    before = fingerprint(store)
    again = store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, new_tokens=[10, 11],
                          final_positions=12, known_tokens=10)
    assert again.reservation == first.reservation and again.newly_published == 0
    assert fingerprint(store)[1:3] == before[1:3]  # workers and pools as they were
    # Other tokens at that place, or another count, are refused and change nothing.
    for new, known in (([10, 12], 10), ([13], 11), ([13], 9)):
        snap = fingerprint(store)
        with pytest.raises(InvalidArgument):
            store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, new_tokens=new,
                          final_positions=12, known_tokens=known)
        assert fingerprint(store) == snap
    # 0 = unchecked (the old wire behaviour): appends.
    res = store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, new_tokens=[12], final_positions=12)
    assert res.reservation.num_tokens == 13


def test_a_late_publish_covered_by_later_tokens_appends_nothing(store, make_spec):
    """Two Publishes queued across a kvstore restart: the worker re-announced the sequence with
    both; the older one, resent, finds its tokens there (followed by more) and changes nothing."""
    w = store.register_worker(make_spec(num_blocks=16))
    r = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="q", tokens=list(range(10)), headroom_positions=8)
    store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, new_tokens=[10, 11, 12, 13],
                  final_positions=12, known_tokens=10)
    old = store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, new_tokens=[10, 11],
                        final_positions=12, known_tokens=10)
    assert old.reservation.num_tokens == 14 and old.newly_published == 0
    with pytest.raises(InvalidArgument):  # other tokens at that place are still refused
        store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, new_tokens=[10, 99],
                      final_positions=12, known_tokens=10)
