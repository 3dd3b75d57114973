"""Attention over the paged KV cache: backend interface + PyTorch reference backend."""

from .backend import AttentionBackend, AttentionMetadata, DecodeGroup, PrefillSpan
from .torch_ref import TorchAttentionBackend


def get_attention_backend(device: str = "cpu") -> AttentionBackend:
    """The backend for a device; only the PyTorch reference exists today (works on CPU and CUDA)."""
    return TorchAttentionBackend()


__all__ = ["AttentionBackend", "DecodeGroup", "AttentionMetadata", "PrefillSpan", "TorchAttentionBackend", "get_attention_backend"]
