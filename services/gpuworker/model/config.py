"""Model configurations: the Llama-family target (read from / written to a Hugging Face
``config.json``), the draft layers (``tandem_draft.json``), and the built-in ``tiny`` model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.errors import InvalidArgument
from services.common.spec import SpecMode, lookahead_span

# Byte-level tokenizer layout of the tiny model: ids 0..255 are bytes, then the specials; the rest
# of the vocabulary is unused padding to a round size. Defined with the tokenizer (shared with the
# router) so both sides agree.
from services.common.tokenizer import TINY_BOS_ID, TINY_EOS_ID, TINY_VOCAB_SIZE  # noqa: E402

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Llama-shaped families: the same decoder with the switches that differ (transformers' modelling)
FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {"qkv_bias": True}),  # bias on q/k/v, none on o
    "qwen3": ("Qwen3ForCausalLM", {"qk_norm": True}),  # RMSNorm per q/k head before RoPE
}


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None or {"rope_type": "llama3"|"linear"|"default", "factor": ..., ...} (HF field names)
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v/o (Llama)
    qkv_bias: bool = False  # bias on q/k/v only (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q/k head before RoPE (Qwen3)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"  # which family's config.json this came from (written back by to_hf)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"config {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgument(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.model_type not in FAMILIES:
            raise InvalidArgument(f"model_type {self.model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise InvalidArgument(
                f"rope type {rope_type!r} is not supported (supported: {_SUPPORTED_ROPE_TYPES})"
            )

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Read a Hugging Face ``config.json`` dict (transformers v4 ``rope_theta``/``rope_scaling``
        or v5 ``rope_parameters``). Raises ``InvalidArgument`` for what this decoder cannot run."""
        model_type = d.get("model_type", "llama")
        if model_type not in FAMILIES:
            raise InvalidArgument(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise InvalidArgument(f"hidden_act {act!r} is not supported (only 'silu')")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            rope_params = dict(d.get("rope_parameters") or {})
            rope_scaling = d.get("rope_scaling")
            rope_theta = float(rope_params.pop("rope_theta", d.get("rope_theta", 10000.0)))
            if rope_params and rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
            if rope_scaling is not None:
                rope_scaling = dict(rope_scaling)
                # transformers v4 checkpoints sometimes spell it "type"
                rope_scaling.setdefault("rope_type", rope_scaling.pop("type", "default"))
                if rope_scaling["rope_type"] == "default":
                    rope_scaling = None
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            max_seq_len = int(d.get("max_position_embeddings", 2048))
            window = d.get("sliding_window")
            uses_window = d.get("use_sliding_window", model_type == "mistral")
            if uses_window and window is not None and int(window) < max_seq_len:
                # sliding-window attention equals full attention while sequences fit the window;
                # serve only those, rather than compute something else past it
                max_seq_len = int(window)
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_seq_len=max_seq_len,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                model_type=model_type,
                **FAMILIES[model_type][1],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"bad config.json: {exc!r}") from exc

    def to_hf(self) -> dict[str, Any]:
        """The transformers-v4-style ``config.json`` dict (v5 reads it too)."""
        d: dict[str, Any] = {
            "architectures": [FAMILIES[self.model_type][0]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
        }
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            )
        return d


def tiny_config() -> LlamaConfig:
    """The built-in demo/test model: byte vocabulary + specials, 4 layers, GQA 4/2, head_dim 16."""
    return LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_seq_len=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=TINY_BOS_ID,
        eos_token_ids=(TINY_EOS_ID,),
    )


