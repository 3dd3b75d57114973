"""``--quantization int4``: W4A16, asymmetric groups of 32 along K (weight-only).

At load, per group of 32 inputs of an output row: s = (max − min) / 15, m = min, q = round((w − m) / s)
∈ [0, 15], so w ≈ q · s + m (gpt-fast's groupwise int4, pytorch-labs/gpt-fast quantize.py). Storage
and kernels: ``int4_layout`` (the CPU tinygemm kernel ``_weight_int4pack_mm_for_cpu`` for bf16/fp16
activations; an exact dequantize-per-matmul path for float32 and other devices). K not divisible by
32 is zero-padded to the next multiple of 32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear import Linear, QuantMethod
from . import int4_layout
from .int4_layout import GROUP


def quantize_groupwise_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float → (q [N, Kp] uint8 in [0, 15], s [N, Kp/32], m [N, Kp/32] float32), Kp = K rounded
    up to 32 (padding columns are zero weights)."""
    N, K = w.shape
    Kp = int4_layout.pad_k(K)
    w = F.pad(w.float(), (0, Kp - K)).view(N, Kp // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    s = ((hi - lo) / 15.0).clamp(min=1e-10)
    q = torch.round((w - lo[..., None]) / s[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.view(N, Kp), s, lo


class Int4LinearMethod(QuantMethod):
    name = "int4"

    def __init__(self, act_dtype: torch.dtype):
        self.act_dtype = act_dtype

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, s, m = quantize_groupwise_int4(layer.weight.data)
        del layer.weight
        int4_layout.store(layer, q, s, m, self.act_dtype)

    def apply(self, layer, x, bias):
        y = int4_layout.matmul(layer, x)
        return y if bias is None else y + bias
