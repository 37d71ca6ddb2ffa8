"""Paged KV pools: ``[layers, num_blocks, 2, block_size, kv_heads, head_dim]`` (K at 0, V at 1).

One id, two pools (DESIGN §1): block ``b`` is page ``b`` of the target pool *and* page ``b`` of
the draft pool, so both are allocated with the same ``num_blocks`` and ``block_size``:

    target pool  layer 0..L-1   [ page 0 | page 1 | ... | page N-1 ]
    draft  pool  layer 0..Ld-1  [ page 0 | page 1 | ... | page N-1 ]
                                  ^ the kvstore hands out block ids; this module never allocates ids

Which pages are free or in use is the kvstore's business; a pool is only storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument


class KVPool:
    """Storage for the KV of ``num_layers`` attention layers. ``data`` is mutated by attention
    backends (``write_kv``) through the per-layer views that ``layer()`` returns."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
        if block_size & (block_size - 1):
            raise InvalidArgument(f"block_size must be a power of two, got {block_size}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # zeros, not empty: unwritten pages then read as harmless numbers in debugging dumps
        self.data = torch.zeros(
            (num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def layer(self, index: int) -> torch.Tensor:
        """View ``[num_blocks, 2, block_size, kv_heads, head_dim]`` of one layer (shares storage)."""
        if not 0 <= index < self.num_layers:
            raise InvalidArgument(f"layer {index} outside a pool of {self.num_layers} layers")
        return self.data[index]

    def block(self, block_id: int) -> torch.Tensor:
        """View ``[layers, 2, block_size, kv_heads, head_dim]`` of one page across all layers."""
        if not 0 <= block_id < self.num_blocks:
            raise InvalidArgument(f"block {block_id} outside a pool of {self.num_blocks} blocks")
        return self.data[:, block_id]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class PairedKVPools:
    """The target pool and (optionally) the draft pool of one worker, same ids and block size."""

    target: KVPool
    draft: KVPool | None = None

    def __post_init__(self) -> None:
        if self.draft is not None and (
            self.draft.num_blocks != self.target.num_blocks
            or self.draft.block_size != self.target.block_size
        ):
            raise InvalidArgument(
                "draft and target pools must have the same num_blocks and block_size"
            )

    @property
    def num_blocks(self) -> int:
        return self.target.num_blocks

    @property
    def block_size(self) -> int:
        return self.target.block_size
