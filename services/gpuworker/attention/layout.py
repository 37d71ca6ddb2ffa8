"""``BatchLayout``: one forward's requests as host integers, validated once, with numpy.

A layout is built for every forward (up to k+1 per speculative step) while the GPU waits, so its
validation must not loop over block ids in Python. The checks run on numpy arrays (a few C-level
calls per batch); the per-request loop of the original implementation runs only after a check has
failed, to name the first bad request with the same message as always.

Accepted inputs (lists are the engine's, arrays the cheap path):

    block_tables   list of per-request sequences (lists, tuples or 1-D integer arrays, ragged
                   allowed), or a 2-D integer array [B, pages] (every row full: capacity = pages)
    cached_lens    sequence of ints or 1-D integer array [B]
    query_lens     sequence of ints or 1-D integer array [B]

The validated arrays (``BatchLayout.arrays``) are what the planner reads, so a list-of-lists
table is converted to numpy exactly once per layout:

    block_tables [[7, 2, 9], [4]]  ->  tables [[7, 2, 9], [4, -1, -1]]   (-1: no page)
                                       widths [3, 1]                      (pages per request)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common.errors import InvalidArgument

INT32_MAX = 2**31 - 1  # plans stage ids and lengths as int32 (FlashInfer's index type)


@dataclass(frozen=True)
class LayoutArrays:
    """The validated layout as read-only int64 numpy arrays (B = requests, P = widest table).

    ``q``, ``cached``, ``kv`` (= cached + q), ``widths`` (pages per table): [B]. ``tables``:
    [B, max(P, 1)], rows padded with -1. ``uniform_q``: the common query length or None.
    """

    q: np.ndarray
    cached: np.ndarray
    kv: np.ndarray
    widths: np.ndarray
    tables: np.ndarray
    uniform_q: int | None
    num_tokens: int
    max_kv_len: int
    max_block_id: int  # -1 when every table is empty


@dataclass(frozen=True)
class BatchLayout:
    """One forward over a batch, in host integers (no device tensors).

    ``block_tables[r]``: the pages of request r in position order; reserved capacity of r is
    ``len(block_tables[r]) * block_size``. ``cached_lens[r]``: logical KV length before this
    forward (positions ``0..cached-1`` already hold KV). ``query_lens[r]``: tokens fed now, written
    at positions ``cached .. cached+q-1``. Tokens of the forward are request-major: request 0's
    q tokens first, then request 1's, ...

    Construction checks shapes, types and signs (``InvalidArgument``) and keeps the checked
    arrays (``arrays``); it keeps references to its inputs, which must not change until the
    layout has been planned. The capacity check needs the block size and happens in
    ``AttentionBackend.plan``.
    """

    block_tables: Any
    cached_lens: Any
    query_lens: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "_arrays", _validate(self.block_tables, self.cached_lens, self.query_lens))

    @property
    def arrays(self) -> LayoutArrays:
        """The validated arrays (read-only; shared with every plan of this layout)."""
        return self._arrays  # type: ignore[attr-defined]

    @property
    def batch_size(self) -> int:
        return len(self._arrays.q)  # type: ignore[attr-defined]

    @property
    def num_tokens(self) -> int:
        return self._arrays.num_tokens  # type: ignore[attr-defined]

    @property
    def kv_lens(self) -> list[int]:
        """Logical KV length after this forward, per request."""
        return self._arrays.kv.tolist()  # type: ignore[attr-defined]

    def capacities(self, block_size: int) -> list[int]:
        return (self._arrays.widths * block_size).tolist()  # type: ignore[attr-defined]

    def shifted(self, cached_delta: int, query_len: int) -> "BatchLayout":
        """The same requests and tables, every cached length moved by ``cached_delta`` and every
        query length ``query_len``: a speculative step's draft-chain positions beside its verify.
        The tables are shared, not converted or checked again. Pure."""
        a = self._arrays  # type: ignore[attr-defined]
        if not _is_int(cached_delta) or not _is_int(query_len) or query_len < 1:
            raise InvalidArgument(f"shifted() needs integers and query_len >= 1, got {cached_delta!r}, {query_len!r}")
        cached = a.cached + cached_delta
        if int(cached.min()) < 0:
            raise InvalidArgument(f"request {int(np.argmin(cached))}: cached_len must be >= 0 after a shift of {cached_delta}")
        q = np.full(len(cached), query_len, dtype=np.int64)
        return _derived(a.tables, a.widths, cached, q, a.max_block_id)

    def with_cached_lens(self, cached_lens: np.ndarray) -> "BatchLayout":
        """The same requests, tables and query lengths over new cached lengths (an int64 array
        [B], each >= 0): the next speculative step of an unchanged batch, whose tables need no
        conversion or check again. Pure."""
        a = self._arrays  # type: ignore[attr-defined]
        if (not isinstance(cached_lens, np.ndarray) or cached_lens.dtype != np.int64
                or cached_lens.shape != a.cached.shape):
            raise InvalidArgument(f"with_cached_lens() needs an int64 array of shape {a.cached.shape}")
        if len(cached_lens) and int(cached_lens.min()) < 0:
            raise InvalidArgument(f"request {int(np.argmin(cached_lens))}: cached_len must be >= 0")
        return _derived(a.tables, a.widths, cached_lens.copy(), a.q, a.max_block_id)  # ours: flags, no aliasing

    def padded(self, extra: int, block: int, query_len: int) -> "BatchLayout":
        """This layout plus ``extra`` requests of one page (``block``), nothing cached and
        ``query_len`` tokens each: a graph bucket's padding rows. Pure."""
        a = self._arrays  # type: ignore[attr-defined]
        if (not _is_int(extra) or extra < 0 or not _is_int(block) or not 0 <= block <= INT32_MAX
                or not _is_int(query_len) or query_len < 1):
            raise InvalidArgument(f"padded() needs extra >= 0, a block id and query_len >= 1, got {extra!r}, {block!r}, {query_len!r}")
        n = len(a.q)
        tables = np.full((n + extra, a.tables.shape[1]), -1, dtype=np.int64)
        tables[:n] = a.tables
        tables[n:, 0] = block
        widths = np.concatenate([a.widths, np.ones(extra, dtype=np.int64)])
        cached = np.concatenate([a.cached, np.zeros(extra, dtype=np.int64)])
        q = np.concatenate([a.q, np.full(extra, query_len, dtype=np.int64)])
        return _derived(tables, widths, cached, q, max(a.max_block_id, block) if extra else a.max_block_id)


