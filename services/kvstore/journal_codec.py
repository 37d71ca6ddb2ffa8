"""Journal entries as compact bytes: the verb's arguments as packed integers, length-prefixed
UTF-8 strings and raw bytes (token ids packed little-endian, as narrow as the largest id
allows), and its outcome digest as packed integers. No pickle on the hot verbs: pickling the
argument dict cost more per verb than the core's own bookkeeping (docs/benchmarks.md, issue 10,
third pass).

Layout of an entry (little-endian)::

    B  VERSION        bumped when the layout or a verb's fields change meaning
    B  verb code      ``CODES``; PICKLED = the generic form below
    d  clock reading  journal time of the transaction
    H  n_ints  H n_texts  H n_blobs  H n_digest
    n_ints   x q      the verb's integer fields, in ``_SCHEMAS`` order (NONE_INT = None)
    n_texts  x H      byte lengths of its strings (NONE_TEXT = None)
    n_blobs  x I      byte lengths of its byte strings
    n_digest x q      the outcome digest (``outcome``)
    strings, then byte strings

A token list is written as one byte of width (2, 3 or 4) and each id in that many bytes,
little-endian (an empty list as nothing): a Reserve's prompt is most of the bytes Redis stores,
copies and logs, and both sides' cost per batch grows with them (docs/benchmarks.md, issue 10,
fourth pass). Version 2 wrote every id in 4 bytes; its entries still decode.

Extend/Trim items and Reserve-first candidates add one string and their integers per element;
a Reserve's entry ends its strings with the id it handed out (replay hands the core that id).
``register_worker`` and ``restore_worker`` (rare, nested values), and any call whose values are
not of the plain types above (a direct caller's numpy integer, a bytearray salt), are written in
the generic form: the header's first three fields, then a pickle of (keyword arguments, digest,
reservation id). Either way ``decode`` gives back keyword arguments that make the core do
exactly what it did, and the digest to compare with the replayed outcome.

Plain synchronous functions, no I/O.
"""

from __future__ import annotations

import inspect
import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from services.common.errors import TandemError

from .keys import token_array
from .store import KVStore
from .types import ExtendItem, PublishResult, ReleaseResult, Reservation, RestoreResult, TrimItem, WorkerInfo

VERSION = 3
_VERSIONS = (2, 3)  # what decode reads: 2 = token ids always 4 bytes wide
PICKLE_PROTOCOL = 5
PICKLED = 255
NONE_INT = -(1 << 63)  # an optional integer that was None (a real value this low goes generic)
NONE_TEXT = 0xFFFF  # an optional string that was None
_INT_MAX = (1 << 63) - 1

VERBS = ("expire", "register_worker", "restore_worker", "heartbeat", "reserve", "reserve_first", "extend", "trim",
         "publish", "release", "suspend", "abort")
CODES = {verb: code for code, verb in enumerate(VERBS)}

# Per verb: (integer fields, string fields, byte-string fields); optional ones may be None.
_SCHEMAS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "expire": ((), (), ()),
    "heartbeat": (("incarnation",), ("worker_id",), ()),
    "reserve": (("incarnation", "headroom_positions"), ("worker_id", "request_id"), ("tokens", "cache_salt")),
    "reserve_first": (("headroom_positions",), ("request_id",), ("tokens", "cache_salt")),
    "extend": ((), ("worker_id",), ()),
    "trim": ((), ("worker_id",), ()),
    "publish": (("incarnation", "final_positions", "known_tokens"), ("reservation_id", "worker_id"), ("new_tokens",)),
    "release": (("incarnation", "final_positions"), ("reservation_id", "worker_id"), ("new_tokens",)),
    "suspend": (("incarnation", "final_positions"), ("reservation_id", "worker_id"), ("new_tokens",)),
    "abort": (("incarnation",), ("reservation_id", "worker_id"), ()),
}
_TOKEN_FIELDS = frozenset({"tokens", "new_tokens"})
_U8, _U16, _U32 = np.dtype("u1"), np.dtype("<u2"), np.dtype("<u4")
_nonzero = np.count_nonzero
_ITEM_TYPES = {"extend": ExtendItem, "trim": TrimItem}
_HEAD = struct.Struct("<BBd")
_COUNTS = struct.Struct("<HHHH")
_BODIES: dict[tuple[int, int, int, int], struct.Struct] = {}

# Each verb's parameter names and defaults, from the core's own signatures: positional
# arguments are bound to their names, and a field left out is written as its default.
_PARAMS: dict[str, tuple[str, ...]] = {}
_DEFAULTS: dict[str, dict[str, Any]] = {}
for _verb in VERBS[1:]:
    _sig = inspect.signature(getattr(KVStore, _verb))
    _names = tuple(n for n in _sig.parameters if n != "self")
    _PARAMS[_verb] = _names
    _DEFAULTS[_verb] = {n: p.default for n, p in _sig.parameters.items()
                        if n != "self" and p.default is not inspect.Parameter.empty}


