"""``--quantization int8``: W8A16, one symmetric scale per output channel (weight-only).

At load (``per_channel``): s[n] = max_k |w[n, k]| / 127, q = round(w / s) clamped to [−127, 127] (int8).
Matmul, by where the layer lives:
- CPU with kvfleet's AVX2 kernels (x86-64-v3): q is repacked into 16-column panels
  ``layer.qweight_panels`` [ceil(N / 16), K, 16] int8 (the layout of the float32 panel linears,
  ``cpu_prepack.pack_panels``) and multiplied by ``torch.ops.kvfleet.linear_packed_int8_cpu``
  (attention/csrc/linear_cpu.cpp): each row of 16 weights is widened to float32 in registers, products
  accumulated in float32, scaled once per output; x is taken in float32 (bfloat16 activations are
  widened exactly) and y rounded to the activation dtype. It streams a quarter of float32's bytes per
  weight; torch's ``_weight_int8pack_mm`` was no faster than bfloat16 ``F.linear`` at one row on this
  AVX2 CPU.
- other CPUs: ``torch.ops.aten._weight_int8pack_mm(x, q [N, K], s [N])`` (vectorized for bfloat16
  activations on x86; float32 works, slower);
- elsewhere, the documented fallback dequantizes q · s to the activation dtype per matmul and calls
  ``F.linear``.
Scales are per output row, so a column-parallel shard keeps its rows' scales; a row-parallel one computes them
over whole rows (``Linear.row_absmax``).
Reference: gpt-fast's int8 weight-only quantization (pytorch-labs/gpt-fast, quantize.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear import Linear
from .per_channel import PerChannelQuantMethod


def _panels_available() -> bool:
    from ..cpu_prepack import PanelLinearMethod, packed_method

    return packed_method() is PanelLinearMethod


class Int8LinearMethod(PerChannelQuantMethod):
    name = "int8"
    qdtype = torch.int8
    qmax = 127.0

    def store_scales(self, layer: Linear, s: torch.Tensor) -> None:
        layer.register_buffer("scales", s.to(self.act_dtype), persistent=False)

    def process_weights_after_loading(self, layer: Linear) -> None:
        super().process_weights_after_loading(layer)
        if layer.qweight.device.type == "cpu" and _panels_available():
            from ..cpu_prepack import PANEL, pack_panels

            panels = pack_panels(layer.qweight)
            scales = torch.zeros(panels.shape[0] * PANEL, dtype=torch.float32)
            scales[:layer.qweight.shape[0]] = layer.scales.float()  # the same (act-dtype) values as q · s
            del layer.qweight
            layer.register_buffer("qweight_panels", panels, persistent=False)
            layer.register_buffer("panel_scales", scales, persistent=False)

    @staticmethod
    def dequantize(layer: Linear) -> torch.Tensor:
        """The weight the layer multiplies by, q · s [N, K] float32 (whichever layout holds q)."""
        if hasattr(layer, "qweight_panels"):
            p, k, c = layer.qweight_panels.shape
            q = layer.qweight_panels.transpose(1, 2).reshape(p * c, k)[:layer.output_size]
        else:
            q = layer.qweight
        return q.float() * layer.scales.float()[:, None]

    def apply(self, layer, x, bias):
        if hasattr(layer, "qweight_panels") and x.device.type == "cpu":
            n = layer.output_size
            y = torch.ops.kvfleet.linear_packed_int8_cpu(x.reshape(-1, x.shape[-1]).float(), layer.qweight_panels,
                                                        layer.panel_scales, n, None)
            y = y.view(*x.shape[:-1], n).to(x.dtype)
        elif x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), layer.qweight, layer.scales.to(x.dtype))
        else:
            y = F.linear(x, layer.qweight.to(x.dtype) * layer.scales.to(x.dtype)[:, None])
        return y if bias is None else y + bias
