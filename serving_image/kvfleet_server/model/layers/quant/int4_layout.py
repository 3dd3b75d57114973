"""Shared storage of asymmetric 4-bit weights in groups of 32 along K (used by ``int4.py`` and by
GGUF Q4_0 / Q4_1): w[n, k] = q[n, k] · s[n, g] + m[n, g] with q ∈ [0, 15], g = k // 32.

Two kernels, chosen by activation dtype at load:
- bfloat16 / float16 on the CPU: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (the tinygemm CPU
  kernel). Its convention, checked against the float formula in tests: w = (q − 8) · scale + zero,
  so scale = s and zero = m + 8·s, packed as ``scales_and_zeros [K/32, N, 2]`` in the activation dtype.
- float32, N not divisible by 16 (the packing's limit), or any other device: q kept as nibbles ``[N, K/2] uint8`` with s and m in float32; each
  matmul dequantizes exactly the formula above (bit-identical to ``gguf.dequantize`` for Q4_0/Q4_1)
  and calls ``F.linear``. The CPU kernel is not vectorized for float32 (measured ~20× slower than a
  dense float32 matmul), so float32 takes this exact path.
K not divisible by 32 is padded at load with zero weights (before quantization) to the next multiple
of 32, and the activations are zero-padded per call, so the padding contributes nothing (its bytes
count in ``weight_bytes``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP = 32


def pad_k(k: int, group: int = GROUP) -> int:
    return -(-k // group) * group


def use_cpu_kernel(device: torch.device, act_dtype: torch.dtype, n: int = 16) -> bool:
    """The CPU kernels run bf16/fp16 activations; the int4 packing also needs N divisible by 16."""
    return device.type == "cpu" and act_dtype in (torch.bfloat16, torch.float16) and n % 16 == 0


def store(layer, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, act_dtype: torch.dtype) -> None:
    """Register the layer's int4 buffers from q [N, Kp] (ints in [0, 15]), s, m [N, Kp/32] float32
    (Kp a multiple of 32, already padded)."""
    N, Kp = q.shape
    layer.int4_k_padded = Kp
    layer.int4_cpu_kernel = use_cpu_kernel(q.device, act_dtype, N)
    if layer.int4_cpu_kernel:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        sz = torch.stack([s.t(), (m + 8 * s).t()], dim=-1).to(act_dtype).contiguous()  # [Kp/32, N, 2]
        layer.register_buffer("qweight", packed, persistent=False)
        layer.register_buffer("scales_and_zeros", sz, persistent=False)
    else:
        qb = q.to(torch.uint8)
        nib = (qb[:, 0::2] | (qb[:, 1::2] << 4)).contiguous()  # [N, Kp/2]: low nibble = even k
        layer.register_buffer("qweight", nib, persistent=False)
        layer.register_buffer("scales", s.float().contiguous(), persistent=False)
        layer.register_buffer("mins", m.float().contiguous(), persistent=False)


def dequantize(layer, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The layer's weight [N, Kp] as floats (exact formula; for the fallback path and for tests)."""
    if layer.int4_cpu_kernel:
        eye = torch.eye(layer.int4_k_padded, dtype=layer.scales_and_zeros.dtype)
        return matmul(layer, eye).t().to(dtype)
    nib = layer.qweight
    N = nib.shape[0]
    q = torch.stack((nib & 15, nib >> 4), dim=-1)  # [N, Kp / 2, 2]: low nibble first (no out=: traceable)
    w = q.view(N, -1, GROUP).to(torch.float32)
    w = w.mul_(layer.scales[..., None]).add_(layer.mins[..., None]).view(N, -1)
    return w.to(dtype)


def matmul(layer, x: torch.Tensor) -> torch.Tensor:
    """x [T, K] → [T, N] in x's dtype."""
    if x.shape[-1] != layer.int4_k_padded:
        x = F.pad(x, (0, layer.int4_k_padded - x.shape[-1]))
    if layer.int4_cpu_kernel:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), layer.qweight, GROUP,
                                                           layer.scales_and_zeros)
    return F.linear(x, dequantize(layer, x.dtype))
