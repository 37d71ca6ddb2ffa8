"""Build a worker's engine from its settings: model, paired KV pools, attention backend, engine.

One recipe for every caller, so that a benchmark driving the engine in-process runs exactly what
the served worker runs (same backend, pools, engine knobs)::

    WorkerSettings ──load_model──▶ target + draft ──pool_blocks──▶ target/draft KV pools
                   ──get_backend──▶ attention backend          ╲
                   ──make_source(num_blocks)──▶ BlockSource ────▶ Engine(EngineConfig from settings)

``make_source`` is where callers differ: the worker passes a kvstore-backed source, tests and
benchmarks a ``LocalBlockSource(num_blocks, block_size)``. ``models`` reuses an already loaded
(target, draft) pair (fresh pools are always allocated). Nothing here starts threads or RPCs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.spec import SpecMode
from services.gpuworker.attention.base import AttentionGeometry, get_backend
from services.gpuworker.engine.capacity import BlockSource
from services.gpuworker.engine.engine import Engine, EngineConfig
from services.gpuworker.model.draft import DraftModel
from services.gpuworker.model.llama import TargetModel
from services.gpuworker.model.loader import load_model
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
    num_blocks: int
    spec_mode: SpecMode
    dtype: torch.dtype
    device: torch.device


def load_models(settings: WorkerSettings):
    """(target, draft, tokenizer) for ``settings`` (model folder or 'tiny', spec mode, dtype, device)."""
    return load_model(settings.model, spec_mode=SPEC_MODES[settings.spec_mode], mtp_depth=settings.mtp_depth,
                      dtype=DTYPES[settings.dtype], device=torch.device(settings.device), seed=settings.seed)


def pool_blocks(settings: WorkerSettings, target, draft, dtype: torch.dtype) -> int:
    """``num_blocks`` as given, or as many paired blocks as ``kv_memory_mb`` holds: one block is
    a page in every target layer plus a page in every draft layer."""
    if settings.num_blocks:
        return settings.num_blocks
    c = target.config
    layers = c.num_layers + (draft.num_kv_layers if draft is not None else 0)
    per_block = layers * 2 * settings.block_size * c.num_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8
    blocks = int(settings.kv_memory_mb * 2**20 // per_block)
    if blocks < 1:
        raise ValueError(f"kv_memory_mb={settings.kv_memory_mb} holds no block of {per_block} bytes")
    return blocks


def engine_config(settings: WorkerSettings) -> EngineConfig:
    return EngineConfig(
        max_batch_tokens=settings.max_batch_tokens,
        chunk_size=settings.chunk_size,
        max_batch_size=settings.max_batch_size,
        max_draft_tokens=settings.max_draft_tokens,
        forced_acceptance=settings.forced_acceptance,
    )


def build_engine(
    settings: WorkerSettings,
    make_source: Callable[[int], BlockSource],
    *,
    models: tuple[TargetModel, DraftModel | None] | None = None,
) -> BuiltEngine:
    """Load (or reuse ``models``), allocate pools, pick the backend and build the engine that a
    worker with ``settings`` runs. ``make_source(num_blocks)`` supplies its block source."""
    dtype = DTYPES[settings.dtype]
    device = torch.device(settings.device)
    tokenizer = None
    if models is None:
        target, draft, tokenizer = load_models(settings)
    else:
        target, draft = models
    num_blocks = pool_blocks(settings, target, draft, dtype)
    c = target.config
    target_pool = target.new_kv_pool(num_blocks, settings.block_size)
    draft_pool = draft.new_kv_pool(num_blocks, settings.block_size) if draft is not None else None
    geometry = AttentionGeometry(c.num_heads, c.num_kv_heads, c.head_dim, settings.block_size, dtype)
    backend = get_backend(settings.backend, device, geometry)
    source = make_source(num_blocks)
    engine = Engine(target, draft, backend, target_pool, draft_pool, source, engine_config(settings))
    return BuiltEngine(engine, target, draft, tokenizer, source, num_blocks, SPEC_MODES[settings.spec_mode],
                       dtype, device)
