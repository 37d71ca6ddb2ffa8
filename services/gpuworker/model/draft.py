"""One-model draft layers (EAGLE-3 and MTP) whose KV lives in the draft pool.

Notation: the accepted token stream is ``t[0..n']`` (``t[n']`` is the newest token, sampled from
the target's logits at ``n'-1``); the target has run positions ``0..n'-1`` and produced, at each
position i, the final-normed hidden ``h[i]`` and the aux hidden ``a[i]`` (3 layers concatenated).
A draft call runs over the positions of an ``AttentionPlan`` built for the **same block tables**
as the target (same ids, the draft pool's pages), writes the draft KV of those positions into the
draft pool (EAGLE-3: layer 0; MTP: layer k-1 for module k) and nothing else.

Finality rule (DESIGN §1, span D): the draft KV at position i is final once ``t[i+1..i+D]`` are
final (accepted/prompt tokens). Draft KV computed from a proposal is speculative: the engine must
recompute it once the real token is known (the same positions simply get written again).

EAGLE-3 (D = 1, one draft layer; ``Eagle3Draft.forward``)
--------------------------------------------------------

    row for position i:   input token  t[i+1]          (embedding shared with the target)
                          context      a[i]  [3H]       (fill: fused by fc 3H->H)
                                   or  g[i-1] [H]       (drafting: the draft's own previous hidden)
                          writes       draft KV at i    (draft pool layer 0)
                          outputs      g[i] [H] (pre-norm hidden), logits predicting t[i+2]

    step after verification (accepted up to t[n'], previous step ended at n):
      fill     positions n..n'-1   tokens t[n+1..n']    context a[n..n'-1]   context_is_aux=True
               -> logits at row n'-1 give d1 (proposal for t[n'+1]); g[n'-1] kept
      draft j  position n'-1+j     token d_j            context g[n'-2+j]    context_is_aux=False
               (j = 1..k-1, one DECODE plan each, cached_len = n'-1+j)   -> d_{j+1}

    position:   n ...... n'-1 | n'    n'+1  ...  n'+k-2
    draft KV:   final (fill)   | speculative (overwritten by the next fill)
    target verifies [t[n'], d1..dk] at positions n'..n'+k next.

    The input layer follows EAGLE-3: q/k/v of the draft layer project the 2H concatenation
    ``[input_layernorm(emb(t[i+1])) ; hidden_norm(context)]``; the residual is the context
    (fused; or its normed copy with ``norm_before_residual``); the MLP works on H. The LM head is
    the draft's own, over ``draft_vocab_size`` ids; a reduced draft vocabulary is mapped back to
    target ids by ``d2t`` (target id = ``d2t[draft id]``) and ``DraftOutput.logits`` always
    covers the whole target vocabulary, ids outside the draft's at -inf: greedy proposals and the
    draft distribution q of rejection sampling are then exactly the draft's, and the engine needs
    no knowledge of the mapping (vLLM maps the same way). Parameter names are those of the public
    EAGLE-3 layout (``midlayer.*``, ``fc``, ``norm``, ``lm_head``; ``model/eagle3_format.py``).

MTP (D = K, K chained modules; ``MTPDraft.forward`` per module, ``MTPDraft.run_chain`` for all)
---------------------------------------------------------------------------------------------

    module k at position i:  input token  t[i+k]
                             prev hidden  h[i] (k = 1, target final-normed)  or  m_{k-1}[i]
                             combine      eh_proj([enorm(emb) ; hnorm(prev)])  2H -> H
                             writes       draft KV at i in draft pool layer k-1
                             outputs      m_k[i] [H] (pre-norm), logits (shared target LM head
                                          after the module's own norm) predicting t[i+k+1]

    All K modules run over the SAME window of positions, so one plan serves them all:
      window = first position whose draft KV is not yet final .. n'-1
             = max(0, n - K + 1) .. n'-1   after a step that ended at n (prefill: 0 or the
               chunk start minus the not-final tail of the previous chunk)
    The engine keeps the target's final hidden of the last K-1 positions of every request,
    because the next window starts up to K-1 positions before the newly verified ones.

    tokens t[i+k] past t[n'] are proposals of this same step, from the LAST row (position n'-1):
        module 1 at n'-1 reads t[n'] (known)      -> d1 = proposal for t[n'+1]
        module 2 at n'-1 reads t[n'+1] = d1       -> d2
        module k at n'-1 reads d_{k-1}            -> d_k          (K proposals per step)
        module k at n'-2 reads t[n'-2+k] (= d_{k-2} when k >= 3); its KV is speculative

Autograd: in eval mode (how ``load_model`` returns a draft) every call runs without gradients,
so writes into the pool never chain autograd history from step to step; in train mode
(``tandem distill-draft``) gradients flow, through the pool too.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from services.common.errors import InvalidArgument
from services.common.spec import SpecMode, lookahead_span
from services.gpuworker.attention.base import AttentionBackend, AttentionPlan
from services.gpuworker.kv.pool import KVPool
from services.gpuworker.model.config import DraftConfig, LlamaConfig
from services.gpuworker.model.layers import MLP, Attention, DecoderLayer, RMSNorm, RotaryEmbedding
from services.gpuworker.model.llama import TargetModel


def _grad_only_when_training(fn):
    """Run ``fn`` with autograd on only if it is on already and the module is in train mode."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.training):
            return fn(self, *args, **kwargs)

    return wrapper