def default_eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high target layers whose outputs EAGLE-3 fuses (indices into layers).

    Deep targets: what SGLang, vLLM and SpecForge pick when a checkpoint names none (the inputs of
    layers 2, L/2 and L-3, i.e. the outputs of layers 1, L/2-1, L-4), so a draft Tandem trains
    matches theirs. Shallow targets (where those collide): first, middle and last layer."""
    engines = (1, num_layers // 2 - 1, num_layers - 4)
    if num_layers >= 8:
        return engines
    return (0, num_layers // 2, num_layers - 1) if num_layers >= 3 else tuple(range(num_layers))


@dataclass(frozen=True)
class DraftConfig:
    """The draft layers of a one-model speculative setup.

    EAGLE-3: one decoder layer (``num_modules`` = 1) fed by ``aux_layers`` (indices of target
    layers whose *outputs* are fused). MTP: ``num_modules`` = K chained modules. Attention geometry
    (heads, kv heads, head_dim) is the target's, so draft and target share attention plans;
    ``intermediate_size`` is the draft layers' MLP width.

    EAGLE-3 only (what public checkpoints vary in, see ``model/eagle3_format.py``):
    ``draft_vocab_size`` rows in the draft's LM head (0 = the target's whole vocabulary; fewer:
    a reduced vocabulary mapped to target ids by ``d2t``); ``layer`` the draft layer's own config
    (hidden size, RMSNorm eps, RoPE; None = the target's); ``norm_before_residual`` (the residual
    is the normed hidden, as some checkpoints train it); ``own_embedding`` (the checkpoint brings
    its own token embedding instead of sharing the target's).

    ``num_draft_tokens``: the k this draft runs best at, as its folder records it (optional key
    ``num_draft_tokens`` of an EAGLE-3 ``config.json`` or of the ``tandem_draft.json`` "draft"
    section; None = not recorded). A worker serving the draft advertises it as its default k
    unless ``--num-draft-tokens`` says otherwise. It does not change what the draft computes."""

    spec_mode: SpecMode
    num_modules: int
    intermediate_size: int
    aux_layers: tuple[int, ...] = field(default_factory=tuple)
    draft_vocab_size: int = 0
    layer: LlamaConfig | None = None
    norm_before_residual: bool = False
    own_embedding: bool = False
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.spec_mode not in (SpecMode.EAGLE3, SpecMode.MTP):
            raise InvalidArgument(f"no built-in draft layers for spec mode {self.spec_mode.name}")
        if self.spec_mode is SpecMode.EAGLE3 and (self.num_modules != 1 or len(self.aux_layers) != 3):
            raise InvalidArgument("an EAGLE-3 draft has one module and exactly three aux layers")
        if self.spec_mode is SpecMode.MTP and (self.aux_layers or self.draft_vocab_size or self.layer):
            raise InvalidArgument("an MTP draft takes no aux layers, reduced vocabulary or own layer config")
        if not isinstance(self.num_modules, int) or self.num_modules < 1:
            raise InvalidArgument(f"num_modules must be >= 1, got {self.num_modules!r}")
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 1:
            raise InvalidArgument("draft intermediate_size must be a positive integer")
        if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 0:
            raise InvalidArgument(f"draft_vocab_size must be >= 0, got {self.draft_vocab_size!r}")
        if self.num_draft_tokens is not None and (
                isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int)
                or self.num_draft_tokens < 0):
            raise InvalidArgument(f"the draft's num_draft_tokens must be an integer >= 0, got {self.num_draft_tokens!r}")

    @property
    def span(self) -> int:
        return lookahead_span(self.spec_mode, self.num_modules)

    @classmethod
    def default_for(cls, target: LlamaConfig, spec_mode: SpecMode, mtp_depth: int = 1) -> "DraftConfig":
        if spec_mode is SpecMode.EAGLE3:
            check_eagle3_target(target)
            return cls(spec_mode, 1, target.intermediate_size, default_eagle3_aux_layers(target.num_layers))
        if spec_mode is SpecMode.MTP:
            try:
                lookahead_span(spec_mode, mtp_depth)  # the one place that says what a depth may be
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from exc
            return cls(spec_mode, mtp_depth, target.intermediate_size, ())
        raise InvalidArgument(f"no built-in draft layers for spec mode {spec_mode.name}")

    def to_json(self) -> dict[str, Any]:
        """The legacy ``tandem_draft.json`` "draft" section (MTP drafts; full-vocabulary EAGLE-3)."""
        d = {
            "spec_mode": self.spec_mode.name,
            "num_modules": self.num_modules,
            "intermediate_size": self.intermediate_size,
            "aux_layers": list(self.aux_layers),
        }
        if self.num_draft_tokens is not None:  # only when recorded: a random draft's fingerprint stays as it was
            d["num_draft_tokens"] = self.num_draft_tokens
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DraftConfig":
        try:
            return cls(
                spec_mode=SpecMode[d["spec_mode"]],
                num_modules=int(d["num_modules"]),
                intermediate_size=int(d["intermediate_size"]),
                aux_layers=tuple(int(x) for x in d.get("aux_layers", ())),
                num_draft_tokens=d.get("num_draft_tokens"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"bad draft section in tandem_draft.json: {exc!r}") from exc


def check_eagle3_target(target: LlamaConfig) -> None:
    """EAGLE-3 fuses three distinct target layers: a target with fewer cannot have a draft."""
    if target.num_layers < 3:
        raise InvalidArgument(
            f"EAGLE-3 needs a target with at least 3 layers (it fuses a low, middle and high layer); "
            f"this one has {target.num_layers}"
        )
