"""Build a worker's engine from its settings: model, paired KV pools, attention backend, engine.

One function that the service (``server.py``) and the served-path benchmark both call, so the
benchmark's "engine alone" is exactly the engine the service runs::

    settings ──load_model──▶ target (+ draft) ──▶ pools [num_blocks (+1 scratch page)]
                                                  backend (FlashInfer graph-safe plans on CUDA)
                                                  Engine(graphs = capture | pad | off)

The kvstore is told ``num_blocks``; with CUDA graphs the pools hold one more page (the scratch
page that padding rows of graph batches write), which the kvstore never hands out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument
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
    engine: Engine
    target: TargetModel
    draft: DraftModel | None
    spec_mode: SpecMode
    num_blocks: int  # what the kvstore may hand out (the pools may hold a scratch page more)


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
        raise InvalidArgument(f"kv_memory_mb={settings.kv_memory_mb} holds no block of {per_block} bytes")
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


def build_engine(settings: WorkerSettings, block_source: BlockSource) -> BuiltEngine:
    """Load the model and assemble the engine (graphs not captured yet: ``engine.warmup()``)."""
    spec_mode = SPEC_MODES[settings.spec_mode]
    dtype = DTYPES[settings.dtype]
    device = torch.device(settings.device)
    target, draft, _tokenizer = load_model(
        settings.model, spec_mode=spec_mode, mtp_depth=settings.mtp_depth, dtype=dtype, device=device, seed=settings.seed
    )
    num_blocks = pool_blocks(settings, target, draft, dtype)
    graphs = graph_mode(settings)
    pages = num_blocks + (1 if graphs != "off" else 0)
    target_pool = target.new_kv_pool(pages, settings.block_size)
    draft_pool = draft.new_kv_pool(pages, settings.block_size) if draft is not None else None
    c = target.config
    geometry = AttentionGeometry(c.num_heads, c.num_kv_heads, c.head_dim, settings.block_size, dtype)
    max_seq_len = min(c.max_seq_len, 1 << 30)
    backend = get_backend(
        settings.backend, device, geometry,
        # every decode/verify plan fits these fixed buffers: a request never spans more pages
        graph_max_pages_per_request=-(-max_seq_len // settings.block_size) if graphs == "capture" else None,
    )
    engine = Engine(
        target,
        draft,
        backend,
        target_pool,
        draft_pool,
        block_source,
        EngineConfig(
            max_batch_tokens=settings.max_batch_tokens,
            chunk_size=settings.chunk_size,
            max_batch_size=settings.max_batch_size,
            max_draft_tokens=settings.max_draft_tokens,
            forced_acceptance=settings.forced_acceptance,
            graphs=graphs,
        ),
    )
    return BuiltEngine(engine, target, draft, spec_mode, num_blocks)
