"""The in-tree models (GPT-2 and Llama styles) and their Hugging Face interop."""

from scape_train.models.build import build_model, resolve_config
from scape_train.models.checkpointing import apply_activation_checkpointing
from scape_train.models.config import ModelConfig
from scape_train.models.gpt import GPT
from scape_train.models.hf import export_hf, load_hf
from scape_train.models.layers import CausalLM
from scape_train.models.llama import Llama

__all__ = [
    "GPT",
    "CausalLM",
    "Llama",
    "ModelConfig",
    "apply_activation_checkpointing",
    "build_model",
    "export_hf",
    "load_hf",
    "resolve_config",
]
