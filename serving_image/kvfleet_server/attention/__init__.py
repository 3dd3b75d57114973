"""Attention over the paged KV cache: backend interface, the PyTorch reference backend (the oracle),
kvfleet's C++ CPU kernel's backend and the Triton kernels' backend."""

from __future__ import annotations

import importlib.util
import os

from . import cpu_ext
from .backend import PAD_SLOT_ID, AttentionBackend, AttentionMetadata, DecodeGroup, PrefillSpan
from .cpu_backend import CpuPagedAttentionBackend
from .torch_ref import TorchAttentionBackend

from ..config import ATTENTION_BACKEND_CHOICES  # kvfleet's --attention-backend values (vLLM picks its
# kernels with the VLLM_ATTENTION_BACKEND environment variable, whose values name vLLM's own backends)


def resolve_attention_backend(name: str, device_type: str) -> str:
    """"auto" → "triton" on CUDA when triton is installed, "cpu" on the CPU when kvfleet's C++ kernel
    builds (``cpu_ext``; built on first use, then cached), else "torch"; "torch" / "cpu" / "triton" as given.

    Raises ValueError naming ``attention_backend`` for an unknown name, for "cpu" on another device or
    when its kernel cannot be built (the build error quoted), for "triton" without the triton package,
    and for "triton" on a CPU unless the Triton interpreter is on (``TRITON_INTERPRET=1``: slow, for tests)."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKEND_CHOICES)}, got {name!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        if device_type == "cuda" and has_triton:
            return "triton"
        if device_type == "cpu" and cpu_ext.load() is not None:
            return "cpu"
        return "torch"
    if name == "cpu":
        if device_type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, not on device {device_type!r}")
        if cpu_ext.load() is None:
            raise ValueError(f"attention_backend='cpu': kvfleet's CPU paged-attention kernel could not be built "
                             f"({cpu_ext.load_error()}); it needs g++ and ninja. Use 'torch' or 'auto'")
        return name
    if name == "triton":
        if not has_triton:
            raise ValueError("attention_backend='triton' needs the triton package (pip install 'kvfleet[gpu]')")
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' runs on CUDA; on device {device_type!r} only under the "
                             "Triton interpreter (TRITON_INTERPRET=1, slow: for tests). Use 'torch' or 'auto'")
    return name


def get_attention_backend(device: str = "cpu", name: str = "auto") -> AttentionBackend:
    """The backend ``name`` (see ``resolve_attention_backend``) for a device type ("cpu", "cuda")."""
    resolved = resolve_attention_backend(name, device)
    if resolved == "triton":
        from .triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if resolved == "cpu":
        return CpuPagedAttentionBackend()
    return TorchAttentionBackend()


__all__ = ["ATTENTION_BACKEND_CHOICES", "AttentionBackend", "AttentionMetadata", "CpuPagedAttentionBackend",
           "DecodeGroup", "PAD_SLOT_ID",
           "PrefillSpan", "TorchAttentionBackend", "get_attention_backend", "resolve_attention_backend"]
