"""Tokenizers (shared by the router, which encodes prompts and decodes streams, and the worker,
which loads the model's): a byte-level one for the built-in tiny model and a wrapper over the Hugging Face
``tokenizers`` library for model folders with a ``tokenizer.json``.

Byte tokenizer id layout (vocabulary of 512 to match the tiny model):

    0 ........ 255 | 256  257  258 | 259 ...... 511
    one id a byte  | BOS  EOS  PAD | unused (decoded as nothing)

``load_tokenizer("tiny" | folder)`` picks one. ``StreamDecoder`` turns a growing id list into
text increments without ever emitting half of a UTF-8 character.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from services.common.errors import InvalidArgument, NotFound

# The byte layout of the built-in tiny model; its config (services/gpuworker/model/config.py)
# takes its vocabulary from here so the router and the worker cannot disagree.
TINY_BOS_ID = 256
TINY_EOS_ID = 257
TINY_PAD_ID = 258
TINY_VOCAB_SIZE = 512

# a folder whose model uses the byte tokenizer says so with this file: {"type": "byte"}
BYTE_TOKENIZER_MARKER = "tandem_tokenizer.json"


class Tokenizer(Protocol):
    """What the router and the worker need from a tokenizer."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    pad_token_id: int | None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus BOS/EOS/PAD. Stateless and deterministic."""

    def __init__(self) -> None:
        self.vocab_size = TINY_VOCAB_SIZE
        self.bos_token_id: int | None = TINY_BOS_ID
        self.eos_token_ids = frozenset({TINY_EOS_ID})
        self.pad_token_id: int | None = TINY_PAD_ID

    @property
    def eos_token_id(self) -> int:
        return TINY_EOS_ID

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes of ``text``, after BOS when ``add_special_tokens``."""
        if not isinstance(text, str):
            raise InvalidArgument("text must be a string")
        ids = list(text.encode("utf-8"))
        return [TINY_BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Bytes back to text (invalid UTF-8 becomes U+FFFD). Specials are dropped, or shown as
        ``<bos>``/``<eos>``/``<pad>`` when ``skip_special_tokens`` is False; unused ids vanish."""
        out = bytearray()
        parts: list[str] = []
        names = {TINY_BOS_ID: "<bos>", TINY_EOS_ID: "<eos>", TINY_PAD_ID: "<pad>"}
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise InvalidArgument(f"token id {i} outside the vocabulary of {self.vocab_size}")
            if i < 256:
                out.append(i)
            elif i in names and not skip_special_tokens:
                parts.append(out.decode("utf-8", errors="replace"))
                out.clear()
                parts.append(names[i])
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json``; BOS/EOS/PAD come from
    ``tokenizer_config.json``, ``generation_config.json`` and ``config.json`` when present."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as _Tok  # import here: the tiny path never needs it

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise NotFound(f"no tokenizer.json in {folder}")
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        tcfg = _read_json(folder / "tokenizer_config.json")
        gcfg = _read_json(folder / "generation_config.json")
        mcfg = _read_json(folder / "config.json")

        def token_id(value) -> int | None:
            if isinstance(value, dict):  # {"content": "<s>", ...}
                value = value.get("content")
            return self._tok.token_to_id(value) if isinstance(value, str) else None

        self.bos_token_id = token_id(tcfg.get("bos_token"))
        if self.bos_token_id is None:
            self.bos_token_id = gcfg.get("bos_token_id", mcfg.get("bos_token_id"))
        eos: set[int] = set()
        for src in (gcfg.get("eos_token_id"), mcfg.get("eos_token_id")):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, list):
                eos.update(int(x) for x in src)
        named = token_id(tcfg.get("eos_token"))
        if named is not None:
            eos.add(named)
        self.eos_token_ids = frozenset(eos)
        self.pad_token_id = token_id(tcfg.get("pad_token"))

    @property
    def eos_token_id(self) -> int | None:
        """The smallest end-of-sequence id (models may have several: see ``eos_token_ids``)."""
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids; ``add_special_tokens`` runs the tokenizer's post-processor (e.g. BOS)."""
        if not isinstance(text, str):
            raise InvalidArgument("text must be a string")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer for one stream: ``push(ids)`` returns the text added since the last
    push. Text ending in U+FFFD (an incomplete UTF-8 sequence) is held back until completed. Each
    push decodes only a short window (the previous push's ids plus the new ones), so merges and
    leading spaces render as in a full decode. Mutates its own cursor only."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids re-decoded for context only
        self._read = 0  # ids before this have been emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def push(self, ids: list[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        seen = self._decode(self._prefix, self._read)
        full = self._decode(self._prefix)
        if len(full) <= len(seen) or full.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(seen) :]

    def flush(self) -> str:
        """Whatever is still held back (e.g. a truncated character at the end of a stream)."""
        seen = self._decode(self._prefix, self._read)
        full = self._decode(self._prefix)
        self._prefix = self._read = len(self._ids)
        return full[len(seen) :]


def load_tokenizer(model_dir_or_tiny: str | Path, revision: str | None = None) -> Tokenizer:
    """``"tiny"`` / ``"demo"`` (byte-level built-ins) -> ``ByteTokenizer``; a folder (or a hub
    id at ``revision``, fetched into the hub cache) with ``tokenizer.json`` -> ``HFTokenizer``;
    one with a ``tandem_tokenizer.json`` marker ``{"type": "byte"}`` -> ``ByteTokenizer``. Raises
    ``NotFound`` otherwise, ``InvalidArgument`` for a revision of something not on the hub."""
    if str(model_dir_or_tiny) in ("tiny", "demo"):
        if revision:
            raise InvalidArgument(f"a revision applies to hub ids, and {model_dir_or_tiny} is built in")
        return ByteTokenizer()
    folder = Path(model_dir_or_tiny)
    if revision or not folder.is_dir():
        from services.common.hub import looks_like_hub_id, resolve

        if revision or looks_like_hub_id(str(model_dir_or_tiny)):
            folder = resolve(str(model_dir_or_tiny), revision, full=False).path
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder)
    marker = _read_json(folder / BYTE_TOKENIZER_MARKER)
    if marker.get("type") == "byte":
        return ByteTokenizer()
    raise NotFound(f"no tokenizer.json (or {BYTE_TOKENIZER_MARKER}) in {folder}")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {path.name}: {exc}") from exc
    return data if isinstance(data, dict) else {}
