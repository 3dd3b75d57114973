"""``--quantization int8``: W8A16, one symmetric scale per output channel (weight-only).

At load (``per_channel``): s[n] = max_k |w[n, k]| / 127, q = round(w / s) clamped to [−127, 127] (int8).
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

from ..linear import Linear
from .per_channel import PerChannelQuantMethod


class Int8LinearMethod(PerChannelQuantMethod):
    name = "int8"
    qdtype = torch.int8
    qmax = 127.0

    def store_scales(self, layer: Linear, s: torch.Tensor) -> None:
        layer.register_buffer("scales", s.to(self.act_dtype), persistent=False)

    def apply(self, layer, x, bias):
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), layer.qweight, layer.scales.to(x.dtype))
        else:
            y = F.linear(x, layer.qweight.to(x.dtype) * layer.scales.to(x.dtype)[:, None])
        return y if bias is None else y + bias
