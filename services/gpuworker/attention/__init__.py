"""Paged attention backends behind one interface (``base``): ``torch`` (reference, CPU/GPU) and
``flashinfer`` (GPU, imported lazily by ``get_backend``). Importing this package never imports
anything CUDA-only."""

from services.gpuworker.attention.base import (
    AttentionBackend,
    AttentionGeometry,
    AttentionKind,
    AttentionPlan,
    BatchLayout,
    get_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionGeometry",
    "AttentionKind",
    "AttentionPlan",
    "BatchLayout",
    "get_backend",
]
