"""The journal's entry encoding (``journal_codec``): every verb's arguments and outcome come
back exactly (hypothesis round trip), the straight-line encoders of the request verbs write
the same bytes as the general one, values of other types take the generic form and still
replay, and bytes of another version or cut short are refused."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import NotFound
from services.common.spec import SpecMode
from services.kvstore import journal_codec as codec
from services.kvstore.journal import JournalDiverged, JournaledStore
from services.kvstore.types import (ExtendItem, ItemResult, PoolUsage, PublishResult, ReleaseResult, Reservation,
                                    TrimItem, WorkerInfo, WorkerSpec)

ARGS = dict(lease_ttl_s=30.0, epoch=7, events_per_worker=0)
SPEC = WorkerSpec("w", "", "m", SpecMode.EAGLE3, 0, 4, 16, 100, 64)

ints = st.integers(min_value=-(1 << 63) + 1, max_value=(1 << 63) - 1)
opt_ints = st.none() | ints
texts = st.text(max_size=40)  # any code point, lone surrogates included
opt_texts = st.none() | texts
# ids below 2**16, 2**24 and 2**32: each width of the narrowed form
token_bytes = st.sampled_from([(1 << 16) - 1, (1 << 24) - 1, (1 << 32) - 1]).flatmap(
    lambda top: st.lists(st.integers(0, top), max_size=40)).map(lambda t: np.array(t, "<u4").tobytes())
tables = st.lists(st.integers(0, 1 << 24), max_size=6).map(tuple)
now = st.floats(min_value=0, max_value=1e9, allow_nan=False)


def reservations():
    return st.builds(Reservation, texts, texts, texts, ints, tables, ints, ints, ints, ints)


def calls():
    """(verb, keyword arguments, result) for every verb the compact form carries."""
    reserve = st.tuples(st.just("reserve"), st.fixed_dictionaries(
        {"worker_id": texts, "incarnation": ints, "request_id": texts, "tokens": token_bytes},
        optional={"cache_salt": st.binary(max_size=16), "headroom_positions": ints}), reservations())
    first = st.tuples(st.just("reserve_first"), st.fixed_dictionaries(
        {"candidates": st.lists(st.tuples(texts, ints), max_size=4), "request_id": texts, "tokens": token_bytes},
        optional={"cache_salt": st.binary(max_size=16), "headroom_positions": ints}), reservations())
    publish = st.tuples(st.just("publish"), st.fixed_dictionaries(
        {"reservation_id": texts, "incarnation": ints, "final_positions": ints},
        optional={"new_tokens": token_bytes, "worker_id": opt_texts, "known_tokens": ints}),
        st.builds(PublishResult, reservations(), ints, ints))
    end = st.tuples(st.sampled_from(["release", "suspend"]), st.fixed_dictionaries(
        {"reservation_id": texts, "incarnation": ints},
        optional={"new_tokens": token_bytes, "final_positions": opt_ints, "worker_id": opt_texts}),
        st.builds(ReleaseResult, texts, ints, ints, ints, ints))
    abort = st.tuples(st.just("abort"), st.fixed_dictionaries(
        {"reservation_id": texts, "incarnation": ints}, optional={"worker_id": opt_texts}), st.booleans())
    beat = st.tuples(st.just("heartbeat"), st.fixed_dictionaries({"worker_id": texts, "incarnation": ints}),
                     st.floats(0, 100))
    item_results = st.lists(st.builds(ItemResult, texts, st.none() | st.just(NotFound("gone")), tables, ints), max_size=4)
    extend = st.tuples(st.just("extend"), st.fixed_dictionaries(
        {"items": st.lists(st.builds(ExtendItem, opt_texts, opt_ints, opt_ints), max_size=5)},
        optional={"worker_id": opt_texts}), item_results)
    trim = st.tuples(st.just("trim"), st.fixed_dictionaries(
        {"items": st.lists(st.builds(TrimItem, opt_texts, opt_ints, opt_ints), max_size=5)},
        optional={"worker_id": opt_texts}), item_results)
    return st.one_of(reserve, first, publish, end, abort, beat, extend, trim)


def _full(verb: str, kw: dict) -> dict:
    """``kw`` with the core's defaults filled in, tokens packed as the codec reads them."""
    out = {**codec._DEFAULTS[verb], **kw}
    for name in ("tokens", "new_tokens"):
        if name in out and not isinstance(out[name], bytes):
            out[name] = np.asarray(out[name], "<u4").tobytes()
    return out


