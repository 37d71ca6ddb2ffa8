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


def test_a_sequence_keeps_the_tokens_published_while_its_stream_grows():
    ledger = CacheLedger()
    stream = list(range(40))
    ledger.published(b"", stream, [7, 2])
    stream.extend(range(40, 50))  # the request streams on; its next Publish has not gone out yet
    (seq,) = ledger.sequences(10**9, max_count=10)
    assert seq.tokens == list(range(40))
    ledger.published(b"", stream, [7, 2, 9])
    stream.append(50)
    (seq,) = ledger.sequences(10**9, max_count=10)
    assert seq.tokens == list(range(50)) and seq.block_ids == [7, 2, 9]
    ledger.overwritten([9])  # the cut keeps the tokens the kvstore held
    (seq,) = ledger.sequences(10**9, max_count=10)
    assert seq.tokens == list(range(50)) and seq.block_ids == [7, 2]
    assert len(ledger.sequences(50, max_count=10)) == 1  # 50 tokens published; the stream holds 51


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


# ------------------------------------------------------------------ against a model (hypothesis)
from hypothesis import given, settings, strategies as st  # noqa: E402


def _model_published(model: dict, salt: bytes, ids: tuple) -> None:
    """The rule, written plainly: a sequence ending at a block the new one ends at, or that the
    new one extends (same salt, a prefix of it), is replaced by the new one."""
    for last, (s, blocks) in list(model.items()):
        if last == ids[-1] or (s == salt and len(blocks) < len(ids) and ids[: len(blocks)] == blocks):
            del model[last]
    model[ids[-1]] = (salt, ids)


def _model_overwritten(model: dict, b: int) -> None:
    for last, (s, blocks) in list(model.items()):
        if last in model and b in blocks:
            del model[last]
            cut = blocks.index(b)
            if cut and blocks[cut - 1] not in model:
                model[blocks[cut - 1]] = (s, blocks[:cut])


# Block ids as pages really hold them: a block's content fixes its whole prefix, so sequences
# are paths in a fixed forest (two cache salts, heap-shaped trees of 8 blocks each). An
# overwritten block and the blocks below it never appear in a later publish (their content is
# gone); a request publishing more of its own path is the common growth.
_TREE = {0: None, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}  # block -> parent; blocks 8..15 the same, salt "t"
_PARENT = {**_TREE, **{b + 8: (None if p is None else p + 8) for b, p in _TREE.items()}}


def _path(b: int) -> list[int]:
    out = []
    while b is not None:
        out.append(b)
        b = _PARENT[b]
    return out[::-1]


_ops = st.lists(st.one_of(
    st.tuples(st.just("publish"), st.integers(0, 15), st.integers(1, 4)),
    st.tuples(st.just("overwrite"), st.lists(st.integers(0, 15), min_size=1, max_size=4)),
), max_size=30)


@settings(max_examples=400, deadline=None)
@given(_ops)
def test_the_ledger_matches_a_plain_model(ops):
    """Random publishes (new and growing sequences, shared prefixes, two salts) and overwrites
    (an admission's blocks at once, in any order, as the kvstore's eviction hands them out):
    the ledger keeps exactly the sequences of the plain rule, and every block's holders are
    exactly the sequences listing it."""
    ledger, model = CacheLedger(), {}
    gone: set[int] = set()
    for op in ops:
        if op[0] == "publish":
            _, b, upto = op
            ids = _path(b)[:upto]
            if gone.intersection(ids):
                continue
            salt = b"" if b < 8 else b"t"
            ledger.published(salt, [1] * 16 * len(ids), ids)
            _model_published(model, salt, tuple(ids))
        else:  # several blocks of one admission at once: the same as one by one, in order
            ledger.overwritten(op[1])
            for b in op[1]:
                _model_overwritten(model, b)
                gone.update(x for x in range(16) if b in _path(x))
        assert _as_tuples(ledger) == sorted(model.values())
        holders = {b: {id(s) for s in seqs} for b, seqs in ledger._holders.items()}
        expected: dict[int, set] = {}
        for seq in ledger._sequences.values():
            for b in seq.block_ids:
                expected.setdefault(b, set()).add(id(seq))
        assert holders == expected
