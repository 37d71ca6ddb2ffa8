"""The gpuworker's model: Llama-family target (``llama``; Mistral/Qwen2/Qwen3 as switches of it),
one-model draft layers (``draft``), the public EAGLE-3 layout (``eagle3_format``), configurations
(``config``), shared layers (``layers``), the loader (``loader``), model identity (``identity``)
and the dense training forward (``dense``)."""

from services.gpuworker.model.config import DraftConfig, LlamaConfig, tiny_config
from services.gpuworker.model.draft import DraftModel, DraftOutput, Eagle3Draft, MTPDraft
from services.gpuworker.model.llama import TargetModel, TargetOutput
from services.gpuworker.model.loader import load_draft, load_model, plan_model, save_draft, save_model

__all__ = [
    "DraftConfig",
    "DraftModel",
    "DraftOutput",
    "Eagle3Draft",
    "LlamaConfig",
    "MTPDraft",
    "TargetModel",
    "TargetOutput",
    "load_draft",
    "load_model",
    "plan_model",
    "save_draft",
    "save_model",
    "tiny_config",
]
