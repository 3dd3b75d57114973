"""``--quantization int8``: W8A16, one symmetric scale per output channel (weight-only).

At load: s[n] = max_k |w[n, k]| / 127, q = round(w / s) clamped to [−127, 127] (int8).
Matmul: ``torch.ops.aten._weight_int8pack_mm(x, q [N, K], s [N])`` on the CPU (vectorized for
bfloat16 activations on x86; float32 works, slower); elsewhere the documented fallback
dequantizes q · s to the activation dtype per matmul and calls ``F.linear``.
Scales are per output row, so a column-parallel shard keeps its rows' scales; a row-parallel one computes them
over whole rows (``Linear.row_absmax``).
Reference: gpt-fast's int8 weight-only quantization (pytorch-labs/gpt-fast, quantize.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear import Linear, QuantMethod, per_channel_scales


def quantize_per_channel_int8(w: torch.Tensor,
                              absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float → (q [N, K] int8, s [N] float32) with w ≈ q · s[:, None].

    ``absmax`` [N]: the rows' absolute maxima to scale by (default: w's own; a row-parallel shard
    passes those of its whole rows, ``Linear.row_absmax``, so every rank keeps the unsharded scales)."""
    s = per_channel_scales(w, absmax, 127.0)
    q = torch.round(w.float() / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


class Int8LinearMethod(QuantMethod):
    name = "int8"
    uses_row_absmax = True

    def __init__(self, act_dtype: torch.dtype):
        self.act_dtype = act_dtype

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, s = quantize_per_channel_int8(layer.weight.data, layer.row_absmax)
        del layer.weight
        layer.register_buffer("qweight", q, persistent=False)
        layer.register_buffer("scales", s.to(self.act_dtype), persistent=False)

    def apply(self, layer, x, bias):
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), layer.qweight, layer.scales.to(x.dtype))
        else:
            y = F.linear(x, layer.qweight.to(x.dtype) * layer.scales.to(x.dtype)[:, None])
        return y if bias is None else y + bias
