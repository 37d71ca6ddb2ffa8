"""The public EAGLE-3 draft layout (what SGLang's and vLLM's ``llama_eagle3.py`` load, what
SpecForge and EAGLE's own training write), read and written.

    draft_dir/
      config.json     a Llama config of the ONE draft layer:
                        architectures ["LlamaForCausalLMEagle3"], hidden_size, intermediate_size,
                        num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
                        rope_theta/rope_scaling, num_hidden_layers = 1,
                        vocab_size         the TARGET's vocabulary
                        draft_vocab_size   rows of lm_head (<= vocab_size; default vocab_size)
                        target_hidden_size width of one target hidden (default hidden_size)
                        norm_before_residual (optional, default false)
                        num_draft_tokens   (optional, Tandem's) the k this draft runs best at:
                            a worker serving it defaults to it (docs/drafts.md); others ignore it
                        eagle_config.eagle_aux_hidden_state_layer_ids   target layers whose
                            OUTPUTS are fused (SGLang / SpecForge convention), or top-level
                            eagle_aux_hidden_state_layer_ids: vLLM's convention, id j = the INPUT
                            of layer j = the output of layer j-1. Neither: the engines' default,
                            inputs of layers (2, L/2, L-3).
      model.safetensors (or pytorch_model.bin, or shards + an index)
        fc.weight                      [H, 3 * target_hidden_size]
        midlayer.input_layernorm.weight, midlayer.hidden_norm.weight        [H]
        midlayer.self_attn.{q,k,v}_proj.weight   [heads * head_dim, 2H]   (input: [emb ; hidden])
        midlayer.self_attn.o_proj.weight         [H, heads * head_dim]
        midlayer.post_attention_layernorm.weight [H]
        midlayer.mlp.{gate,up}_proj.weight [I, H], midlayer.mlp.down_proj.weight [H, I]
        norm.weight [H], lm_head.weight [draft_vocab_size, H]
        d2t  int64 [draft_vocab_size]: target id = draft id + d2t[draft id]   (optional when
             draft_vocab_size = vocab_size)
        t2d  bool  [vocab_size]: whether a target id is in the draft vocabulary (optional)
        embed_tokens.weight [vocab_size, H]  (optional; absent: the target's embedding is shared)

Tandem writes its own drafts (``tandem distill-draft``) in exactly this layout, ids named in
``eagle_config`` (SGLang's reading) so other engines load them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from services.common.errors import InvalidArgument, NotFound
from services.common.spec import SpecMode
from services.gpuworker.model.config import DraftConfig, LlamaConfig, check_eagle3_target
from services.gpuworker.model.draft import Eagle3Draft
from services.gpuworker.model.llama import TargetModel

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
_REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight")


def engine_default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """SGLang's / vLLM's choice when a checkpoint names no layers: the inputs of layers
    (2, L/2, L-3), as target layer OUTPUT indices."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def is_eagle3_config(d: dict[str, Any]) -> bool:
    """Whether a ``config.json`` dict describes an EAGLE-3 draft (not a target)."""
    archs = " ".join(d.get("architectures") or [])
    return "Eagle3" in archs or "draft_vocab_size" in d or "eagle_config" in d


def draft_config_from_json(d: dict[str, Any], target: LlamaConfig) -> DraftConfig:
    """The ``DraftConfig`` of a public EAGLE-3 ``config.json`` for ``target``. Raises
    ``InvalidArgument`` for a draft that does not fit this target or that Tandem cannot run."""
    check_eagle3_target(target)
    if "transformer_layer_config" in d:  # the speculators packaging: layer config nested
        d = {**d["transformer_layer_config"], **{k: v for k, v in d.items() if k != "transformer_layer_config"}}
    layers = int(d.get("num_hidden_layers", 1))
    if layers != 1:
        raise InvalidArgument(f"only one-layer EAGLE-3 drafts are supported, this one has {layers}")
    if d.get("model_type", "llama") != "llama":
        raise InvalidArgument(f"EAGLE-3 draft model_type {d.get('model_type')!r} is not supported (only 'llama')")
    layer = LlamaConfig.from_hf({**d, "model_type": "llama", "num_hidden_layers": 1})
    if layer.vocab_size != target.vocab_size:
        raise InvalidArgument(
            f"the draft was made for a vocabulary of {layer.vocab_size} ids, the target has {target.vocab_size}"
        )
    target_hidden = int(d.get("target_hidden_size") or layer.hidden_size)
    if target_hidden != target.hidden_size:
        raise InvalidArgument(
            f"the draft fuses target hiddens of width {target_hidden}, the target's are {target.hidden_size}"
        )
    draft_vocab = int(d.get("draft_vocab_size") or layer.vocab_size)
    aux = _aux_layers(d, target.num_layers)
    return DraftConfig(
        SpecMode.EAGLE3, 1, layer.intermediate_size, aux,
        draft_vocab_size=draft_vocab if draft_vocab != target.vocab_size else 0,
        layer=layer, norm_before_residual=bool(d.get("norm_before_residual", False)),
        num_draft_tokens=d.get("num_draft_tokens"),  # validated by DraftConfig
    )