# -- validation ------------------------------------------------------------------------------


def _validate(tables: Any, cached: Any, query: Any) -> LayoutArrays:
    try:
        n, n_tables, n_cached = len(query), len(tables), len(cached)
    except TypeError:
        raise InvalidArgument("block_tables, cached_lens and query_lens must be sequences") from None
    if n == 0:
        raise InvalidArgument("a batch needs at least one request")
    if n_tables != n or n_cached != n:
        raise InvalidArgument(
            f"block_tables ({n_tables}), cached_lens ({n_cached}) and query_lens ({n}) must have "
            "one entry per request"
        )
    q = _int_vector(query, n)
    c = _int_vector(cached, n)
    table = _table_matrix(tables, n)
    q_min = q_max = c_min = 0
    if q is not None and c is not None:
        q_min, q_max, c_min = int(q.min()), int(q.max()), int(c.min())
    if table is None or q_min < 1 or c_min < 0 or table[2] < 0:
        _raise_first_problem(tables, cached, query)
        raise InvalidArgument(  # only values numpy could not hold as integers get here
            "block_tables, cached_lens and query_lens must hold integers (lists or integer arrays)"
        )
    matrix, widths, _, max_id = table
    if q_max > INT32_MAX or int(c.max()) > INT32_MAX or max_id > INT32_MAX:
        raise InvalidArgument("lengths and block ids must be below 2**31 (int32 plans)")
    return _arrays_of(matrix, widths, c, q, max_id, q_min, q_max)


def _arrays_of(tables: np.ndarray, widths: np.ndarray, cached: np.ndarray, q: np.ndarray, max_id: int,
               q_min: int, q_max: int) -> LayoutArrays:
    """The checked arrays of a layout whose ids, widths and lengths are known good; only the KV
    lengths' int32 bound is left to check. Makes the arrays read-only: they are shared by every
    plan of the layout (views of caller arrays too)."""
    kv = cached + q
    max_kv = int(kv.max())
    if max_kv > INT32_MAX:
        r = int(np.argmax(kv))
        raise InvalidArgument(f"request {r}: kv_len {max_kv} must be below 2**31 (int32 plans)")
    uniform = q_min == q_max
    arrays = LayoutArrays(q=q, cached=cached, kv=kv, widths=widths, tables=tables,
                          uniform_q=q_min if uniform else None,
                          num_tokens=q_min * len(q) if uniform else int(q.sum()),
                          max_kv_len=max_kv, max_block_id=max_id)
    for a in (q, cached, kv, widths, tables):
        a.flags.writeable = False
    return arrays


