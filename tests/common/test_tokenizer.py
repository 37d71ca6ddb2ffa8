"""Tokenizers: byte round trip, specials, streaming decode across split UTF-8 characters, the
tokenizers-library wrapper with BOS/EOS from the folder's configs, and load_tokenizer's choice."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument, NotFound
from services.gpuworker.model.config import TINY_BOS_ID, TINY_EOS_ID, TINY_VOCAB_SIZE
from services.common.tokenizer import (
    BYTE_TOKENIZER_MARKER,
    ByteTokenizer,
    HFTokenizer,
    StreamDecoder,
    load_tokenizer,
)


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == TINY_BOS_ID and all(0 <= i < 256 for i in ids[1:])
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_byte_tokenizer_specials_and_unused_ids():
    tok = ByteTokenizer()
    assert tok.vocab_size == TINY_VOCAB_SIZE and TINY_EOS_ID in tok.eos_token_ids
    ids = tok.encode("hé") + [TINY_EOS_ID, 400]
    assert tok.decode(ids) == "hé"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>hé<eos>"
    assert tok.decode([0xC3]) == "\ufffd"  # half a character
    with pytest.raises(InvalidArgument):
        tok.decode([TINY_VOCAB_SIZE])


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1, max_size=40), st.lists(st.integers(1, 5), min_size=1, max_size=40))
def test_stream_decoder_never_splits_a_character(text, cuts):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    dec = StreamDecoder(tok)
    pieces, i, c = [], 0, 0
    while i < len(ids):
        step = cuts[c % len(cuts)]
        piece = dec.push(ids[i : i + step])
        assert "\ufffd" not in piece or "\ufffd" in text
        pieces.append(piece)
        i, c = i + step, c + 1
    pieces.append(dec.flush())
    assert "".join(pieces) == text


def _write_hf_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "<pad>": 3, "hello": 4, "world": 5, "[UNK]": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>", "<eot>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"})
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))


def test_hf_tokenizer_from_a_folder(tmp_path):
    _write_hf_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [0, 4, 5]
    assert tok.encode("hello world", add_special_tokens=False) == [4, 5]
    assert tok.decode([0, 4, 5, 1]) == "hello world"
    assert (tok.bos_token_id, tok.pad_token_id) == (0, 3)
    assert tok.eos_token_ids == frozenset({1, 2})
    dec = StreamDecoder(tok)
    assert dec.push([4]) + dec.push([5]) + dec.flush() == tok.decode([4, 5])


def test_load_tokenizer_choices(tmp_path):
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    with pytest.raises(NotFound):
        load_tokenizer(tmp_path)
    (tmp_path / BYTE_TOKENIZER_MARKER).write_text(json.dumps({"type": "byte"}))
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
