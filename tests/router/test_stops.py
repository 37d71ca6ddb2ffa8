"""Stop strings over a token stream (services.router.stops): the earliest match wins whatever
the message boundaries (one verify step's accepted run arrives as one message), the text ends
before the match, and only tokens up to the one completing it count."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.common.tokenizer import ByteTokenizer
from services.router.jobs import RequestLimits, build_job
from services.router.stops import StopScanner, validate_stop_strings

TOK = ByteTokenizer()
ALPHABET = "ab \né€"  # multi-byte characters too: a stop may complete only with a character's last byte


def reference(ids: list[int], stops: list[str]) -> tuple[str, int | None]:
    """The first token after which the decoded prefix contains a stop string (brute force)."""
    for n in range(1, len(ids) + 1):
        text = TOK.decode(ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], n
    return TOK.decode(ids), None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(1, 6), max_size=40),
)
def test_scanner_equals_brute_force_for_any_message_boundaries(text, stops, cuts):
    ids = TOK.encode(text, add_special_tokens=False)
    scanner = StopScanner(validate_stop_strings(stops), TOK)
    out, counted, i, cuts = [], None, 0, iter(cuts)
    while i < len(ids):
        step = next(cuts, 3)
        piece, cut = scanner.push(ids[i : i + step])
        out.append(piece)
        if cut is not None:
            counted = i + cut
            break
        i += step
    else:
        rest, stopped = scanner.flush()
        out.append(rest)
        assert not stopped
    assert ("".join(out), counted) == reference(ids, stops)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 255), max_size=30), start=st.integers(0, 30), size=st.integers(1, 3),
       cuts=st.lists(st.integers(1, 6), max_size=30))
def test_any_bytes_never_emit_past_a_stop(ids, start, size, cuts):
    """Invalid UTF-8 too (the decoder holds such text back until it resolves): the emitted text
    is the full text up to the first match, and a match is never missed."""
    full = TOK.decode(ids)
    stop = full[start : start + size] or "a"
    scanner = StopScanner([stop], TOK)
    out, i, cuts, stopped = [], 0, iter(cuts), False
    while i < len(ids) and not stopped:
        step = next(cuts, 3)
        piece, cut = scanner.push(ids[i : i + step])
        out.append(piece)
        stopped, i = cut is not None, i + step
    if not stopped:
        rest, stopped = scanner.flush()
        out.append(rest)
    text = "".join(out)
    assert stopped == (stop in full)
    assert text == (full[: full.find(stop)] if stop in full else full)


def test_text_that_may_start_a_stop_is_held_back_until_decided():
    scanner = StopScanner(["END"], TOK)
    assert scanner.push(TOK.encode("abcE", add_special_tokens=False)) == ("abc", None)
    assert scanner.push(TOK.encode("Nx", add_special_tokens=False)) == ("ENx", None)
    assert scanner.push(TOK.encode("yEND!!", add_special_tokens=False)) == ("y", 4)
    with pytest.raises(InvalidArgument):
        scanner.push([1])


def test_stop_strings_are_validated_and_ignore_eos_drops_the_implied_eos():
    for bad in ([""], ["x" * 257], [str(i) for i in range(17)]):
        with pytest.raises(InvalidArgument):
            validate_stop_strings(bad)
    assert validate_stop_strings(["a", "b", "a"]) == ("a", "b")
    limits = RequestLimits(vocab_size=512, max_new_tokens=8, max_prompt_tokens=64, default_draft_tokens=2,
                           max_draft_tokens=4, eos_token_ids=frozenset({TOK.eos_token_id}))
    job = build_job(text="hi", token_ids=None, max_new_tokens=4, stop_strings=["\n"], limits=limits, tokenizer=TOK)
    assert job.sampling.stop_strings == ("\n",) and TOK.eos_token_id in job.sampling.stop_token_ids
    job = build_job(text="hi", token_ids=None, max_new_tokens=4, ignore_eos=True, limits=limits, tokenizer=TOK)
    assert job.sampling.stop_token_ids == ()