def _aux_layers(d: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = d.get("eagle_aux_hidden_state_layer_ids")
    if nested:
        ids = tuple(int(i) for i in nested)  # outputs of these layers
    elif top:
        ids = tuple(int(i) - 1 for i in top)  # vLLM: inputs of these layers
    else:
        ids = engine_default_aux_layers(num_layers)
    if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
        raise InvalidArgument(
            f"the draft fuses target layers {list(ids)} (as layer outputs); the target has layers 0..{num_layers - 1}"
            " and EAGLE-3 needs three of them"
        )
    return ids


def config_json(draft: Eagle3Draft) -> dict[str, Any]:
    """The public ``config.json`` of ``draft``."""
    lc = draft.layer_config
    d = {k: v for k, v in lc.to_hf().items() if k not in ("bos_token_id", "eos_token_id")}
    d.update(
        architectures=[ARCHITECTURE],
        num_hidden_layers=1,
        vocab_size=draft.vocab_size,
        draft_vocab_size=draft.draft_vocab_size,
        target_hidden_size=draft.target_config.hidden_size,
        intermediate_size=draft.config.intermediate_size,
        tie_word_embeddings=False,
        norm_before_residual=draft.config.norm_before_residual,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(draft.aux_layers), "use_aux_hidden_state": True},
    )
    if draft.config.num_draft_tokens is not None:  # a recorded recommendation survives a re-save
        d["num_draft_tokens"] = draft.config.num_draft_tokens
    return d


def save(draft: Eagle3Draft, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``draft`` as a public EAGLE-3 folder (``config.json`` + ``model.safetensors`` with
    ``d2t``/``t2d``). ``dtype``: store float weights in it. Returns the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(device="cpu", dtype=dtype or v.dtype).contiguous() for k, v in draft.draft_state_dict().items()}
    d2t = draft.d2t.to("cpu")
    state["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()  # stored as offsets
    state["t2d"] = (draft.t2d.to("cpu") >= 0).contiguous()
    save_file(state, str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(config_json(draft), indent=2) + "\n", encoding="utf-8")
    return out


def _normalize(name: str) -> str:
    """Weight names as published (with or without ``model.``; ``layers.0.`` in some exports;
    ``layer.`` in Tandem's own pre-public drafts) -> this module's names."""
    if name.startswith("model."):
        name = name[len("model."):]
    for old in ("layers.0.", "layer."):
        if name.startswith(old):
            return "midlayer." + name[len(old):]
    return name


def load(folder: Path, target: TargetModel, tensors: dict[str, torch.Tensor]) -> Eagle3Draft:
    """Build the draft ``folder``'s ``config.json`` describes and fill it from ``tensors`` (all
    of the folder's weights, by published name). Raises ``InvalidArgument``/``NotFound``."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise NotFound(f"no config.json in the draft folder {folder}")
    try:
        d = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {cfg_path}: {exc}") from exc
    tensors = {_normalize(k): v for k, v in tensors.items()}
    config = draft_config_from_json(d, target.config)
    config = dataclasses.replace(config, own_embedding="embed_tokens.weight" in tensors)
    draft = Eagle3Draft(target, config)
    own = draft.draft_state_dict()
    missing = sorted(set(own) - set(tensors))
    if missing:
        raise InvalidArgument(f"the EAGLE-3 draft in {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    extra = sorted(set(tensors) - set(own) - {"d2t", "t2d"})
    if extra:
        log.warning("EAGLE-3 draft %s: ignoring %d tensors Tandem does not use, e.g. %s", folder, len(extra), extra[:3])
    state = {}
    for k, ref in own.items():
        t = tensors[k]
        if tuple(t.shape) != tuple(ref.shape):
            raise InvalidArgument(f"EAGLE-3 draft {k}: shape {list(t.shape)} != expected {list(ref.shape)}")
        state[k] = t.to(ref.dtype)
    draft.load_state_dict(state, strict=True)
    draft.set_vocab_map(_d2t(tensors, draft))
    return draft


def _d2t(tensors: dict[str, torch.Tensor], draft: Eagle3Draft) -> torch.Tensor:
    """Target id of every draft id, from ``d2t`` offsets (checked against ``t2d`` when given)."""
    n = draft.draft_vocab_size
    if "d2t" in tensors:
        offsets = tensors["d2t"].to(torch.int64).flatten()
        if offsets.numel() != n:
            raise InvalidArgument(f"d2t has {offsets.numel()} entries, draft_vocab_size is {n}")
        ids = torch.arange(n) + offsets
    elif draft.reduced_vocab:
        raise InvalidArgument(f"a reduced draft vocabulary ({n} of {draft.vocab_size}) needs the d2t map")
    else:
        ids = torch.arange(n)
    if "t2d" in tensors:
        t2d = tensors["t2d"].to(torch.bool).flatten()
        if t2d.numel() != draft.vocab_size or int(t2d.sum()) != n or (
            ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t2d.numel() or not bool(t2d[ids].all()))
        ):
            raise InvalidArgument("t2d disagrees with d2t (they must name the same target ids)")
    return ids