@dataclass
class DraftOutput:
    """``hidden`` [T, H]: pre-norm output (EAGLE-3: the next drafting step's context; MTP: module
    k+1's prev hidden). ``logits`` float32 [T, V] or [len(logits_indices), V]."""

    hidden: torch.Tensor
    logits: torch.Tensor


class DraftModel(nn.Module):
    """Common part of the draft kinds. Shares the target's embedding (and, for MTP, its LM head)
    by reference: they are not parameters of the draft and not in ``draft_state_dict()`` (an
    EAGLE-3 head that ships its own embedding has it as a parameter instead)."""

    fingerprint: str = ""  # set by the loader: identifies the draft config + weights

    def __init__(self, target: TargetModel, config: DraftConfig):
        super().__init__()
        self.config = config
        self.target_config: LlamaConfig = target.config
        self.spec_mode: SpecMode = config.spec_mode
        self.span: int = lookahead_span(config.spec_mode, config.num_modules)
        self.num_kv_layers: int = config.num_modules
        self.aux_layers: tuple[int, ...] = tuple(config.aux_layers)
        for i in self.aux_layers:
            if not 0 <= i < target.config.num_layers:
                raise InvalidArgument(f"draft aux layer {i} outside the target's layers")
        # plain attributes, not submodules: shared weights stay owned (and saved) by the target
        self.__dict__["embed_tokens"] = target.embed_tokens
        self.__dict__["target_lm_head"] = target.lm_head
        self.__dict__["rotary"] = target.rotary

    @property
    def chain_hidden_size(self) -> int:
        """Width of the hidden row a chain step reads back (``DraftOutput.hidden`` of the previous
        position): the target's hidden size for MTP, the draft layer's own for EAGLE-3."""
        return self.target_config.hidden_size

    def new_kv_pool(self, num_blocks: int, block_size: int, *, dtype=None, device=None) -> KVPool:
        """Allocate the draft pool: ``num_kv_layers`` layers, target geometry, same ids."""
        w = self.embed_tokens.weight
        c = self.target_config
        return KVPool(
            self.num_kv_layers,
            num_blocks,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=dtype or w.dtype,
            device=device or w.device,
        )

    def draft_state_dict(self) -> dict[str, torch.Tensor]:
        """The draft's own weights (what ``draft.safetensors`` holds)."""
        return {k: v for k, v in self.state_dict().items()}

    def _check_common(self, token_ids, context, plan: AttentionPlan, kv: KVPool, width: int) -> None:
        T = plan.num_tokens
        if token_ids.dim() != 1 or token_ids.shape[0] != T:
            raise InvalidArgument(f"token ids must be [{T}] to match the plan, got {list(token_ids.shape)}")
        if context.dim() != 2 or tuple(context.shape) != (T, width):
            raise InvalidArgument(f"context must be [{T}, {width}], got {list(context.shape)}")
        if kv.num_layers != self.num_kv_layers:
            raise InvalidArgument(
                f"draft pool has {kv.num_layers} layers, this draft needs {self.num_kv_layers}"
            )
        if plan.max_kv_len > self.target_config.max_seq_len:
            raise InvalidArgument(
                f"draft positions up to {plan.max_kv_len - 1} pass max_seq_len "
                f"{self.target_config.max_seq_len}"
            )


