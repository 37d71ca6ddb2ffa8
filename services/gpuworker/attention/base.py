"""The attention-backend interface: describe a batch, plan it once, run it per layer.

A forward over a batch of requests goes through three calls per step:

    plan = backend.plan(layout, kind)               # once per forward (host work, device tensors)
    backend.write_kv(plan, kv_layer, k, v)          # per layer: store this step's K/V in the pages
    out  = backend.attend(plan, q, kv_layer, scale=...)   # per layer: causal paged attention

Logical length vs reserved capacity (the bug class this interface exists to rule out):

    block table  [ 7 ][ 2 ][ 9 ]            block_size = 4  -> capacity 12 positions
    positions     0123 4567 89ab
                  ccccc qqq .             c = cached (KV already there), q = written now
                  |cached=5| q=3|         kv_len = cached + q = 8 <= capacity (12)

Positions ``cached .. cached+q-1`` are written by this forward and attended causally; pages past
``ceil(kv_len / block_size)`` are reserved headroom that no kernel reads. A layout whose ``kv_len``
exceeds its capacity is rejected with ``InvalidArgument`` before anything touches the pools, so
speculative tokens can never overrun what the kvstore reserved.

``BatchLayout`` (module ``layout``) validates the host integers once, with numpy, and keeps them
as arrays; the planner here turns those arrays into the plan's tensors without a Python loop over
requests or tokens.

Plans are cached per ``(kind, batch size, query length, lane)``: the backend keeps one *workspace*
(device buffers, FlashInfer wrappers, ...) per key and re-plans it in place. ``lane`` (0 unless
asked) keeps several live plans of one shape apart: a captured speculative step holds a plan per
draft-chain position, all made before the one launch that reads them. A plan therefore stays
valid until the next ``plan()`` call with the same key; using a plan after that raises
``FailedPrecondition`` instead of silently reading another batch's metadata. One plan can serve any
number of forwards before that, e.g. the target and a draft module over the same positions (they
share the attention geometry).
"""

from __future__ import annotations

import abc
import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.common.errors import FailedPrecondition, InvalidArgument
from services.gpuworker.attention.layout import BatchLayout
from services.gpuworker.staging import copy_into

MAX_LANES = 64  # workspaces of one (kind, batch, q); a speculative step uses k of them


class AttentionKind(enum.Enum):
    """Which kernel family a batch needs.

    * ``DECODE``: every request feeds exactly one query token.
    * ``VERIFY``: every request feeds the same number ``q > 1`` of query tokens (multi-token decode:
      last accepted token + k draft tokens). Only chosen when the caller asks for it.
    * ``PREFILL``: anything else (ragged query lengths, prompt chunks).
    """

    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass(frozen=True)
