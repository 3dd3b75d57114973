"""Attention over the paged KV cache: backend interface, the PyTorch reference backend (the oracle) and
the Triton kernels' backend."""

from __future__ import annotations

import importlib.util
import os

from .backend import PAD_SLOT_ID, AttentionBackend, AttentionMetadata, DecodeGroup, PrefillSpan
from .torch_ref import TorchAttentionBackend

from ..config import ATTENTION_BACKEND_CHOICES  # kvfleet's --attention-backend values (vLLM picks its
# kernels with the VLLM_ATTENTION_BACKEND environment variable, whose values name vLLM's own backends)


def resolve_attention_backend(name: str, device_type: str) -> str:
    """"auto" → "triton" on CUDA when triton is installed, else "torch"; "torch" / "triton" as given.

    Raises ValueError naming ``attention_backend`` for an unknown name, for "triton" without the
    triton package, and for "triton" on a CPU unless the Triton interpreter is on
    (``TRITON_INTERPRET=1``: slow, for tests)."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKEND_CHOICES)}, got {name!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device_type == "cuda" and has_triton else "torch"
    if name == "triton":
        if not has_triton:
            raise ValueError("attention_backend='triton' needs the triton package (pip install 'kvfleet[gpu]')")
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' runs on CUDA; on device {device_type!r} only under the "
                             "Triton interpreter (TRITON_INTERPRET=1, slow: for tests). Use 'torch' or 'auto'")
    return name


def get_attention_backend(device: str = "cpu", name: str = "auto") -> AttentionBackend:
    """The backend ``name`` (see ``resolve_attention_backend``) for a device type ("cpu", "cuda")."""
    if resolve_attention_backend(name, device) == "triton":
        from .triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()


__all__ = ["ATTENTION_BACKEND_CHOICES", "AttentionBackend", "AttentionMetadata", "DecodeGroup", "PAD_SLOT_ID",
           "PrefillSpan", "TorchAttentionBackend", "get_attention_backend", "resolve_attention_backend"]
