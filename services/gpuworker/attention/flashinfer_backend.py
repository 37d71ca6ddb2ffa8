"""FlashInfer paged attention (GPU only; ``flashinfer`` is imported when a backend is built).

One FlashInfer wrapper per plan key ``(kind, batch size, query length, lane)``, planned once per forward
(``AttentionBackend.plan``) and run once per layer:

    kind     wrapper                                         kernel (FlashInfer 0.6.x)
    DECODE   BatchDecodeWithPagedKVCacheWrapper              fa2 tensor-core decode
    VERIFY   BatchDecodeWithPagedKVCacheWrapper, q_len = q   same kernel, causal inside the q rows
    PREFILL  BatchPrefillWithPagedKVCacheWrapper causal      fa2 by default (see ``prefill_backend``)

All three run the same JIT module by default (fa2 batch-prefill for the geometry), so a fresh
machine compiles one kernel family, not two.

Our KV layer ``[num_blocks, 2, block_size, kv_heads, head_dim]`` is FlashInfer's "NHD" paged
layout. Writes go through the flat view ``[num_blocks * 2 * block_size, kv_heads, head_dim]``
at the plan's ``k_rows`` / ``v_rows`` (computed by the shared planner in ``base``):

    page p:   [ K: rows p*2bs .. p*2bs+bs-1 ][ V: rows p*2bs+bs .. p*2bs+2bs-1 ]
    slot s = p*bs + o   ->   K row  s + p*bs,   V row  s + p*bs + bs

Only pages that hold positions ``0..kv_len-1`` reach the kernels (the plan's CSR page list);
reserved headroom past the logical length is never read.

CUDA graphs: with ``graph_max_pages_per_request`` set, DECODE and VERIFY wrappers keep their
metadata in fixed device buffers and every per-layer tensor this backend touches lives at a stable
address per plan key, so a forward captured after ``plan()`` replays correctly after any later
``plan()`` of the same key (re-plan, then replay).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from services.common.errors import FailedPrecondition, InvalidArgument
from services.gpuworker.attention.base import (
    AttentionBackend,
    AttentionGeometry,
    AttentionKind,
    AttentionPlan,
    Workspace,
)

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_SUPPORTED_HEAD_DIMS = (64, 128, 256)  # head sizes FlashInfer's fa2 kernels are built for
_DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-k scratch size


def _import_flashinfer() -> Any:
    try:
        import flashinfer  # noqa: PLC0415 - lazy on purpose: CPU-only paths never import it
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise FailedPrecondition(
            "the flashinfer attention backend needs the flashinfer-python package "
            "(pip install 'tandem-serve[gpu]'); use the torch backend otherwise"
        ) from exc
    return flashinfer


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer wrappers; same results as ``TorchBackend`` up to bf16/fp16
    rounding.

    ``workspace_bytes``: split-k scratch shared by all wrappers (runs are serialized on one
    stream, so one scratch suffices). ``prefill_backend``: FlashInfer backend for PREFILL plans
    ("fa2" shares the decode JIT module; "auto"/"fa3" may be faster for long prompts on Hopper
    but compile a second kernel family). ``graph_max_pages_per_request``: makes DECODE/VERIFY
    plans CUDA-graph safe (fixed buffers sized batch * this many pages); plans needing more
    pages per request are rejected with ``InvalidArgument``.
    """

    name = "flashinfer"

    def __init__(
        self,
        device: torch.device | str,
        geometry: AttentionGeometry,
        *,
        workspace_bytes: int = _DEFAULT_WORKSPACE_BYTES,
        prefill_backend: str = "fa2",
        graph_max_pages_per_request: int | None = None,
    ):
        dev = torch.device(device)
        if dev.type != "cuda":
            raise InvalidArgument(f"the flashinfer backend runs on CUDA devices only, got {dev}")
        if geometry.dtype not in _SUPPORTED_DTYPES:
            raise InvalidArgument(
                f"the flashinfer backend needs float16 or bfloat16 KV/q, got {geometry.dtype}"
            )
        if geometry.head_dim not in _SUPPORTED_HEAD_DIMS:
            raise InvalidArgument(
                f"the flashinfer backend supports head_dim {_SUPPORTED_HEAD_DIMS}, got "
                f"{geometry.head_dim}; use the torch backend"
            )
        if prefill_backend not in ("fa2", "fa3", "auto"):
            raise InvalidArgument(f"prefill_backend must be fa2, fa3 or auto, got {prefill_backend!r}")
        if graph_max_pages_per_request is not None and (
            not isinstance(graph_max_pages_per_request, int) or graph_max_pages_per_request < 1
        ):
            raise InvalidArgument(
                f"graph_max_pages_per_request must be a positive integer, got "
                f"{graph_max_pages_per_request!r}"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(dev, geometry)
        self._fi = _import_flashinfer()
        self.prefill_backend = prefill_backend
        self.graph_max_pages_per_request = graph_max_pages_per_request
        # zero-initialized: FlashInfer requires it for the first use
        self._float_workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=dev)
        self._default_scale = 1.0 / math.sqrt(geometry.head_dim)
        self._num_sms = torch.cuda.get_device_properties(dev).multi_processor_count

    @property
    def graph_safe_kinds(self) -> tuple[AttentionKind, ...]:
        """Kinds whose plans may be captured in CUDA graphs on this backend."""
        if self.graph_max_pages_per_request is None:
            return ()
        return (AttentionKind.DECODE, AttentionKind.VERIFY)

    # -- planning ---------------------------------------------------------------------------

    def _new_workspace(self, key: tuple) -> Workspace:
        """One wrapper per key; DECODE/VERIFY wrappers get fixed buffers in graph mode."""
        kind, batch = key[0], key[1]
        ws = Workspace(self.device)
        fi = self._fi
        if kind is AttentionKind.PREFILL:
            ws.state["wrapper"] = fi.BatchPrefillWithPagedKVCacheWrapper(
                self._float_workspace, "NHD", backend=self.prefill_backend
            )
        elif self.graph_max_pages_per_request is None:
            ws.state["wrapper"] = fi.BatchDecodeWithPagedKVCacheWrapper(
                self._float_workspace, "NHD", use_tensor_cores=True
            )
        else:
            i32 = dict(dtype=torch.int32, device=self.device)
            ws.state["wrapper"] = fi.BatchDecodeWithPagedKVCacheWrapper(
                self._float_workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(batch + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(batch * self.graph_max_pages_per_request, **i32),
                paged_kv_last_page_len_buffer=torch.ones(batch, **i32),
            )
        ws.state["planned_event"] = None
        return ws

    def _finish_plan(self, plan: AttentionPlan, ws: Workspace) -> None:
        """Plan the key's FlashInfer wrapper for this batch (mutates the wrapper and
        ``ws.state["host"]``). Host metadata comes from the shared planner (``plan.host``), so
        FlashInfer never copies device tensors back to the host (no sync per step); the KV lengths
        and the longest query go in too, so FlashInfer does not recompute them with torch ops."""
        g = self.geometry
        bs = g.block_size
        ph = plan.host
        host = {
            "qo_indptr": torch.from_numpy(ph["qo_indptr"]),
            "page_indptr": torch.from_numpy(ph["kv_page_indptr"]),
            "last_page_len": torch.from_numpy(ph["kv_last_page_len"]),
            "kv_lens": torch.from_numpy(ph["kv_lens"]),
            "used_pages": ph["used_pages"],
        }
        ws.state["host"] = host
        if plan.kind is not AttentionKind.PREFILL and self.graph_max_pages_per_request is not None:
            worst = -(-plan.max_kv_len // bs)  # the longest request uses the most pages
            if worst > self.graph_max_pages_per_request:
                raise InvalidArgument(
                    f"a request needs {worst} pages, more than graph_max_pages_per_request="
                    f"{self.graph_max_pages_per_request} this backend was built with"
                )

        # FlashInfer plans copy through a pinned host buffer with an async memcpy; re-planning the
        # same wrapper before that copy ran would overwrite it. Wait for the previous one (free
        # unless the host is more than one plan of this key ahead of the device).
        previous = ws.state["planned_event"]
        if previous is not None:
            previous.synchronize()

        wrapper = ws.state["wrapper"]
        common = dict(q_data_type=g.dtype, kv_data_type=g.dtype, sm_scale=self._default_scale)
        if ws.state.get("replan"):
            self._replan(plan, host, wrapper)
        elif plan.kind is AttentionKind.PREFILL:
            wrapper.plan(
                host["qo_indptr"],
                host["page_indptr"],
                plan.kv_page_indices,
                host["last_page_len"],
                g.num_qo_heads,
                g.num_kv_heads,
                g.head_dim,
                bs,
                causal=True,
                seq_lens=host["kv_lens"],
                max_token_per_sequence=plan.max_query_len,
                **common,
            )
        else:
            wrapper.plan(
                host["page_indptr"],
                plan.kv_page_indices,
                host["last_page_len"],
                g.num_qo_heads,
                g.num_kv_heads,
                g.head_dim,
                bs,
                pos_encoding_mode="NONE",
                q_len_per_req=plan.query_len,
                disable_split_kv=self._batch_fills_gpu(plan, host),
                seq_lens=host["kv_lens"],
                **common,
            )
        if "replan" not in ws.state:  # the key's first plan went through wrapper.plan: may later ones skip it?
            ws.state["replan"] = self._can_replan(plan, wrapper)
        # one event per workspace, re-recorded (the previous recording completed: synchronized above)
        event = previous if previous is not None else torch.cuda.Event()
        event.record()
        ws.state["planned_event"] = event
        plan.extras["wrapper"] = wrapper

    def _can_replan(self, plan: AttentionPlan, wrapper) -> bool:
        """Whether later plans of this key may take ``_replan``: graph-mode DECODE/VERIFY wrappers
        on FlashInfer's fa2 tensor-core path, whose private state is the one ``_replan`` writes
        (checked by name, so another FlashInfer layout falls back to ``wrapper.plan``)."""
        if plan.kind is AttentionKind.PREFILL or self.graph_max_pages_per_request is None:
            return False
        needed = ("_cached_module", "_plan_info", "_float_workspace_buffer", "_int_workspace_buffer",
                  "_pin_memory_int_workspace_buffer", "_paged_kv_indptr_buf", "_paged_kv_indices_buf",
                  "_paged_kv_last_page_len_buf")
        return (
            getattr(wrapper, "_backend", None) == "fa2"
            and getattr(wrapper, "_jit_module", "missing") is None
            and getattr(wrapper, "use_tensor_cores", False)
            and getattr(wrapper, "is_cuda_graph_enabled", False)
            and all(hasattr(wrapper, name) for name in needed)
            and hasattr(wrapper._cached_module, "plan")
        )

    def _replan(self, plan: AttentionPlan, host: dict, wrapper) -> None:
        """Re-plan a graph-mode DECODE/VERIFY wrapper whose key was planned once by
        ``wrapper.plan`` (mutates the wrapper's fixed buffers and plan info).

        Everything ``wrapper.plan`` derives from the key (module, dtypes, scale, the q-row indptr
        buffer) is unchanged, so only the per-batch parts are redone: the page metadata comes from
        the planner's device buffers (device-to-device copies, where ``wrapper.plan`` copies it
        again from pageable host memory) and the split-kv schedule from the module's own planner,
        with the same arguments ``wrapper.plan`` passes it (FlashInfer 0.6.x, fa2). This skips the
        wrapper's Python: dtype and alignment checks and a Python ``max()`` over the KV-length
        tensor (about a microsecond per request). A GPU test replays graphs planned both ways."""
        g = self.geometry
        q = plan.query_len
        batch = plan.batch_size
        nnz = plan.kv_page_indices.shape[0]
        wrapper._paged_kv_indptr_buf.copy_(plan.kv_page_indptr, non_blocking=True)
        wrapper._paged_kv_last_page_len_buf.copy_(plan.kv_last_page_len, non_blocking=True)
        wrapper._paged_kv_indices_buf[:nnz].copy_(plan.kv_page_indices, non_blocking=True)
        wrapper._plan_info = wrapper._cached_module.plan(
            wrapper._float_workspace_buffer,
            wrapper._int_workspace_buffer,
            wrapper._pin_memory_int_workspace_buffer,
            host["qo_indptr"],
            host["page_indptr"],
            host["kv_lens"],
            batch * q,  # total query rows
            batch,
            g.num_qo_heads,
            g.num_kv_heads,
            g.block_size,
            True,  # CUDA-graph mode
            g.head_dim,
            g.head_dim,
            q > 1,  # causal inside each request's q rows
            -1,  # window_left: no sliding window
            -1,  # fixed_split_size: FlashInfer picks
            False,  # disable_split_kv (never in graph mode: one launch shape)
            0,  # colocated CTAs
            q if q > 1 else 0,  # uniform q length
        )

    def _batch_fills_gpu(self, plan: AttentionPlan, host: dict) -> bool:
        """Whether to skip split-kv for a DECODE/VERIFY batch (never in graph mode, whose plans
        must keep one launch shape). Splitting a request's KV over several CTAs buys parallelism
        for few or long requests; once requests x kv heads fill every SM twice over and lengths
        are balanced, the extra merge pass only costs bandwidth (64 x 4,096 tokens on an H200:
        85-90 % of a device copy without split vs 82-88 % with it)."""
        if self.graph_max_pages_per_request is not None:
            return False
        if plan.batch_size * self.geometry.num_kv_heads < 2 * self._num_sms:
            return False
        longest = -(-plan.max_kv_len // self.geometry.block_size)  # pages of the longest request
        return longest <= 2 * float(host["used_pages"].mean())

    # -- per-layer calls ----------------------------------------------------------------------

    def _check_layer(self, kv_layer: torch.Tensor) -> None:
        if kv_layer.device != self.device:
            raise InvalidArgument(f"kv_layer is on {kv_layer.device}, the backend on {self.device}")
        if kv_layer.dtype != self.geometry.dtype:
            raise InvalidArgument(
                f"kv_layer dtype {kv_layer.dtype} differs from the geometry's {self.geometry.dtype}"
            )
        if not kv_layer.is_contiguous():
            raise InvalidArgument("kv_layer must be contiguous (a KVPool.layer view is)")

    def _write_kv(self, plan: AttentionPlan, kv_layer, k, v) -> None:
        """Mutates ``kv_layer`` at the plan's slots only."""
        self._check_layer(kv_layer)
        g = self.geometry
        flat = kv_layer.view(-1, g.num_kv_heads, g.head_dim)
        flat.index_copy_(0, plan.k_rows, k.to(flat.dtype))
        flat.index_copy_(0, plan.v_rows, v.to(flat.dtype))

    def _attend(self, plan: AttentionPlan, q, kv_layer, scale: float) -> torch.Tensor:
        self._check_layer(kv_layer)
        if q.dtype != self.geometry.dtype or q.device != self.device:
            raise InvalidArgument(
                f"q must be {self.geometry.dtype} on {self.device}, got {q.dtype} on {q.device}"
            )
        wrapper = plan.extras["wrapper"]
        # Plans fix sm_scale = 1/sqrt(head_dim). Another scale goes in through q_scale, which
        # FlashInfer folds into sm_scale (q_scale * sm_scale) for 16-bit inputs.
        ratio = scale / self._default_scale
        q_scale = None if abs(ratio - 1.0) <= 1e-12 else ratio
        return wrapper.run(q.contiguous(), kv_layer, q_scale=q_scale)


__all__ = ["FlashInferBackend"]
