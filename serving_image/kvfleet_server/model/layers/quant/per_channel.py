"""Symmetric per-output-channel quantization at load, shared by ``--quantization fp8`` and ``int8``:
s[n] = max_k |w[n, k]| / qmax, q = w / s clamped to [−qmax, qmax] in the storage dtype (rounded to
nearest: explicitly for an integer dtype, by the cast for a float8 one), so w ≈ q · s[:, None].
The quantized weight replaces the float one as ``layer.qweight`` [N, K]; each method stores the
scales [N] in its kernel's form (``store_scales``).
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..linear import Linear, QuantMethod


def per_channel_scales(w: torch.Tensor, absmax: torch.Tensor | None, qmax: float) -> torch.Tensor:
    """Symmetric per-output-channel scales [N] float32 of w [N, K] for a format whose largest value is
    ``qmax``: row absmax / qmax (``absmax`` [N] overrides w's own: a row-parallel shard passes its whole
    rows', ``Linear.row_absmax``, so every rank keeps the unsharded scales)."""
    a = w.float().abs().amax(dim=1) if absmax is None else absmax.float()
    return a.clamp(min=1e-12) / qmax


def quantize_per_channel(w: torch.Tensor, absmax: torch.Tensor | None, qmax: float,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float → (q [N, K] ``dtype``, s [N] float32) with w ≈ q · s[:, None]; ``absmax`` as in
    ``per_channel_scales``."""
    s = per_channel_scales(w, absmax, qmax)
    q = w.float() / s[:, None]
    if not dtype.is_floating_point:
        q = torch.round(q)  # an integer cast truncates; a float8 cast rounds to nearest itself
    return q.clamp_(-qmax, qmax).to(dtype), s


class PerChannelQuantMethod(QuantMethod):
    """A quantize-at-load method with one scale per output channel over whole rows (``uses_row_absmax``).

    Subclasses set ``name``, ``qdtype`` (storage dtype), ``qmax`` (its largest magnitude used) and
    implement ``store_scales`` and ``apply``."""

    uses_row_absmax = True
    qdtype: torch.dtype
    qmax: float

    def __init__(self, act_dtype: torch.dtype):
        self.act_dtype = act_dtype

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, s = quantize_per_channel(layer.weight.data, layer.row_absmax, self.qmax, self.qdtype)
        del layer.weight
        layer.register_buffer("qweight", q, persistent=False)
        self.store_scales(layer, s)

    @abstractmethod
    def store_scales(self, layer: Linear, s: torch.Tensor) -> None:
        """Register the scales s [N] float32 on ``layer`` (after ``layer.qweight``)."""
