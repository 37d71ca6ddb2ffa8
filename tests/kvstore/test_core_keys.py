"""The key scheme of DESIGN §1 in the core: key stream, block contents and keys, reuse caps,
namespaces (salt, spec mode, block size), token input forms.

The expected values are derived here from the DESIGN text directly (hashlib + plain lists), not
from the module under test.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.common.spec import SpecMode
from services.kvstore import EventKind, KeyStream, KVStore, Namespace

SPANS = [(SpecMode.NONE, 0, 0), (SpecMode.EAGLE3, 0, 1), (SpecMode.MTP, 3, 3)]


def packed(ids) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def design_keys(tokens: list[int], span: int) -> list:
    """DESIGN §1 verbatim: key 0 = digest of t[0..D]; key i >= 1 = t[i+D]; only i < n - D."""
    n = len(tokens)
    if n - span <= 0:
        return []
    return [blake(packed(tokens[: span + 1]))] + [tokens[i + span] for i in range(1, n - span)]


@pytest.mark.parametrize("span", [0, 1, 3])
def test_key_stream_matches_the_design_leading_digest_and_shifted_tokens(span):
    rng = np.random.default_rng(span)
    for n in [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 17]:
        tokens = [int(t) for t in rng.integers(0, 1 << 32, n, dtype=np.uint64)]
        stream = KeyStream.from_tokens(tokens, span, 4)
        keys = design_keys(tokens, span)
        assert stream.position_keys() == keys
        if keys:
            assert stream.leading_digest() == keys[0]
        # Full keyed blocks only: the trailing D positions (and a partial block) have none.
        assert stream.num_keyed_blocks == len(keys) // 4
        assert stream.reusable_block_cap == max(0, min(n - span, n - 1)) // 4
        for j in range(stream.num_keyed_blocks):
            block_keys = keys[4 * j : 4 * j + 4]
            content = stream.block_content(j)
            if j == 0:
                # content view: the raw t[0..D] (whose digest is key 0) then keys 1..3
                assert blake(content[: 4 * (span + 1)]) == block_keys[0]
                assert content[4 * (span + 1) :] == packed(block_keys[1:])
                assert stream.block_key_material(0) == block_keys[0] + packed(block_keys[1:])
            else:
                assert content == packed(block_keys)
                assert stream.block_key_material(j) == content
        assert stream.block_contents(0, stream.num_keyed_blocks) == [
            stream.block_content(j) for j in range(stream.num_keyed_blocks)
        ]
        with pytest.raises(IndexError):
            stream.block_content(stream.num_keyed_blocks)


@pytest.mark.parametrize("span", [0, 1, 3])
def test_continuation_keeps_earlier_blocks_and_keys_more_of_them(span):
    base = list(range(10, 10 + 9 + span))
    stream = KeyStream.from_tokens(base, span, 4)
    longer = stream.appended(np.array([7, 8, 9, 10], dtype=np.uint32))
    assert longer.n == stream.n + 4 and stream.n == len(base)  # appended() leaves the original
    assert longer.num_keyed_blocks == stream.num_keyed_blocks + 1
    for j in range(stream.num_keyed_blocks):
        assert longer.block_content(j) == stream.block_content(j)
    assert longer.position_keys() == design_keys(base + [7, 8, 9, 10], span)


def test_draft_lookahead_token_is_part_of_the_key():
    # t[0..4) agree, t[4] differs: the target KV of block 0 is equal, but the EAGLE-3 draft KV
    # at position 3 read t[4], so with D = 1 block 0 must differ; with D = 0 it must not.
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 6]
    assert KeyStream.from_tokens(a, 0, 4).block_content(0) == KeyStream.from_tokens(b, 0, 4).block_content(0)
    assert KeyStream.from_tokens(a, 1, 4).block_content(0) != KeyStream.from_tokens(b, 1, 4).block_content(0)


@pytest.mark.parametrize("mode, depth, span", SPANS)
def test_store_publishes_full_keyed_blocks_only_and_caps_reuse(store, make_spec, mode, depth, span):
    w = store.register_worker(make_spec(spec_mode=mode, mtp_depth=depth, num_blocks=16))
    assert w.span == span
    # 3 full blocks of positions, but the last D positions of the prompt have no key.
    prompt = list(range(1, 13 + span))  # n = 12 + D
    r = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="a", tokens=prompt)
    res = store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, final_positions=len(prompt))
    assert res.reservation.published_blocks == 3 and res.newly_published == 3
    store.release(reservation_id=r.reservation_id, incarnation=w.incarnation)

    short = prompt[:-1]  # n - D = 11 keyed positions: only 2 full keyed blocks
    r = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="b", tokens=short)
    res = store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, final_positions=len(short))
    assert res.reservation.published_blocks == 2
    store.release(reservation_id=r.reservation_id, incarnation=w.incarnation)

    # Reuse <= min(n - D, n - 1) positions rounded down to blocks.
    for n in range(1, len(prompt) + 1):
        expected = max(0, min(n - span, n - 1)) // 4 * 4
        assert store.match(prompt[:n])[0].reusable_positions == expected, n
    # The very same prompt again: all 3 blocks are cached, but with D = 0 the last position
    # must be recomputed for its logits, so only 2 blocks are reused.
    r = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="c", tokens=prompt)
    assert r.reused_positions == (12 if span else 8)
    assert store.check_invariants() == []


def test_salt_isolation_same_salt_hits_different_salt_misses(store, make_spec):
    w = store.register_worker(make_spec(spec_mode=SpecMode.EAGLE3, num_blocks=16))
    prompt = list(range(1, 14))
    r = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="a", tokens=prompt, cache_salt=b"tenant-a")
    store.release(reservation_id=r.reservation_id, incarnation=w.incarnation, final_positions=13)
    assert store.match(prompt, cache_salt=b"tenant-a")[0].reusable_positions == 12
    assert store.match(prompt, cache_salt=b"tenant-b")[0].reusable_positions == 0
    assert store.match(prompt)[0].reusable_positions == 0
    r2 = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="b", tokens=prompt, cache_salt=b"tenant-b")
    assert r2.reused_positions == 0
    r3 = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="c", tokens=prompt, cache_salt=b"tenant-a")
    assert r3.reused_positions == 12


MTP3 = dict(spec_mode=SpecMode.MTP, mtp_depth=3)


@pytest.mark.parametrize(
    "base, other",
    [
        ({}, dict(spec_mode=SpecMode.PARD)),  # same D = 0 as NONE, still another namespace
        ({}, dict(block_size=8)),
        ({}, dict(model_id="other-model")),
        (MTP3, dict(spec_mode=SpecMode.MTP, mtp_depth=2)),
        (MTP3, dict(spec_mode=SpecMode.EAGLE3)),
    ],
)
def test_workers_share_entries_only_within_one_namespace(store, make_spec, base, other):
    a = store.register_worker(make_spec("a", **base))
    twin = store.register_worker(make_spec("twin", **base))
    b = store.register_worker(make_spec("b", **{**base, **other}))
    prompt = list(range(1, 30))
    for w in (a, b):
        r = store.reserve(worker_id=w.worker_id, incarnation=w.incarnation, request_id=w.worker_id, tokens=prompt)
        store.release(reservation_id=r.reservation_id, incarnation=w.incarnation, final_positions=len(prompt))
    nodes_a = KeyStream.from_tokens(prompt, a.span, a.spec.block_size).num_keyed_blocks
    nodes_b = KeyStream.from_tokens(prompt, b.span, b.spec.block_size).num_keyed_blocks
    assert nodes_a > 0 and nodes_b > 0
    # Disjoint namespaces: no node is shared, so the trie holds both chains in full.
    assert store.stats().trie_nodes == nodes_a + nodes_b
    keys_a = {k for e in store.events_since("a", 0) for k in e.block_keys}
    keys_b = {k for e in store.events_since("b", 0) for k in e.block_keys}
    assert keys_a and keys_b and not keys_a & keys_b
    # Same namespace on another worker: the trie entry is shared, residency is not.
    matches = {m.worker_id: m.reusable_positions for m in store.match(prompt)}
    assert matches["twin"] == 0 and matches["a"] > 0
    r = store.reserve(worker_id="twin", incarnation=twin.incarnation, request_id="t", tokens=prompt)
    store.release(reservation_id=r.reservation_id, incarnation=twin.incarnation, final_positions=len(prompt))
    assert store.stats().trie_nodes == nodes_a + nodes_b
    assert store.check_invariants() == []


def test_block_keys_chain_from_the_namespace_root(store, make_spec):
    w = store.register_worker(make_spec(spec_mode=SpecMode.EAGLE3, model_id="llama-x"))
    prompt = list(range(40, 53))  # n = 13, D = 1: 3 keyed blocks
    r = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="a", tokens=prompt, cache_salt=b"s")
    store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, final_positions=13)
    [event] = store.events_since("w0", 0)
    assert event.kind is EventKind.STORED and event.block_ids == r.block_table[:3]
    ns = Namespace("llama-x", 4, SpecMode.EAGLE3, 1, b"s")
    model = b"llama-x"
    encoded = b"tandem-kv-namespace-v1" + struct.pack("<I", len(model)) + model + struct.pack("<IIII", 4, 2, 1, 1) + b"s"
    assert ns.encode() == encoded
    root = blake(encoded)
    assert event.parent_key == root
    keys = design_keys(prompt, 1)
    k0 = blake(root + keys[0] + packed(keys[1:4]))
    k1 = blake(k0 + packed(keys[4:8]))
    k2 = blake(k1 + packed(keys[8:12]))
    assert event.block_keys == (k0, k1, k2)


@pytest.mark.parametrize("read_early", [True, False])
def test_event_keys_are_the_design_keys_even_when_read_after_eviction_and_drop(make_spec, clock, read_early):
    """Events carry keys computed when they were recorded: reading every event right away, or
    only after its blocks were evicted, pruned and the worker re-registered, gives the same
    design keys."""
    store = KVStore(clock=clock, lease_ttl_s=10.0, epoch=0, events_per_worker=64)
    w = store.register_worker(make_spec(spec_mode=SpecMode.EAGLE3, model_id="llama-x"))
    seen = []

    def step() -> None:
        if read_early:
            seen[:] = store.events_since("w0", 0)
            for e in seen:
                assert len(e.block_keys) == len(e.block_ids)

    prompt = list(range(40, 53))  # D = 1, n = 13: 3 keyed blocks
    longer = prompt + [60, 61, 62, 63]  # 16 keyed positions: one more block
    for rid, tokens in (("a", prompt), ("b", longer)):
        r = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id=rid, tokens=tokens)
        store.publish(reservation_id=r.reservation_id, incarnation=w.incarnation, final_positions=len(tokens))
        store.release(reservation_id=r.reservation_id, incarnation=w.incarnation)
        step()
    r = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="c", tokens=list(range(1, 33)))
    step()  # all 4 published blocks evicted, their nodes pruned
    store.register_worker(make_spec(spec_mode=SpecMode.EAGLE3, model_id="llama-x"))
    assert store.stats().trie_nodes == 0
    events = store.events_since("w0", 0)
    assert [e.kind for e in events] == [EventKind.STORED, EventKind.STORED, EventKind.REMOVED, EventKind.CLEARED]
    if read_early:
        assert events[:3] == seen[:3]
    root = Namespace("llama-x", 4, SpecMode.EAGLE3, 1, b"").root_key()
    keys = design_keys(longer, 1)
    chain = [blake(root + keys[0] + packed(keys[1:4]))]
    for j in (1, 2, 3):
        chain.append(blake(chain[-1] + packed(keys[4 * j : 4 * j + 4])))
    stored_a, stored_b, removed, cleared = events
    assert (stored_a.parent_key, stored_a.block_keys) == (root, tuple(chain[:3]))
    assert (stored_b.parent_key, stored_b.block_keys) == (chain[2], (chain[3],))
    assert removed.block_keys == tuple(reversed(chain)) and removed.parent_key is None
    assert cleared.block_keys == () and cleared.parent_key is None


def test_namespace_encoding_is_unambiguous():
    a = Namespace("ab", 4, SpecMode.NONE, 0, b"c")
    b = Namespace("a", 4, SpecMode.NONE, 0, b"bc")
    assert a.encode() != b.encode() and a.root_key() != b.root_key()


def test_token_input_forms_agree_and_bad_ones_are_rejected(store, make_spec):
    w = store.register_worker(make_spec(vocab_size=1 << 20))
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    r = store.reserve(worker_id="w0", incarnation=w.incarnation, request_id="a", tokens=ids)
    store.release(reservation_id=r.reservation_id, incarnation=w.incarnation, final_positions=9)
    forms = [ids, tuple(ids), np.array(ids, dtype=np.uint32), np.array(ids, dtype=np.int64), packed(ids), bytearray(packed(ids))]
    assert {store.match(f)[0].reusable_positions for f in forms} == {8}
    bad = [[], b"\x01\x02\x03", [-1, 2], [1 << 32], np.zeros((2, 2), dtype=np.uint32), [1.5, 2.0], ["a"]]
    for tokens in bad:
        with pytest.raises(InvalidArgument):
            store.match(tokens)
