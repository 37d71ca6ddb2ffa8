"""The gpuworker's model: Llama-family target (``llama``), one-model draft layers (``draft``),
configurations (``config``), shared layers (``layers``) and the loader (``loader``)."""

from services.gpuworker.model.config import DraftConfig, LlamaConfig, tiny_config
from services.gpuworker.model.draft import DraftModel, DraftOutput, Eagle3Draft, MTPDraft
from services.gpuworker.model.llama import TargetModel, TargetOutput
from services.gpuworker.model.loader import load_model, save_draft, save_model

__all__ = [
    "DraftConfig",
    "DraftModel",
    "DraftOutput",
    "Eagle3Draft",
    "LlamaConfig",
    "MTPDraft",
    "TargetModel",
    "TargetOutput",
    "load_model",
    "save_draft",
    "save_model",
    "tiny_config",
]