class EntryError(ValueError):
    """Bytes that are no journal entry of this version (a corrupted or foreign journal)."""


def bind(verb: str, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (positional ones bound to the core's parameter names)."""
    if not args:
        return kwargs
    return {**dict(zip(_PARAMS[verb], args)), **kwargs}


# ---------------------------------------------------------------------------------- outcomes
def outcome(result: Any) -> tuple:
    """A compact, deterministic summary of what a verb answered (compared on replay): cheap to
    compute on every transaction, yet any divergence of tables, counts or ids shows in it.
    Integers only for the hot verbs, so it packs as such."""
    t = type(result)
    if t is Reservation:
        bt = result.block_table
        return (len(bt), bt[-1] if bt else -1, result.published_blocks, result.num_tokens)
    if t is PublishResult:
        r = result.reservation
        bt = r.block_table
        return (len(bt), bt[-1] if bt else -1, r.published_blocks, result.newly_published, result.deduplicated)
    if t is ReleaseResult:
        return (result.newly_published, result.deduplicated, result.freed_blocks, result.unpinned_blocks)
    if t is list:  # Extend / Trim items
        out: list[int] = []
        for r in result:
            bt = r.block_table
            out += (r.error is None, len(bt), bt[-1] if bt else -1)
        return tuple(out)
    if t is bool:  # Abort
        return (int(result),)
    if t is WorkerInfo:
        return (result.incarnation, result.pool)
    if t is RestoreResult:
        return (result.worker.incarnation, result.worker.pool, tuple(outcome(r) for r in result.restored),
                result.dropped, result.cached_blocks)
    return ()  # Heartbeat: the configured lease, nothing the call decided


def reservation_id(result: Any) -> str | None:
    """The id a Reserve handed out (None for other verbs)."""
    return result.reservation_id if type(result) is Reservation else None


# ---------------------------------------------------------------------------------- encode
class _Generic(Exception):
    """A value the compact form does not carry exactly: write the generic form."""


def _int(value: Any) -> int:
    if type(value) is int and NONE_INT < value <= _INT_MAX:
        return value
    if value is None:
        return NONE_INT
    raise _Generic


def _text(value: Any) -> bytes | None:
    if type(value) is str:
        raw = value.encode("utf-8", "surrogatepass")
        if len(raw) < NONE_TEXT:
            return raw
    if value is None:
        return None
    raise _Generic


def _blob(name: str, value: Any) -> bytes:
    if name in _TOKEN_FIELDS:
        return _tokens(value)
    if type(value) is bytes:
        return value
    raise _Generic


def _tokens(value: Any) -> bytes:
    """Token ids as the core read them, narrowed: a width byte, then each id little-endian in
    2, 3 or 4 bytes (the fewest its largest id fits); nothing for none."""
    if (type(value) is bytes or type(value) is tuple or type(value) is list) and not value:
        return b""
    try:
        ids = token_array(value)
    except TandemError:
        raise _Generic from None
    if not ids.size:
        return b""
    ids = np.ascontiguousarray(ids, _U32)
    # the high halves / high bytes all zero? (count_nonzero: a third of what max() costs here)
    if not _nonzero(ids.view(_U16)[1::2]):
        return b"\x02" + ids.astype(_U16).tobytes()
    if not _nonzero(ids.view(_U8)[3::4]):
        return b"\x03" + ids.view(_U8).reshape(-1, 4)[:, :3].tobytes()
    return b"\x04" + ids.tobytes()


def _untokens(blob: bytes) -> bytes:
    """Packed little-endian uint32 ids (what the core reads) of a ``_tokens`` blob."""
    if not blob:
        return b""
    width, n = blob[0], len(blob) - 1
    if width == 4 and n % 4 == 0:
        return blob[1:]
    if width == 2 and n % 2 == 0:
        return np.frombuffer(blob, _U16, offset=1).astype(_U32).tobytes()
    if width == 3 and n % 3 == 0:
        out = np.zeros((n // 3, 4), _U8)
        out[:, :3] = np.frombuffer(blob, _U8, offset=1).reshape(-1, 3)
        return out.tobytes()
    raise EntryError(f"token ids of width {width} in {n} bytes")


def encode(verb: str, now: float, kw: dict, result: Any) -> bytes:
    """The entry for ``verb`` called with ``kw`` (``bind``) at journal time ``now``, which
    answered ``result``."""
    fast = _FAST.get(verb)
    if fast is not None:
        try:
            return fast(now, kw, result)
        except (_Generic, struct.error, TypeError):
            pass
    schema = _SCHEMAS.get(verb)
    digest = outcome(result)
    if schema is not None:
        try:
            return _compact(verb, now, kw, schema, digest, result)
        except _Generic:
            pass
    return _HEAD.pack(VERSION, PICKLED, now) + pickle.dumps(
        (verb, _portable(kw), digest, reservation_id(result)), protocol=PICKLE_PROTOCOL)


def _compact(verb: str, now: float, kw: dict, schema, digest: tuple, result: Any) -> bytes:
    int_names, text_names, blob_names = schema
    defaults = _DEFAULTS.get(verb, {})
    ints = [_int(kw[n] if n in kw else defaults[n]) for n in int_names]
    texts = [_text(kw[n] if n in kw else defaults[n]) for n in text_names]
    blobs = [_blob(n, kw[n] if n in kw else defaults[n]) for n in blob_names]
    if verb == "extend" or verb == "trim":
        kind = _ITEM_TYPES[verb]
        for item in kw["items"]:
            if type(item) is not kind:
                raise _Generic
            texts.append(_text(item.reservation_id))
            ints += (_int(item.incarnation), _int(item.capacity_positions))
    elif verb == "reserve_first":
        for pair in kw["candidates"]:
            if type(pair) is not tuple or len(pair) != 2:
                raise _Generic
            texts.append(_text(pair[0]))
            ints.append(_int(pair[1]))
    if type(result) is Reservation:
        texts.append(_text(result.reservation_id))
    shape = (len(ints), len(texts), len(blobs), len(digest))
    body = _BODIES.get(shape) or _body(shape)
    try:
        return b"".join((
            body.pack(VERSION, CODES[verb], now, *shape, *ints,
                      *(NONE_TEXT if t is None else len(t) for t in texts), *map(len, blobs), *digest),
            *(t for t in texts if t), *blobs))
    except struct.error:
        raise _Generic from None


def _body(shape: tuple[int, int, int, int]) -> struct.Struct:
    body = struct.Struct("<BBdHHHH%dq%dH%dI%dq" % shape)
    if len(_BODIES) < 4096:  # Extend/Trim of every item count: bounded
        _BODIES[shape] = body
    return body


# The verbs of every request, written out straight (the loops of ``_compact`` cost as much as
# the pickle they replace); the same bytes as ``_compact`` gives (a test checks).
_PUBLISH = _body((3, 2, 1, 5))
_END = _body((2, 2, 1, 4))
_RESERVE = _body((2, 3, 2, 4))
_PUBLISH_KNOWN = _DEFAULTS["publish"]["known_tokens"]
_END_FINAL = _DEFAULTS["release"]["final_positions"]  # Suspend's too (a test checks)
_RESERVE_HEADROOM = _DEFAULTS["reserve"]["headroom_positions"]
_RESERVE_SALT = _DEFAULTS["reserve"]["cache_salt"]
_PUBLISH_CODE, _RESERVE_CODE = CODES["publish"], CODES["reserve"]


def _publish(now: float, kw: dict, result: Any) -> bytes:
    inc, final, known = kw["incarnation"], kw["final_positions"], kw.get("known_tokens", _PUBLISH_KNOWN)
    if type(inc) is not int or type(final) is not int or type(known) is not int or NONE_INT in (inc, final, known):
        raise _Generic
    rid = _text(kw["reservation_id"])
    wid = _text(kw.get("worker_id"))
    tokens = _tokens(kw.get("new_tokens", b""))
    r = result.reservation
    bt = r.block_table
    return b"".join((_PUBLISH.pack(VERSION, _PUBLISH_CODE, now, 3, 2, 1, 5, inc, final, known, len(rid),
                                   NONE_TEXT if wid is None else len(wid), len(tokens), len(bt), bt[-1] if bt else -1,
                                   r.published_blocks, result.newly_published, result.deduplicated),
                     rid, wid or b"", tokens))


def _end(code: int):
    def enc(now: float, kw: dict, result: Any) -> bytes:
        inc, final = kw["incarnation"], kw.get("final_positions", _END_FINAL)
        if type(inc) is not int or inc == NONE_INT:
            raise _Generic
        if final is None:
            final = NONE_INT
        elif type(final) is not int or final == NONE_INT:
            raise _Generic
        rid = _text(kw["reservation_id"])
        wid = _text(kw.get("worker_id"))
        tokens = _tokens(kw.get("new_tokens", b""))
        return b"".join((_END.pack(VERSION, code, now, 2, 2, 1, 4, inc, final, len(rid),
                                   NONE_TEXT if wid is None else len(wid), len(tokens), result.newly_published,
                                   result.deduplicated, result.freed_blocks, result.unpinned_blocks),
                         rid, wid or b"", tokens))
    return enc


def _reserve(now: float, kw: dict, result: Any) -> bytes:
    inc, headroom = kw["incarnation"], kw.get("headroom_positions", _RESERVE_HEADROOM)
    if type(inc) is not int or type(headroom) is not int or NONE_INT in (inc, headroom):
        raise _Generic
    wid, req, rid = _text(kw["worker_id"]), _text(kw["request_id"]), _text(result.reservation_id)
    tokens, salt = _tokens(kw["tokens"]), kw.get("cache_salt", _RESERVE_SALT)
    if type(salt) is not bytes or wid is None or req is None:
        raise _Generic
    bt = result.block_table
    return b"".join((_RESERVE.pack(VERSION, _RESERVE_CODE, now, 2, 3, 2, 4, inc, headroom, len(wid), len(req), len(rid),
                                   len(tokens), len(salt), len(bt), bt[-1] if bt else -1, result.published_blocks,
                                   result.num_tokens),
                     wid, req, rid, tokens, salt))


_FAST = {
    "reserve": _reserve,
    "publish": _publish,
    "release": _end(CODES["release"]),
    "suspend": _end(CODES["suspend"]),
}


def encoder(verb: str) -> Callable[[float, dict, Any], bytes]:
    """``encode`` for one verb with its dispatch resolved once (the journal's per-verb methods
    call it on every transaction)."""
    fast = _FAST.get(verb)
    if fast is None:
        return lambda now, kw, result: encode(verb, now, kw, result)

    def enc(now: float, kw: dict, result: Any) -> bytes:
        try:
            return fast(now, kw, result)
        except (_Generic, struct.error, TypeError):
            return encode(verb, now, kw, result)  # values the straight-line encoder does not carry
    return enc


def _portable(kw: dict) -> dict:
    """Arguments as plain picklable values (token arrays as packed bytes, iterables as lists)."""
    out = dict(kw)
    for name in _TOKEN_FIELDS:
        value = out.get(name)
        if isinstance(value, np.ndarray):
            out[name] = token_array(value).tobytes()
    for name in ("items", "candidates", "reservations", "cached"):
        if name in out:
            out[name] = list(out[name])
    return out


# ---------------------------------------------------------------------------------- decode
def decode(raw: bytes) -> tuple[str, float, dict | None, tuple, str | None]:
    """(verb, journal time, keyword arguments, outcome digest, reservation id handed out) of an
    entry; the arguments are None for ``expire``. EntryError for bytes of another version."""
    try:
        version, code, now = _HEAD.unpack_from(raw)
    except struct.error:
        raise EntryError(f"a journal entry of {len(raw)} bytes is too short") from None
    if version not in _VERSIONS:
        raise EntryError(f"journal entry version {version}, this kvstore reads {', '.join(map(str, _VERSIONS))}")
    if code == PICKLED:
        verb, kw, digest, rid = pickle.loads(raw[_HEAD.size:])
        return verb, now, kw, digest, rid
    try:
        verb = VERBS[code]
        shape = _COUNTS.unpack_from(raw, _HEAD.size)
        body = _BODIES.get(shape) or _body(shape)
        values = body.unpack_from(raw)
    except (IndexError, struct.error):
        raise EntryError("a malformed journal entry") from None
    ni, nt, nb, nd = shape
    at = 7
    ints = values[at:at + ni]
    at += ni
    text_lens = values[at:at + nt]
    at += nt
    blob_lens = values[at:at + nb]
    digest = values[at + nb:]
    pos = body.size
    texts: list[str | None] = []
    for n in text_lens:
        if n == NONE_TEXT:
            texts.append(None)
        else:
            texts.append(raw[pos:pos + n].decode("utf-8", "surrogatepass"))
            pos += n
    blobs = []
    for n in blob_lens:
        blobs.append(raw[pos:pos + n])
        pos += n
    if pos != len(raw):
        raise EntryError("a journal entry's lengths do not add up")
    if verb == "expire":
        return verb, now, None, digest, None
    int_names, text_names, blob_names = _SCHEMAS[verb]
    rid = texts.pop() if verb in ("reserve", "reserve_first") else None
    kw = dict(zip(text_names, texts))
    kw.update(zip(blob_names, blobs))
    if version != 2:
        for name in _TOKEN_FIELDS.intersection(blob_names):
            kw[name] = _untokens(kw[name])
    ints = [None if v == NONE_INT else v for v in ints]
    if verb == "extend" or verb == "trim":
        kind = _ITEM_TYPES[verb]
        kw["items"] = [kind(texts[1 + i], ints[2 * i], ints[2 * i + 1]) for i in range(len(texts) - 1)]
    else:
        kw.update(zip(int_names, ints))
        if verb == "reserve_first":
            kw["candidates"] = list(zip(texts[1:], ints[len(int_names):]))
    return verb, now, kw, digest, rid
