"""Model definitions: Llama-family decoders over a flat token batch and a paged KV cache."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import MODEL_REGISTRY, LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM", "MODEL_REGISTRY", "SUPPORTED_ARCHITECTURES"]