def _derived(tables: np.ndarray, widths: np.ndarray, cached: np.ndarray, q: np.ndarray, max_id: int) -> BatchLayout:
    """A layout from arrays that an already validated layout holds (tables, widths) or that its
    derivation just made (non-negative lengths): only the length bounds are checked."""
    arrays = _arrays_of(tables, widths, cached, q, max_id, int(q.min()), int(q.max()))
    layout = object.__new__(BatchLayout)
    for name, value in (("block_tables", _TableRows(tables, widths)), ("cached_lens", cached), ("query_lens", q),
                        ("_arrays", arrays)):
        object.__setattr__(layout, name, value)
    return layout


class _TableRows:
    """A derived layout's ``block_tables``: each request's pages (its padded row cut to its width),
    made only when read (the planner reads ``arrays``; tests and error paths read rows)."""

    __slots__ = ("_tables", "_widths")

    def __init__(self, tables: np.ndarray, widths: np.ndarray):
        self._tables, self._widths = tables, widths

    def __len__(self) -> int:
        return len(self._widths)

    def __getitem__(self, r: int) -> np.ndarray:
        return self._tables[r, : self._widths[r]]

    def __iter__(self):
        return (self._tables[r, :w] for r, w in enumerate(self._widths.tolist()))


def _int_vector(values: Any, n: int) -> np.ndarray | None:
    """``values`` as an int64 array [n], or None when it is not a flat sequence of integers."""
    try:
        a = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        return None
    if a.shape != (n,) or a.dtype.kind not in "iu" or (a.dtype.kind == "u" and a.max() > INT32_MAX):
        return None
    return a.astype(np.int64, copy=False).view()  # own array object: flags set below stay ours


def _table_matrix(tables: Any, n: int) -> tuple[np.ndarray, np.ndarray, int, int] | None:
    """(tables [n, max(P, 1)] padded with -1, widths [n], smallest id, largest id), or None when
    ``tables`` does not hold integers. Lists are converted in one C-level pass with numpy's type
    inference, so a float or a string is caught (an int64 conversion would silently cast it)."""
    if isinstance(tables, np.ndarray) and tables.ndim == 2:
        if tables.dtype.kind not in "iu" or tables.shape[0] != n:
            return None
        if tables.shape[1] == 0:
            return _all_empty(n)
        m = tables.astype(np.int64, copy=False).view()
        if tables.dtype.kind == "u" and tables.max() > INT32_MAX:
            return None
        return m, np.full(n, tables.shape[1], dtype=np.int64), int(m.min()), int(m.max())
    try:
        sizes = list(map(len, tables))  # Python ints: cheaper than numpy reductions at small B
    except TypeError:  # a request's table is not a sequence
        return None
    P, total = max(sizes), sum(sizes)
    if total == 0:
        return _all_empty(n)
    widths = np.array(sizes, dtype=np.int64)
    try:
        if min(sizes) == P:  # rectangular: one conversion, rows and all
            flat = np.array(tables)
            if flat.shape != (n, P):
                return None
        elif all(isinstance(t, np.ndarray) for t in tables):
            flat = np.concatenate(tables)
        else:
            flat = np.array(list(itertools.chain.from_iterable(tables)))
    except (TypeError, ValueError, OverflowError):
        return None
    if flat.dtype.kind not in "iu" or flat.size != total or (flat.dtype.kind == "u" and flat.max() > INT32_MAX):
        return None
    flat = flat.astype(np.int64, copy=False).view()
    lo, hi = int(flat.min()), int(flat.max())
    if flat.ndim == 2:
        return flat, widths, lo, hi
    if flat.ndim != 1:
        return None
    matrix = np.full((n, P), -1, dtype=np.int64)
    matrix[np.arange(P) < widths[:, None]] = flat  # row-major mask order = concatenation order
    return matrix, widths, lo, hi


def _all_empty(n: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    return np.full((n, 1), -1, dtype=np.int64), np.zeros(n, dtype=np.int64), 0, -1


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _raise_first_problem(tables: Any, cached: Any, query: Any) -> None:
    """The per-request checks, in request order: raise for the first bad entry (slow; runs only
    after a vectorized check failed, so the message names the request as it always did)."""
    for r, (table, c, q) in enumerate(zip(tables, cached, query)):
        c, q = (v.item() if isinstance(v, np.generic) else v for v in (c, q))  # "0", not "np.int64(0)"
        if not _is_int(q) or q < 1:
            raise InvalidArgument(f"request {r}: query_len must be >= 1, got {q!r}")
        if not _is_int(c) or c < 0:
            raise InvalidArgument(f"request {r}: cached_len must be >= 0, got {c!r}")
        try:
            bad = any(not _is_int(b) or b < 0 for b in table)
        except TypeError:  # not iterable
            bad = True
        if bad:
            raise InvalidArgument(f"request {r}: block ids must be non-negative integers")


__all__ = ["BatchLayout", "LayoutArrays", "INT32_MAX"]