class AttentionGeometry:
    """Shape facts every plan needs (FlashInfer plans against them). Target and draft layers of
    one model share one geometry, so one plan serves both pools."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32  # dtype of q and of the KV pools

    def __post_init__(self) -> None:
        for name in ("num_qo_heads", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"num_qo_heads ({self.num_qo_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )


@dataclass
class AttentionPlan:
    """Everything the per-layer calls need, on the backend's device. Read-only for callers.

    Tensors (T = tokens of the forward, B = requests):

    * ``positions`` int64 [T]: absolute position of each token (RoPE uses it).
    * ``slot_mapping`` int64 [T]: ``page * block_size + offset`` where each token's KV goes.
    * ``batch_indices`` int32 [T]: which request each token belongs to.
    * ``qo_indptr`` int32 [B+1]: token ranges per request.
    * ``kv_lens`` int32 [B]: logical KV length after this forward.
    * ``kv_page_indptr`` int32 [B+1], ``kv_page_indices`` int32 [nnz], ``kv_last_page_len``
      int32 [B]: the pages that hold positions ``0..kv_len-1`` (CSR, FlashInfer's layout); reserved
      headroom pages past them are left out.
    * ``block_tables`` int32 [B, max_pages]: full tables padded with -1 (capacity included).
    * ``k_rows``, ``v_rows`` int64 [T]: where each token's K and V go in the flat pool view
      ``kv_layer.view(-1, kv_heads, head_dim)`` (one index_copy per layer, no 3-D indexing):

          page p:  [ K: rows p*2bs .. p*2bs+bs-1 ][ V: rows p*2bs+bs .. p*2bs+2bs-1 ]
          slot s = p*bs + o   ->   K row  s + p*bs,   V row  s + p*bs + bs

    Host ints: ``num_tokens``, ``batch_size``, ``query_len`` (uniform length or None),
    ``max_query_len``, ``max_kv_len``, ``max_block_id``. ``host`` holds numpy copies of the
    metadata that host-side planners (FlashInfer's ``plan``) read: ``qo_indptr``, ``kv_lens``,
    ``kv_page_indptr``, ``kv_last_page_len`` (int32) and ``used_pages`` (int64, pages per request
    that hold logical KV). ``extras`` holds backend-private state.
    """

    layout: BatchLayout
    kind: AttentionKind
    geometry: AttentionGeometry
    key: tuple
    generation: int
    num_tokens: int
    batch_size: int
    query_len: int | None
    max_query_len: int
    max_kv_len: int
    max_block_id: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    batch_indices: torch.Tensor
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    kv_page_indptr: torch.Tensor
    kv_page_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    block_tables: torch.Tensor
    k_rows: torch.Tensor
    v_rows: torch.Tensor
    host: dict[str, np.ndarray] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    owner: int = 0  # id() of the backend that planned it: plans do not travel between backends


@dataclass
class PlanCacheStats:
    """How often ``plan()`` found a workspace for its key (hits) or had to make one (misses)."""

    hits: int = 0
    misses: int = 0


class Workspace:
    """Reusable per-key state of a backend: named device buffers that grow but are never shrunk,
    plus whatever a backend hangs on it (``self.state``). Mutated by every re-plan of its key."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        self.state: dict[str, Any] = {}

    def stage(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """Copy a host tensor into buffer ``name`` (grown when too small); return the filled view.

        Reusing the same storage keeps device addresses stable across re-plans (what CUDA graphs
        and FlashInfer wrappers want)."""
        flat = host if host.dim() == 1 else host.reshape(-1)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != host.dtype or buf.numel() < flat.numel():
            size = max(flat.numel(), 1 if buf is None else 2 * buf.numel())
            buf = torch.empty(size, dtype=host.dtype, device=self.device)
            self.buffers[name] = buf
        view = buf[: flat.numel()] if buf.numel() != flat.numel() else buf
        copy_into(view, flat)  # through pinned memory: a pageable copy would wait for the device
        return view if host.dim() == 1 else view.view(host.shape)


class AttentionBackend(abc.ABC):
    """Plans batches and runs paged attention for one geometry on one device.

    Subclasses implement ``_new_workspace`` (optional), ``_finish_plan`` (optional, backend-private
    planning such as FlashInfer ``wrapper.plan``), ``_write_kv`` and ``_attend``. The public methods
    here validate and enforce plan freshness so every backend rejects the same mistakes.
    """

    name: str = "abstract"

    def __init__(self, device: torch.device | str, geometry: AttentionGeometry):
        self.device = torch.device(device)
        self.geometry = geometry
        self.stats = PlanCacheStats()
        self._workspaces: dict[tuple, Workspace] = {}
        self._generations: dict[tuple, int] = {}

    # -- planning ---------------------------------------------------------------------------

    def plan(self, layout: BatchLayout, kind: AttentionKind | None = None, lane: int = 0) -> AttentionPlan:
        """Validate ``layout`` and build its plan. Mutates the workspace cached for the plan's key
        (so older plans with that key become stale). ``kind=None`` infers DECODE when every
        query_len is 1 and PREFILL otherwise; VERIFY must be asked for (uniform-length prompt
        chunks are not multi-token decode). Raises ``InvalidArgument`` when a request's kv_len
        passes its capacity, when DECODE gets a query_len != 1, or when VERIFY gets non-uniform
        (or length-1) query lengths — the caller must use PREFILL then. ``lane``: which of the
        key's workspaces to use (see the module docstring), a small integer >= 0."""
        if not isinstance(layout, BatchLayout):
            raise InvalidArgument("plan() needs a BatchLayout")
        if not isinstance(lane, int) or isinstance(lane, bool) or not 0 <= lane < MAX_LANES:
            raise InvalidArgument(f"lane must be an integer in [0, {MAX_LANES}), got {lane!r}")
        a = layout.arrays
        bs = self.geometry.block_size
        over = a.kv > a.widths * bs
        if over.any():
            r = int(np.argmax(over))
            raise InvalidArgument(
                f"request {r}: kv_len {a.kv[r]} (cached {a.cached[r]} + query {a.q[r]}) exceeds "
                f"reserved capacity {a.widths[r] * bs} ({a.widths[r]} blocks of {bs})"
            )
        uniform = a.uniform_q
        if kind is None:
            kind = AttentionKind.DECODE if uniform == 1 else AttentionKind.PREFILL
        elif kind is AttentionKind.DECODE and uniform != 1:
            raise InvalidArgument("DECODE needs query_len == 1 for every request")
        elif kind is AttentionKind.VERIFY and (uniform is None or uniform < 2):
            raise InvalidArgument(
                "VERIFY needs the same query_len > 1 for every request; plan PREFILL instead"
            )
        elif not isinstance(kind, AttentionKind):
            raise InvalidArgument(f"unknown attention kind {kind!r}")

        query_len = uniform if kind is not AttentionKind.PREFILL else None
        key = (kind, layout.batch_size, query_len, lane)
        ws = self._workspaces.get(key)
        if ws is None:
            self.stats.misses += 1
            ws = self._new_workspace(key)
            self._workspaces[key] = ws
        else:
            self.stats.hits += 1
        generation = self._generations.get(key, 0) + 1
        self._generations[key] = generation

        plan = self._common_plan(layout, kind, key, generation, query_len, ws)
        plan.owner = id(self)
        self._finish_plan(plan, ws)
        return plan

    def _common_plan(self, layout, kind, key, generation, query_len, ws: Workspace) -> AttentionPlan:
        """The plan's tensors for every backend, computed with vectorized numpy from the layout's
        arrays: O(1) interpreter steps per batch, not per request or per token (planning runs for
        every forward, up to k+1 times per speculative step, on the host while the GPU waits).
        Mutates ``ws`` buffers.

        Two staging copies per plan, into two workspace buffers:

            "fixed"  int64 [ positions | slots | k_rows | v_rows ]            4T
                     int32 [ batch | qo_indptr | kv_lens | page_indptr | last ]  T + 4B + 2
            "paged"  int32 [ page_indices | block_tables ]                     nnz + B*P

        The fixed buffer's size depends on the plan key only (DECODE/VERIFY: T = B*q), so what
        per-layer kernels read keeps its device address across re-plans even when tables grow
        (what CUDA graphs need); the paged part is read at plan time only."""
        bs = self.geometry.block_size
        a = layout.arrays
        q, cached, kv, tables = a.q, a.cached, a.kv, a.tables
        B, T, P = len(q), a.num_tokens, tables.shape[1]

        fixed = np.empty(4 * T + (T + 4 * B + 3) // 2, dtype=np.int64)
        positions, slots, k_rows, v_rows = fixed[: 4 * T].reshape(4, T)
        small = fixed[4 * T :].view(np.int32)
        batch_idx, qo_indptr = small[:T], small[T : T + B + 1]
        kv32, page_indptr = small[T + B + 1 : T + 2 * B + 1], small[T + 2 * B + 1 : T + 3 * B + 2]
        last_page_len = small[T + 3 * B + 2 : T + 4 * B + 2]

        if a.uniform_q is not None:  # DECODE / VERIFY (and uniform prefill): no gathers
            n = a.uniform_q
            rows = np.arange(B).repeat(n)
            np.add(cached[:, None], np.arange(n), out=positions.reshape(B, n))
            qo_indptr[:] = np.arange(0, (B + 1) * n, n)
        else:
            starts = np.zeros(B + 1, dtype=np.int64)
            np.cumsum(q, out=starts[1:])
            rows = np.repeat(np.arange(B), q)
            np.subtract(np.arange(T), starts[rows], out=positions)
            positions += cached[rows]
            qo_indptr[:] = starts
        batch_idx[:] = rows
        pages = tables[rows, positions // bs]
        np.multiply(pages, bs, out=slots)
        slots += positions % bs
        np.add(slots, pages * bs, out=k_rows)  # flat pool view: page p's K rows start at p * 2bs
        np.add(k_rows, bs, out=v_rows)

        used_pages = (kv + (bs - 1)) // bs
        kv32[:] = kv
        page_indptr[0] = 0
        np.cumsum(used_pages, out=page_indptr[1:])
        np.subtract(kv, (used_pages - 1) * bs, out=last_page_len)
        nnz = int(page_indptr[-1])
        paged = np.empty(nnz + B * P, dtype=np.int32)
        flat_tables = paged[nnz:]
        flat_tables[:] = tables.ravel()
        # pages holding logical KV: a prefix of each row, picked by a mask made with one repeat
        #   row r:  [ used_pages[r] x True ][ P - used_pages[r] x False ]
        runs = np.empty(2 * B, dtype=np.int64)
        runs[0::2] = used_pages
        np.subtract(P, used_pages, out=runs[1::2])
        keep = np.zeros(2 * B, dtype=bool)
        keep[0::2] = True
        paged[:nnz] = flat_tables[np.repeat(keep, runs)]

        d_fixed = ws.stage("fixed", torch.from_numpy(fixed))
        d_paged = ws.stage("paged", torch.from_numpy(paged))
        dev = self._fixed_views(ws, d_fixed, T, B)
        indices, dev_tables = self._paged_views(ws, d_paged, nnz, B, P)
        return AttentionPlan(
            layout=layout,
            kind=kind,
            geometry=self.geometry,
            key=key,
            generation=generation,
            num_tokens=T,
            batch_size=B,
            query_len=query_len,
            max_query_len=a.uniform_q or int(q.max()),
            max_kv_len=a.max_kv_len,
            max_block_id=a.max_block_id,
            kv_page_indices=indices,
            block_tables=dev_tables,
            host={
                "qo_indptr": qo_indptr,
                "kv_lens": kv32,
                "kv_page_indptr": page_indptr,
                "kv_last_page_len": last_page_len,
                "used_pages": used_pages,
            },
            **dev,
        )

    @staticmethod
    def _fixed_views(ws: Workspace, d_fixed: torch.Tensor, T: int, B: int) -> dict[str, torch.Tensor]:
        """Device views of the fixed buffer, made once per (buffer, T, B): slicing device tensors
        costs microseconds each and a DECODE/VERIFY key re-plans the same shapes every step."""
        sig = (d_fixed.data_ptr(), T, B)
        cached = ws.state.get("fixed_views")
        if cached is not None and cached[0] == sig:
            return cached[1]
        wide = d_fixed[: 4 * T].view(4, T)
        small = d_fixed[4 * T :].view(torch.int32)
        views = {
            "positions": wide[0],
            "slot_mapping": wide[1],
            "k_rows": wide[2],
            "v_rows": wide[3],
            "batch_indices": small[:T],
            "qo_indptr": small[T : T + B + 1],
            "kv_lens": small[T + B + 1 : T + 2 * B + 1],
            "kv_page_indptr": small[T + 2 * B + 1 : T + 3 * B + 2],
            "kv_last_page_len": small[T + 3 * B + 2 : T + 4 * B + 2],
        }
        ws.state["fixed_views"] = (sig, views)
        return views

    @staticmethod
    def _paged_views(ws: Workspace, d_paged: torch.Tensor, nnz: int, B: int, P: int):
        """(page indices, block tables [B, P]) views of the paged buffer, cached like the fixed
        views (the page count changes only when a request crosses a page boundary)."""
        sig = (d_paged.data_ptr(), nnz, B, P)
        cached = ws.state.get("paged_views")
        if cached is not None and cached[0] == sig:
            return cached[1]
        views = (d_paged[:nnz], d_paged[nnz:].view(B, P))
        ws.state["paged_views"] = (sig, views)
        return views

    def _new_workspace(self, key: tuple) -> Workspace:
        """Make the reusable state for one plan key (override to add wrappers/buffers)."""
        return Workspace(self.device)

    def _finish_plan(self, plan: AttentionPlan, ws: Workspace) -> None:
        """Backend-private planning; may fill ``plan.extras``. Default: nothing."""

    # -- per-layer calls ----------------------------------------------------------------------

    def check_plan(self, plan: AttentionPlan, kv_layer: torch.Tensor) -> None:
        """Raise unless ``plan`` is the newest plan of its key on this backend and ``kv_layer``
        (``[num_blocks, 2, block_size, kv_heads, head_dim]``) matches the geometry and holds every
        block id the plan names. Reads only host state."""
        if plan.owner != id(self):
            raise FailedPrecondition("this attention plan was made by another backend")
        if self._generations.get(plan.key) != plan.generation:
            raise FailedPrecondition(
                f"stale attention plan {plan.key} (generation {plan.generation}); a newer plan "
                "with the same key replaced it"
            )
        g = self.geometry
        if kv_layer.dim() != 5 or tuple(kv_layer.shape[1:]) != (
            2,
            g.block_size,
            g.num_kv_heads,
            g.head_dim,
        ):
            raise InvalidArgument(
                f"kv_layer shape {tuple(kv_layer.shape)} does not match "
                f"[num_blocks, 2, {g.block_size}, {g.num_kv_heads}, {g.head_dim}]"
            )
        if plan.max_block_id >= kv_layer.shape[0]:
            raise InvalidArgument(
                f"block id {plan.max_block_id} outside a pool of {kv_layer.shape[0]} blocks"
            )

    def write_kv(
        self, plan: AttentionPlan, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store this forward's K and V (``[T, kv_heads, head_dim]``, RoPE already applied to k)
        at ``plan.slot_mapping`` in ``kv_layer``. Mutates ``kv_layer`` only at those slots."""
        self.check_plan(plan, kv_layer)
        shape = (plan.num_tokens, self.geometry.num_kv_heads, self.geometry.head_dim)
        if tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise InvalidArgument(f"k/v must be {list(shape)}, got {list(k.shape)}/{list(v.shape)}")
        self._write_kv(plan, kv_layer, k, v)

    def attend(
        self, plan: AttentionPlan, q: torch.Tensor, kv_layer: torch.Tensor, *, scale: float
    ) -> torch.Tensor:
        """Causal paged attention: ``q`` ``[T, qo_heads, head_dim]`` -> same shape and dtype. The
        token at position p attends to its own request's KV at positions 0..p (so write_kv for
        this forward must come first). GQA maps query head h to kv head
        ``h // (qo_heads // kv_heads)``. Reads only."""
        self.check_plan(plan, kv_layer)
        shape = (plan.num_tokens, self.geometry.num_qo_heads, self.geometry.head_dim)
        if tuple(q.shape) != shape:
            raise InvalidArgument(f"q must be {list(shape)}, got {list(q.shape)}")
        if not (isinstance(scale, float) and math.isfinite(scale)):
            raise InvalidArgument(f"scale must be a finite float, got {scale!r}")
        return self._attend(plan, q, kv_layer, scale)

    @abc.abstractmethod
    def _write_kv(self, plan: AttentionPlan, kv_layer, k, v) -> None: ...

    @abc.abstractmethod
    def _attend(self, plan: AttentionPlan, q, kv_layer, scale: float) -> torch.Tensor: ...


def get_backend(
    name: str, device: torch.device | str, geometry: AttentionGeometry, *, graph_max_pages_per_request: int | None = None
) -> AttentionBackend:
    """Registry: ``"torch"`` (reference, CPU and GPU) or ``"flashinfer"`` (GPU; its module, and so
    flashinfer itself, is imported only here, on demand). Raises ``InvalidArgument`` for others.
    ``graph_max_pages_per_request`` makes FlashInfer's decode/verify plans CUDA-graph safe (the
    torch backend's never are: its plans size tensors by the longest request)."""
    if not isinstance(geometry, AttentionGeometry):
        raise InvalidArgument("get_backend needs an AttentionGeometry")
    if name == "torch":
        from services.gpuworker.attention.torch_backend import TorchBackend

        return TorchBackend(device, geometry)
    if name == "flashinfer":
        from services.gpuworker.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device, geometry, graph_max_pages_per_request=graph_max_pages_per_request)
    raise InvalidArgument(f"unknown attention backend {name!r} (expected 'torch' or 'flashinfer')")


__all__ = [
    "AttentionBackend",
    "AttentionGeometry",
    "AttentionKind",
    "AttentionPlan",
    "BatchLayout",
    "PlanCacheStats",
    "Workspace",
    "get_backend",
]
