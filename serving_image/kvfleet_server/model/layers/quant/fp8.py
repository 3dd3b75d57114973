"""``--quantization fp8``: weights of an unquantized checkpoint quantized at load to float8_e4m3fn
with one scale per output channel: s[n] = max_k |w[n, k]| / 448, w8 = (w / s) as e4m3.

Matmul:
- CUDA with compute capability ≥ 8.9 (Ada, Hopper and later): ``torch._scaled_mm`` with dynamic
  per-token activation scales (x8 = x / s_x, s_x[t] = max |x[t]| / 448) and the per-channel weight
  scales ("row-wise" scaling, bfloat16 output); used when K and N are multiples of 16, else weight-only.
  Checked on an H200 against float32 on the same FP8 operands (relative error 1.7e-3; docs/gpu.md).
- elsewhere, weight-only: FP8 storage (half of bf16's bytes, a quarter of fp32's), upcast to the
  activation dtype per matmul, then y · s. The engine logs which path a run takes. On the CPU the
  upcast is a 256-entry lookup table (every e4m3 code's value in the activation dtype) gathered over
  the weight's bytes: exact, and 3× faster than torch's float8 → float cast, which the CPU does one
  element at a time (measured 15 ms vs 50 ms for a 3072×576 weight, one thread).
Following vLLM's Fp8LinearMethod for unquantized checkpoints (dynamic scheme), with per-channel
instead of per-tensor weight scales.

A checkpoint already in FP8 (``serialized``: compressed-tensors float-quantized, e.g. ``kvfleet-quantize``'s
GPTQ rounding, or vLLM's per-tensor ``fp8``; see ``kvfleet_server/checkpoint_quantization.py``) is loaded as
stored: ``weight`` [N, K] float8_e4m3fn and ``weight_scale`` — [rows, 1] / [rows] per channel, or one value per checkpoint
tensor, which becomes that shard's rows' scale (exact: fused q/k/v and gate/up keep their own scales) —
then served by the same kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear import Linear, set_weight_attrs
from .per_channel import PerChannelQuantMethod, quantize_per_channel

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def quantize_per_channel_fp8(w: torch.Tensor,
                              absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float → (w8 [N, K] float8_e4m3fn, s [N] float32) with w ≈ w8 · s[:, None].

    ``absmax`` [N]: the rows' absolute maxima to scale by (default: w's own; a row-parallel shard
    passes those of its whole rows, ``Linear.row_absmax``, so every rank keeps the unsharded scales)."""
    return quantize_per_channel(w, absmax, FP8_MAX, FP8_DTYPE)


def cuda_supports_scaled_mm(device: torch.device) -> bool:
    """True on CUDA devices with compute capability ≥ 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8LinearMethod(PerChannelQuantMethod):
    """fp8 weights with one float32 scale per output row; ``serialized``: loaded from an FP8 checkpoint."""

    name = "fp8"
    qdtype = FP8_DTYPE
    qmax = FP8_MAX

    def __init__(self, act_dtype: torch.dtype, serialized: bool = False):
        super().__init__(act_dtype)
        self.serialized = serialized
        self.uses_row_absmax = not serialized  # the checkpoint's scales, not the rows' absmax

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        """Serialized: ``weight`` [N, K] float8_e4m3fn (the checkpoint's codes, cut per rank like a float
        weight) and ``weight_scale`` [N] float32 (``_scale_loader``); else the float weight to quantize."""
        if not self.serialized:
            return super().create_weights(layer, input_size, output_sizes, params_dtype)
        n = sum(output_sizes)
        w = torch.nn.Parameter(torch.empty(n, input_size, dtype=FP8_DTYPE), requires_grad=False)
        set_weight_attrs(w, weight_loader=layer.weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", w)
        s = torch.nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(s, weight_loader=_scale_loader(layer), output_dim=0, input_dim=None)
        layer.register_parameter("weight_scale", s)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if not self.serialized:
            return super().process_weights_after_loading(layer)
        q, s = layer.weight.data, layer.weight_scale.data
        del layer.weight, layer.weight_scale
        layer.register_buffer("qweight", q, persistent=False)
        self.store_scales(layer, s)

    def store_scales(self, layer: Linear, s: torch.Tensor) -> None:
        layer.register_buffer("weight_scale", s, persistent=False)
        N, K = layer.qweight.shape
        layer.fp8_scaled_mm = cuda_supports_scaled_mm(layer.qweight.device) and K % 16 == 0 and N % 16 == 0

    def apply(self, layer, x, bias):
        if layer.fp8_scaled_mm:
            return _scaled_mm_rowwise(x, layer.qweight, layer.weight_scale, bias)
        y = F.linear(x, upcast(layer.qweight, x.dtype)) * layer.weight_scale.to(x.dtype)
        return y if bias is None else y + bias


def _scale_loader(layer: Linear):
    """weight_loader of a serialized ``weight_scale``: a per-channel checkpoint scale ([rows, 1] or [rows])
    is cut and copied like the weight's rows; a per-tensor one (one value) fills its shard's rows."""
    def load(param, loaded, shard_id=None):
        loaded = loaded.float()
        if loaded.numel() == 1:
            start, size = layer.shard_offset(shard_id)
            param.data.narrow(0, start, size).fill_(float(loaded.reshape(())))
        else:
            layer.weight_loader(param, loaded.reshape(-1), shard_id)
    return load


_LUTS: dict[tuple[torch.dtype, torch.dtype], torch.Tensor] = {}


def upcast(w8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w8 [N, K] float8 → [N, K] ``dtype``, the same values as ``w8.to(dtype)``. On the CPU through a
    lookup table of the 256 codes indexed by the weight's bytes (int32 indices for ``index_select``)."""
    if w8.device.type != "cpu":
        return w8.to(dtype)
    lut = _LUTS.get((w8.dtype, dtype))
    if lut is None:
        lut = _LUTS[(w8.dtype, dtype)] = torch.arange(256, dtype=torch.uint8).view(w8.dtype).to(dtype)
    return lut.index_select(0, w8.view(torch.uint8).view(-1).to(torch.int32)).view(w8.shape)


def _scaled_mm_rowwise(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """FP8 × FP8 GEMM with per-token (rows of x) and per-channel (rows of w) scales on sm ≥ 8.9."""
    x_scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [T, 1]
    x8 = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1).float(),
                         out_dtype=torch.bfloat16)
    y = y.to(x.dtype)
    return y if bias is None else y + bias