@settings(max_examples=300, deadline=None)
@given(call=calls(), t=now)
def test_every_verb_round_trips_compactly(call, t):
    verb, kw, result = call
    raw = codec.encode(verb, t, kw, result)
    assert raw[1] == codec.CODES[verb]  # the compact form, not the pickled one
    got_verb, got_t, got_kw, digest, rid = codec.decode(raw)
    assert (got_verb, got_t) == (verb, t)
    assert got_kw == _full(verb, kw)
    assert digest == codec.outcome(result)
    assert rid == codec.reservation_id(result)


@settings(max_examples=200, deadline=None)
@given(call=calls(), t=now)
def test_straight_line_encoders_write_what_the_general_one_writes(call, t):
    verb, kw, result = call
    if verb not in codec._FAST:
        return
    assert codec._FAST[verb](t, kw, result) == codec._compact(verb, t, kw, codec._SCHEMAS[verb], codec.outcome(result),
                                                                result)


def test_release_and_suspend_share_the_defaults_the_end_encoder_assumes():
    # the straight-line encoders write one "final_positions unset" for both end verbs
    assert codec._DEFAULTS["release"]["final_positions"] is codec._DEFAULTS["suspend"]["final_positions"] is None


def test_token_arrays_and_lists_are_written_packed_and_empty_defaults_as_nothing():
    r = Reservation("r-1", "q", "w", 3, (4, 5), 0, 8, 0, 6)
    for tokens in (np.arange(6, dtype=np.uint32), np.arange(6, dtype=np.int64), list(range(6)), bytearray(np.arange(6, dtype="<u4").tobytes())):
        raw = codec.encode("reserve", 1.0, dict(worker_id="w", incarnation=3, request_id="q", tokens=tokens), r)
        assert raw[1] == codec.CODES["reserve"]
        assert codec.decode(raw)[2]["tokens"] == np.arange(6, dtype="<u4").tobytes()
    raw = codec.encode("release", 1.0, dict(reservation_id="r-1", incarnation=3), ReleaseResult("r-1", 0, 0, 1, 0))
    assert codec.decode(raw)[2] == dict(reservation_id="r-1", incarnation=3, new_tokens=b"", final_positions=None,
                                        worker_id=None)


@pytest.mark.parametrize("top, width", [(0, 2), (65_535, 2), (65_536, 3), ((1 << 24) - 1, 3), (1 << 24, 4),
                                        ((1 << 32) - 1, 4)])
