"""Build a worker's engine from its settings: model, paired KV pools, attention backend, engine.

One recipe for every caller, so that a benchmark driving the engine in-process runs exactly what
the served worker runs (same backend, pools, graphs, engine knobs)::

    WorkerSettings ──load_model──▶ target + draft ──pool_blocks──▶ KV pools [num_blocks (+1)]
                   ──get_backend──▶ attention backend (graph-safe FlashInfer plans on CUDA)
                   ──make_source(num_blocks)──▶ BlockSource ──▶ Engine(graphs = capture|pad|off)

The kvstore (or local source) is told ``num_blocks``; with graphs the pools hold one page more,
the scratch page that padding rows of graph batches write, which no source ever hands out.
``make_source`` is where callers differ: the worker passes a kvstore-backed source, tests and
benchmarks a ``LocalBlockSource(num_blocks, block_size)``. ``models`` reuses an already loaded
(target, draft) pair (fresh pools are always allocated). Nothing here starts threads or RPCs;
graphs are captured by ``engine.warmup()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument, NotFound
from services.common.startup import EXIT_CONFIG, StartupError
from services.common.spec import SpecMode
from services.gpuworker.attention.base import AttentionGeometry, get_backend
from services.gpuworker.engine.capacity import BlockSource
from services.gpuworker.engine.engine import Engine, EngineConfig
from services.gpuworker.model.draft import DraftModel
from services.gpuworker.model.llama import TargetModel
from services.gpuworker.model.loader import ModelPlan, load_model, plan_model
from services.gpuworker.model.ops import fuse_projections, get_ops, use_ops
from services.gpuworker.settings import WorkerSettings

SPEC_MODES = {"none": SpecMode.NONE, "eagle3": SpecMode.EAGLE3, "mtp": SpecMode.MTP}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BuiltEngine:
    """The engine and what it was built from (all owned by the caller)."""

    engine: Engine
    target: TargetModel
    draft: DraftModel | None
    tokenizer: object | None  # None when ``models`` was given
    source: BlockSource
    num_blocks: int  # what the source may hand out (the pools may hold a scratch page more)
    spec_mode: SpecMode
    dtype: torch.dtype
    device: torch.device


def model_dtype(settings: WorkerSettings) -> torch.dtype:
    """The torch dtype of ``settings`` (``auto`` resolved by device)."""
    return DTYPES[settings.torch_dtype_name]


def preflight(settings: WorkerSettings) -> ModelPlan:
    """Refuse, before any weight is read, what cannot run: a model, draft and spec mode that do
    not go together (EAGLE-3 on a 2-layer target, a draft made for another target, no draft), or
    a device that is not there. Raises ``StartupError`` (exit 2 for configuration, 3 for the
    machine) with one line."""
    device = torch.device(settings.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise StartupError(f"--device {settings.device}: no CUDA device is visible (torch {torch.__version__})")
    try:
        return plan_model(settings.model, spec_mode=SPEC_MODES[settings.spec_mode], mtp_depth=settings.mtp_depth,
                          draft_model=settings.draft_model or None, revision=settings.revision or None,
                          draft_revision=settings.draft_revision or None)
    except InvalidArgument as exc:
        raise StartupError(f"cannot load model {settings.model!r}: {exc.message}", EXIT_CONFIG) from None
    except NotFound as exc:
        raise StartupError(f"cannot load model {settings.model!r}: {exc.message}") from None


def load_models(settings: WorkerSettings):
    """(target, draft, tokenizer) for ``settings`` (model, spec mode, draft, dtype, device),
    after ``preflight``."""
    preflight(settings)
    return load_model(settings.model, spec_mode=SPEC_MODES[settings.spec_mode], mtp_depth=settings.mtp_depth,
                      dtype=model_dtype(settings), device=torch.device(settings.device), seed=settings.seed,
                      draft_model=settings.draft_model or None, revision=settings.revision or None,
                      draft_revision=settings.draft_revision or None,
                      served_model_name=settings.served_model_name or None)


DEFAULT_CUDA_KV_FRACTION = 0.9  # of the memory left free after the model loaded (vLLM, SGLang: ~0.9)


def free_device_bytes(device: torch.device) -> int:
    """Memory free on ``device`` now: CUDA's own count, or the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget_bytes(settings: WorkerSettings, device_type: str, free_bytes: Callable[[], int]) -> int:
    """Bytes for the target + draft KV pools: ``kv_memory_fraction`` of ``free_bytes()`` (0.9 by
    default on CUDA), else ``kv_memory_mb``."""
    fraction = settings.kv_memory_fraction
    if fraction is None and device_type == "cuda":
        fraction = DEFAULT_CUDA_KV_FRACTION
    if fraction is None:
        return int(settings.kv_memory_mb * 2**20)
    return int(free_bytes() * fraction)


