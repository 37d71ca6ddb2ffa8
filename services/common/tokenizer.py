"""Tokenizers shared by the router (text → ids) and the worker (stop ids, demos).

* :class:`ByteTokenizer` — the built-in ``tiny`` model's: id ``b`` is byte ``b`` (0..255), then
  ``BOS`` = 256, ``EOS`` = 257, ``PAD`` = 258. Lossless for any UTF-8 text.
* :class:`HFTokenizer` — a ``tokenizer.json`` from a Hugging Face style model folder, via the
  ``tokenizers`` library.

Both offer ``encode(text) -> list[int]``, ``decode(ids) -> str`` and an :class:`IncrementalDecoder`
that turns a growing id stream into text deltas without splitting a multi-byte character.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer of the built-in ``tiny`` model."""

    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = 259
    bos_token_id = BOS
    eos_token_id = EOS

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id, self.eos_token_id = _special_ids(path.parent, self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _special_ids(folder: Path, tok) -> tuple[int | None, int | None]:
    """BOS/EOS ids from ``tokenizer_config.json`` / ``config.json`` when present."""
    bos = eos = None
    for name in ("config.json", "generation_config.json"):
        f = folder / name
        if f.exists():
            cfg = json.loads(f.read_text())
            bos = cfg.get("bos_token_id", bos)
            eos = cfg.get("eos_token_id", eos)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return bos, eos


class IncrementalDecoder:
    """Turn a stream of token ids into text deltas (holds back incomplete UTF-8 sequences).

    Mutates its own buffer on :meth:`push`; cheap per call (decodes only a short tail).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # incomplete multi-byte character: wait for more ids
            return ""
        delta = text[len(self._emitted):] if text.startswith(self._emitted) else text
        self._emitted = text
        return delta


def load_tokenizer(model: str) -> Tokenizer:
    """``"tiny"`` → :class:`ByteTokenizer`; a folder with ``tokenizer.json`` → :class:`HFTokenizer`."""
    if model == "tiny":
        return ByteTokenizer()
    path = Path(model)
    if (path / "tokenizer.json").exists():
        return HFTokenizer(path / "tokenizer.json")
    if (path / "tandem_tiny.json").exists() or not path.exists():
        # a folder saved from the tiny model carries no tokenizer.json
        if path.exists():
            return ByteTokenizer()
        raise FileNotFoundError(f"model folder {model!r} does not exist")
    raise FileNotFoundError(f"{model!r} has no tokenizer.json")