class Eagle3Layer(nn.Module):
    """EAGLE-3 draft decoder layer: attention over ``[norm(emb) ; norm(hidden)]`` (2H -> q/k/v),
    residual from ``hidden`` (or ``norm(hidden)``), SwiGLU MLP on H."""

    def __init__(self, config: LlamaConfig, rope: RotaryEmbedding, intermediate_size: int,
                 norm_before_residual: bool = False):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config, rope, input_size=2 * h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(h, intermediate_size, config.mlp_bias)
        self.norm_before_residual = norm_before_residual

    def forward(self, emb, hidden, plan, backend, kv_layer) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        x = residual + self.self_attn(x, plan, backend, kv_layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def _same_rope(a: LlamaConfig, b: LlamaConfig) -> bool:
    return (a.rope_theta, a.rope_scaling, a.head_dim) == (b.rope_theta, b.rope_scaling, b.head_dim)


class Eagle3Draft(DraftModel):
    """EAGLE-3 draft: ``fc`` (3H_target -> H, fuses the aux hiddens), one ``Eagle3Layer``
    (``midlayer``), own ``norm`` and ``lm_head`` (``draft_vocab_size`` rows; ``d2t`` maps them to
    target ids). Draft pool: 1 layer. See the module docstring for the alignment."""

    def __init__(self, target: TargetModel, config: DraftConfig):
        super().__init__(target, config)
        tc = target.config
        # the draft layer's own shape and RoPE, positions up to the target's max_seq_len; a plain
        # Llama layer whatever the target's family (the public layout is a Llama layer)
        lc = dataclasses.replace(config.layer or tc, max_seq_len=tc.max_seq_len, vocab_size=tc.vocab_size,
                                 model_type="llama", qkv_bias=False, qk_norm=False)
        if (lc.num_heads, lc.num_kv_heads, lc.head_dim) != (tc.num_heads, tc.num_kv_heads, tc.head_dim):
            raise InvalidArgument(
                f"the draft's attention ({lc.num_heads} heads, {lc.num_kv_heads} kv heads, head_dim "
                f"{lc.head_dim}) must match the target's ({tc.num_heads}, {tc.num_kv_heads}, {tc.head_dim}): "
                "draft and target share block tables and attention plans"
            )
        h = lc.hidden_size
        self.layer_config = lc
        self.vocab_size = tc.vocab_size
        self.draft_vocab_size = config.draft_vocab_size or tc.vocab_size
        if self.draft_vocab_size > tc.vocab_size:
            raise InvalidArgument(f"draft_vocab_size {self.draft_vocab_size} exceeds the target's {tc.vocab_size}")
        rope = target.rotary
        if not _same_rope(lc, tc):
            self.draft_rotary = RotaryEmbedding(lc)  # a submodule: moves with .to(); tables not saved
            rope = self.draft_rotary
        if config.own_embedding or h != tc.hidden_size:
            del self.__dict__["embed_tokens"]  # the checkpoint's own, a parameter of the draft
            self.embed_tokens = nn.Embedding(tc.vocab_size, h)
        self.fc = nn.Linear(3 * tc.hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(lc, rope, config.intermediate_size, config.norm_before_residual)
        self.norm = RMSNorm(h, lc.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        # d2t[j] = target id of draft id j; t2d[v] = draft id of target id v, or -1
        self.register_buffer("d2t", torch.arange(self.draft_vocab_size), persistent=False)
        self.register_buffer("t2d", torch.arange(tc.vocab_size), persistent=False)

    @property
    def chain_hidden_size(self) -> int:
        return self.layer_config.hidden_size  # the draft layer's own (may differ from the target's)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    def set_vocab_map(self, d2t: torch.Tensor) -> None:
        """Install the draft-to-target id map (int [draft_vocab_size], distinct ids in range).
        Mutates the ``d2t``/``t2d`` buffers."""
        d2t = torch.as_tensor(d2t, dtype=torch.int64).flatten()
        V = self.vocab_size
        if d2t.numel() != self.draft_vocab_size:
            raise InvalidArgument(f"d2t has {d2t.numel()} entries, the draft vocabulary {self.draft_vocab_size}")
        if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= V):
            raise InvalidArgument(f"d2t maps to ids outside the target vocabulary 0..{V - 1}")
        if torch.unique(d2t).numel() != d2t.numel():
            raise InvalidArgument("d2t maps two draft ids to one target id")
        t2d = torch.full((V,), -1, dtype=torch.int64)
        t2d[d2t] = torch.arange(d2t.numel())
        with torch.no_grad():
            self.d2t = d2t.to(self.d2t.device)
            self.t2d = t2d.to(self.t2d.device)

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [N, Vd] -> target-vocabulary logits [N, V] (-inf where the draft
        has no id). Identity for a full-vocabulary draft."""
        if not self.reduced_vocab:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy(1, self.d2t, logits)

    @_grad_only_when_training
    def forward(
        self,
        next_token_ids: torch.Tensor,
        context: torch.Tensor,
        plan: AttentionPlan,
        backend: AttentionBackend,
        kv: KVPool,
        *,
        context_is_aux: bool,
        logits_indices: torch.Tensor | None = None,
        draft_vocab_logits: bool = False,
    ) -> DraftOutput:
        """One draft-layer pass over the plan's positions.

        ``next_token_ids`` [T]: for the row at position i, the token t[i+1]. ``context``:
        ``[T, 3H_target]`` target aux hidden a[i] when ``context_is_aux`` (fill), else ``[T, H]``
        the draft's own previous ``DraftOutput.hidden`` (drafting). Mutates draft pool layer 0 at
        ``plan.slot_mapping`` only. Returns g[i] and logits predicting t[i+2], over the target
        vocabulary (or, with ``draft_vocab_logits``, the draft's own ids: for training)."""
        width = 3 * self.target_config.hidden_size if context_is_aux else self.layer_config.hidden_size
        self._check_common(next_token_ids, context, plan, kv, width)
        hidden = self.fc(context) if context_is_aux else context
        emb = self.embed_tokens(next_token_ids)
        out = self.midlayer(emb, hidden, plan, backend, kv.layer(0))
        rows = out if logits_indices is None else out.index_select(0, logits_indices)
        logits = self.lm_head(self.norm(rows)).float()
        return DraftOutput(hidden=out, logits=logits if draft_vocab_logits else self.full_vocab_logits(logits))


class MTPModule(nn.Module):
    """One MTP depth: ``eh_proj([enorm(emb) ; hnorm(prev)])`` (2H -> H), a decoder layer, and the
    module's own final norm before the shared LM head."""

    def __init__(self, config: LlamaConfig, rope: RotaryEmbedding, intermediate_size: int):
        super().__init__()
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(config, rope, intermediate_size)
        self.norm = RMSNorm(h, config.rms_norm_eps)


# choose(module k, logits [B, V] at each request's last row) -> token ids [B] (the proposals d_k)
ChooseFn = Callable[[int, torch.Tensor], torch.Tensor]


class MTPDraft(DraftModel):
    """K chained MTP modules (``self.mtp[k-1]`` is module k); LM head shared with the target.
    Draft pool: K layers (layer k-1 belongs to module k). See the module docstring."""

    def __init__(self, target: TargetModel, config: DraftConfig):
        super().__init__(target, config)
        c = target.config
        self.mtp = nn.ModuleList(
            MTPModule(c, target.rotary, config.intermediate_size) for _ in range(config.num_modules)
        )

    @_grad_only_when_training
    def forward(
        self,
        module: int,
        token_ids: torch.Tensor,
        prev_hidden: torch.Tensor,
        plan: AttentionPlan,
        backend: AttentionBackend,
        kv: KVPool,
        *,
        logits_indices: torch.Tensor | None = None,
    ) -> DraftOutput:
        """Run module ``module`` (k, 1-based) over the plan's positions.

        ``token_ids`` [T]: for the row at position i, the token t[i+k]. ``prev_hidden`` [T, H]:
        k = 1: the target's final-normed ``TargetOutput.hidden`` at i; k > 1: module k-1's
        ``DraftOutput.hidden`` at i. Mutates draft pool layer k-1 at ``plan.slot_mapping`` only.
        Returns m_k[i] and logits predicting t[i+k+1]."""
        if not isinstance(module, int) or not 1 <= module <= self.num_kv_layers:
            raise InvalidArgument(f"MTP module must be in 1..{self.num_kv_layers}, got {module!r}")
        self._check_common(token_ids, prev_hidden, plan, kv, self.target_config.hidden_size)
        m = self.mtp[module - 1]
        emb = self.embed_tokens(token_ids)
        x = m.eh_proj(torch.cat([m.enorm(emb), m.hnorm(prev_hidden)], dim=-1))
        out = m.layer(x, plan, backend, kv.layer(module - 1))
        rows = out if logits_indices is None else out.index_select(0, logits_indices)
        return DraftOutput(hidden=out, logits=self.target_lm_head(m.norm(rows)).float())

    @_grad_only_when_training
    def run_chain(
        self,
        lookahead: torch.Tensor,
        target_hidden: torch.Tensor,
        plan: AttentionPlan,
        backend: AttentionBackend,
        kv: KVPool,
        choose: ChooseFn,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run modules 1..K over one window and return K proposals per request.

        ``lookahead`` int64 [T, K]: ``lookahead[row, k-1]`` = t[pos(row) + k] when that token is
        known (prompt or accepted), else -1. A -1 is replaced by this step's proposal
        ``d_j`` with ``j = pos(row) + k - (last position of the row's request + 1)`` (1 <= j < k;
        anything else raises ``InvalidArgument``). ``target_hidden`` [T, H]: the target's
        final-normed hidden at each row (carried rows included). ``choose(k, logits)`` turns the
        logits at every request's last row ([B, V]) into d_k ([B] int64) — greedy argmax or
        sampling, the engine's call.

        Mutates draft pool layers 0..K-1 at the plan's slots. Returns ``(proposals [B, K],
        [logits at last rows per module])``."""
        K, T, B = self.num_kv_layers, plan.num_tokens, plan.batch_size
        if lookahead.dim() != 2 or tuple(lookahead.shape) != (T, K):
            raise InvalidArgument(f"lookahead must be [{T}, {K}], got {list(lookahead.shape)}")
        req = plan.batch_indices.long()
        last_rows = plan.qo_indptr[1:].long() - 1  # [B] row index of each request's last token
        # rows before the last one of their request: how far back from the last position
        dist = last_rows[req] - torch.arange(T, device=req.device)
        unknown = lookahead < 0
        ks = torch.arange(1, K + 1, device=req.device)
        # [T, K]: t[pos + k] is proposal d_j with j = pos + k - (last_pos + 1) = k - dist - 1
        j = ks.unsqueeze(0) - dist.unsqueeze(1) - 1
        if bool((unknown & (j < 1)).any()):
            raise InvalidArgument(
                "lookahead has -1 where no earlier proposal of this step can stand in "
                "(only tokens past the last known token may be unknown)"
            )
        proposals = torch.zeros(B, K, dtype=torch.int64, device=req.device)
        all_logits: list[torch.Tensor] = []
        prev = target_hidden
        for k in range(1, K + 1):
            col = lookahead[:, k - 1]
            fill = proposals[req, (j[:, k - 1] - 1).clamp(min=0)]
            tokens = torch.where(col < 0, fill, col)
            out = self.forward(k, tokens, prev, plan, backend, kv, logits_indices=last_rows)
            chosen = choose(k, out.logits)
            if tuple(chosen.shape) != (B,):
                raise InvalidArgument(f"choose() must return [{B}] token ids")
            proposals[:, k - 1] = chosen.to(torch.int64)
            all_logits.append(out.logits)
            prev = out.hidden
        return proposals, all_logits


def build_draft(target: TargetModel, config: DraftConfig) -> DraftModel:
    """Construct (uninitialized weights) the draft kind ``config`` names."""
    if config.spec_mode is SpecMode.EAGLE3:
        return Eagle3Draft(target, config)
    if config.spec_mode is SpecMode.MTP:
        return MTPDraft(target, config)
    raise InvalidArgument(f"no built-in draft layers for spec mode {config.spec_mode.name}")