def pool_blocks(settings: WorkerSettings, target, draft, dtype: torch.dtype, budget_bytes: int | None = None) -> int:
    """``num_blocks`` as given, or as many paired blocks as ``budget_bytes`` (default
    ``kv_memory_mb``) holds, at most ``max_num_blocks``: one block is a page in every target layer
    plus a page in every draft layer."""
    if settings.num_blocks:
        return settings.num_blocks
    if budget_bytes is None:
        budget_bytes = int(settings.kv_memory_mb * 2**20)
    c = target.config
    layers = c.num_layers + (draft.num_kv_layers if draft is not None else 0)
    per_block = layers * 2 * settings.block_size * c.num_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8
    blocks = min(int(budget_bytes // per_block), settings.max_num_blocks)
    if blocks < 1:
        raise InvalidArgument(f"the KV memory budget ({budget_bytes} bytes) holds no block of {per_block} bytes; "
                              "raise --kv-memory-mb or --kv-memory-fraction")
    return blocks


def graph_mode(settings: WorkerSettings) -> str:
    """``capture`` on CUDA with FlashInfer and ``cuda_graphs`` (the torch backend's plans cannot
    be replayed in graphs); ``pad`` on other CUDA set-ups that warm up (the scratch page gives
    the warm-up somewhere to write); ``off`` on CPU, where nothing compiles."""
    if torch.device(settings.device).type != "cuda":
        return "off"
    if settings.cuda_graphs and settings.backend == "flashinfer":
        return "capture"
    return "pad" if settings.warmup else "off"


def engine_config(settings: WorkerSettings) -> EngineConfig:
    return EngineConfig(
        max_batch_tokens=settings.step_tokens,
        chunk_size=settings.prefill_chunk,
        max_batch_size=settings.max_batch_size,
        max_draft_tokens=settings.max_draft_tokens,
        forced_acceptance=settings.forced_acceptance,
        graphs=graph_mode(settings),
        overlap=settings.overlap_steps,
        fused_spec=settings.fused_spec_steps,
        fused_graphs=settings.fused_spec_graphs,
        prefill_wait_steps=settings.prefill_wait_steps,
        prefill_batch=settings.prefill_batch,
    )


def build_engine(
    settings: WorkerSettings,
    make_source: Callable[[int], BlockSource],
    *,
    models: tuple[TargetModel, DraftModel | None] | None = None,
) -> BuiltEngine:
    """Load (or reuse ``models``), allocate pools, pick the backend and build the engine that a
    worker with ``settings`` runs. ``make_source(num_blocks)`` supplies its block source."""
    dtype = model_dtype(settings)
    device = torch.device(settings.device)
    tokenizer = None
    if models is None:
        target, draft, tokenizer = load_models(settings)
    else:
        target, draft = models
    if settings.backend == "flashinfer":
        # FlashInfer's norm/RoPE/SiLU kernels and one GEMM for q/k/v and gate/up (model/ops.py);
        # the torch backend keeps the reference ops
        ops = get_ops("flashinfer")
        for model in (target, draft):
            if model is not None:
                use_ops(model, ops)
                fuse_projections(model)
    num_blocks = pool_blocks(settings, target, draft, dtype, kv_budget_bytes(settings, device.type, lambda: free_device_bytes(device)))
    config = engine_config(settings)
    pages = num_blocks + (1 if config.graphs != "off" else 0)
    target_pool = target.new_kv_pool(pages, settings.block_size)
    draft_pool = draft.new_kv_pool(pages, settings.block_size) if draft is not None else None
    c = target.config
    geometry = AttentionGeometry(c.num_heads, c.num_kv_heads, c.head_dim, settings.block_size, dtype)
    backend = get_backend(
        settings.backend, device, geometry,
        # every decode/verify plan fits these fixed buffers: no request spans more pages
        graph_max_pages_per_request=-(-c.max_seq_len // settings.block_size) if config.graphs == "capture" else None,
    )
    source = make_source(num_blocks)
    engine = Engine(target, draft, backend, target_pool, draft_pool, source, config)
    return BuiltEngine(engine, target, draft, tokenizer, source, num_blocks, SPEC_MODES[settings.spec_mode],
                       dtype, device)
