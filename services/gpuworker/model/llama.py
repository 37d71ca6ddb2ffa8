"""The target model: a Llama-family decoder that runs one batched forward over a paged KV pool.

    input_ids [T] --embed--> x --layer 0..L-1--> x --norm--> hidden [T,H] --lm_head--> logits
                                   |      (each layer writes its K/V for the plan's positions
                                   |       into its own layer of the target KVPool)
                                   +--> aux_hidden: residual stream after each requested layer

Tokens are request-major in the order of the plan's BatchLayout. Position p of a request is
``cached_len + offset``; its logits predict the token at position p + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.common.errors import InvalidArgument
from services.gpuworker.attention.base import AttentionBackend, AttentionGeometry, AttentionPlan
from services.gpuworker.kv.pool import KVPool
from services.gpuworker.model.config import LlamaConfig
from services.gpuworker.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding


@dataclass
class TargetOutput:
    """Result of ``TargetModel.forward``.

    * ``hidden`` [T, H]: the **final-normed** hidden state (exactly what the LM head reads; MTP
      module 1 consumes it).
    * ``logits`` [T, V] (or [len(logits_indices), V]): float32; row j predicts the token after
      the j-th (selected) input token.
    * ``aux_hidden`` [T, len(aux_layers) * H] or None: residual stream *after* each requested
      layer (pre-norm), concatenated in the order asked (EAGLE-3 fuses these).
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    aux_hidden: torch.Tensor | None


class TargetModel(nn.Module):
    """Llama-family decoder (RMSNorm, RoPE incl. llama3 scaling, GQA, SwiGLU, optional tied
    embeddings). Parameter names match Hugging Face's without the ``model.`` prefix."""

    fingerprint: str = ""  # set by the loader: identifies config + weights (kvstore namespace)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def attention_geometry(self, block_size: int, dtype: torch.dtype | None = None) -> AttentionGeometry:
        """The geometry to build attention backends and KV pools with (draft layers share it)."""
        c = self.config
        return AttentionGeometry(
            num_qo_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            block_size=block_size,
            dtype=dtype or self.embed_tokens.weight.dtype,
        )

    def new_kv_pool(self, num_blocks: int, block_size: int, *, dtype=None, device=None) -> KVPool:
        """Allocate a target pool shaped for this model (one layer per decoder layer)."""
        w = self.embed_tokens.weight
        return KVPool(
            self.config.num_layers,
            num_blocks,
            block_size,
            self.config.num_kv_heads,
            self.config.head_dim,
            dtype=dtype or w.dtype,
            device=device or w.device,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [N, H] -> float32 logits [N, V]."""
        return self.lm_head(hidden).float()

    @torch.no_grad()  # not inference_mode: its tensors could not feed draft training later
    def forward(
        self,
        input_ids: torch.Tensor,
        plan: AttentionPlan,
        backend: AttentionBackend,
        kv: KVPool,
        *,
        aux_layers: tuple[int, ...] = (),
        logits_indices: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run the decoder over ``input_ids`` [T] (int64, request-major, matching ``plan``).

        Mutates ``kv`` (every layer, at ``plan.slot_mapping``) and nothing else. ``logits_indices``
        (int64 [N]) limits the LM head to those rows (e.g. the last token of each prefill chunk);
        ``hidden`` and ``aux_hidden`` always cover all T rows. Raises ``InvalidArgument`` when the
        shapes disagree with the plan/pool or a position reaches ``max_seq_len``."""
        self._check(input_ids, plan, kv, aux_layers)
        x = self.embed_tokens(input_ids)
        captured: dict[int, torch.Tensor] = {}
        wanted = set(aux_layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, plan, backend, kv.layer(i))
            if i in wanted:
                captured[i] = x
        hidden = self.norm(x)
        rows = hidden if logits_indices is None else hidden.index_select(0, logits_indices)
        aux = torch.cat([captured[i] for i in aux_layers], dim=-1) if aux_layers else None
        return TargetOutput(hidden=hidden, logits=self.compute_logits(rows), aux_hidden=aux)

    def _check(self, input_ids, plan: AttentionPlan, kv: KVPool, aux_layers) -> None:
        c = self.config
        if input_ids.dim() != 1 or input_ids.shape[0] != plan.num_tokens:
            raise InvalidArgument(
                f"input_ids must be [{plan.num_tokens}] to match the plan, got {list(input_ids.shape)}"
            )
        if kv.num_layers != c.num_layers:
            raise InvalidArgument(f"target pool has {kv.num_layers} layers, model has {c.num_layers}")
        if plan.max_kv_len > c.max_seq_len:
            raise InvalidArgument(
                f"positions up to {plan.max_kv_len - 1} reach past max_seq_len {c.max_seq_len}"
            )
        for i in aux_layers:
            if not 0 <= i < c.num_layers:
                raise InvalidArgument(f"aux layer {i} outside 0..{c.num_layers - 1}")