def test_token_ids_are_written_as_narrow_as_the_largest_id_allows(top, width):
    """A 512-token prompt of a 32k vocabulary is 1 KiB in the entry, not 2 (half of what Redis
    stores, copies and logs per Reserve); the ids come back exactly at every width."""
    tokens = np.arange(512, dtype="<u4") * (top // 511)
    tokens[-1] = top
    r = Reservation("r-1", "q", "w", 3, (4, 5), 0, 8, 0, 6)
    raw = codec.encode("reserve", 1.0, dict(worker_id="w", incarnation=3, request_id="q", tokens=tokens), r)
    wide = codec.encode("reserve", 1.0, dict(worker_id="w", incarnation=3, request_id="q", tokens=tokens[:0]), r)
    assert len(raw) - len(wide) == 1 + 512 * width
    assert codec.decode(raw)[2]["tokens"] == tokens.tobytes()


def test_entries_of_version_2_still_decode(monkeypatch):
    """Version 2 wrote every token id in 4 bytes and no width byte: a journal written by it
    replays the same."""
    r = Reservation("r-1", "q", "w", 3, (4, 5), 0, 8, 0, 6)
    kw = dict(worker_id="w", incarnation=3, request_id="q", tokens=np.arange(70_000, 70_040, dtype="<u4"))
    now_v3 = codec.encode("reserve", 1.0, kw, r)
    monkeypatch.setattr(codec, "VERSION", 2)
    monkeypatch.setattr(codec, "_tokens", lambda v: np.asarray(v, "<u4").tobytes())
    old = codec.encode("reserve", 1.0, kw, r)
    monkeypatch.undo()
    assert old[0] == 2 and now_v3[0] == codec.VERSION == 3 and len(old) == len(now_v3) + 40 - 1
    assert codec.decode(old) == codec.decode(now_v3)
    assert codec.decode(old)[2]["tokens"] == kw["tokens"].tobytes()


def test_a_token_list_of_an_unknown_width_is_refused():
    r = Reservation("r-1", "q", "w", 3, (4, 5), 0, 8, 0, 6)
    raw = codec.encode("reserve", 1.0, dict(worker_id="w", incarnation=3, request_id="q", tokens=[1, 2, 3]), r)
    at = raw.index(b"\x02\x01\x00\x02\x00\x03\x00")
    with pytest.raises(codec.EntryError):
        codec.decode(raw[:at] + b"\x05" + raw[at + 1:])


@pytest.mark.parametrize("kw", [
    dict(reservation_id="r-1", incarnation=np.int64(3), final_positions=4),  # a numpy integer
    dict(reservation_id="r-1", incarnation=3, final_positions=4, known_tokens=True),  # a bool
    dict(reservation_id="r-1", incarnation=-(1 << 63), final_positions=4),  # the None sentinel itself
    dict(reservation_id="r-1", incarnation=1 << 70, final_positions=4),  # past 64 bits
])
def test_values_of_other_types_take_the_generic_form_and_come_back_as_they_were(kw):
    result = PublishResult(Reservation("r-1", "q", "w", 3, (4,), 0, 4, 1, 4), 1, 0)
    raw = codec.encode("publish", 2.5, kw, result)
    assert raw[1] == codec.PICKLED
    verb, t, got, digest, _ = codec.decode(raw)
    assert (verb, t, digest) == ("publish", 2.5, codec.outcome(result))
    assert got == kw and [type(v) for v in got.values()] == [type(v) for v in kw.values()]


def test_registration_is_written_in_the_generic_form():
    info = WorkerInfo(SPEC, 8, 1, 30.0, PoolUsage(16, 16, 0, 0), 0)
    raw = codec.encode("register_worker", 0.5, {"spec": SPEC}, info)
    assert raw[1] == codec.PICKLED
    assert codec.decode(raw) == ("register_worker", 0.5, {"spec": SPEC}, (8, PoolUsage(16, 16, 0, 0)), None)


def test_positional_arguments_are_bound_to_the_cores_names():
    assert codec.bind("heartbeat", ("w", 3), {}) == {"worker_id": "w", "incarnation": 3}
    assert codec.bind("extend", ([],), {"worker_id": "w"}) == {"items": [], "worker_id": "w"}
    kw = {"reservation_id": "r"}
    assert codec.bind("abort", (), kw) is kw


def test_other_versions_and_cut_entries_are_refused_and_replay_says_so():
    entries: list = []
    store = JournaledStore(ARGS, lambda s, e: entries.append((s, e)))
    w = store.register_worker(SPEC)
    r = store.reserve(worker_id="w", incarnation=w.incarnation, request_id="a", tokens=list(range(20)))
    store.release(reservation_id=r.reservation_id, incarnation=w.incarnation, final_positions=19)
    assert [e[1] for _, e in entries] == [codec.PICKLED, codec.CODES["reserve"], codec.CODES["release"]]
    again = JournaledStore.recover(ARGS, None, entries)
    assert again.store.view().reservations() == store.store.view().reservations() and again.seq == 3
    old = (3, pickle.dumps(("release", 1.0, ((), {}), (), None)))  # a format-1 entry
    for bad in (old, (3, entries[2][1][:-1]), (3, entries[2][1][:5]), (3, bytes([9]) + entries[2][1][1:])):
        with pytest.raises(JournalDiverged):
            JournaledStore.recover(ARGS, None, entries[:2] + [bad])
    with pytest.raises(codec.EntryError, match="version 9"):
        codec.decode(bytes([9]) + entries[2][1][1:])
