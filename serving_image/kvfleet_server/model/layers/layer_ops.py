"""A decoder layer's element-wise work between its matmuls and attention: RMSNorm, residual add +
RMSNorm, rotate-half RoPE and SiLU-and-mul, behind one small interface with two implementations.

- ``TorchLayerOps`` — the reference: transformers' operator-by-operator math (modeling_llama). It is
  what the model runs on CUDA, under torch.compile (Inductor fuses it there), and the oracle for the
  kernels.
- ``CpuLayerOps`` — kvfleet's fused C++ kernels (``attention/csrc/layer_ops_cpu.cpp``, vLLM's CPU
  ``rms_norm`` / ``fused_add_rms_norm`` / ``rotary_embedding`` / ``silu_and_mul``): one pass over
  memory and one dispatch per op instead of five to seven. ``executor/engine_setup.prepare_model``
  switches an eager CPU model to it (``use_layer_ops``) when the kernel library builds.

Both give the same values up to float32 rounding (the sum of squares in RMSNorm is reduced in another
order; SiLU's exponential is a polynomial, relative error ~2e-7): tests/server/test_cpu_layer_ops.py
checks each op against the reference, and greedy tokens against transformers on the real model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rope import apply_rope


class TorchLayerOps:
    """The reference ops (any device, any float dtype)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, hidden] → weight * x / sqrt(mean(x²) + eps), computed in float32 (transformers' RMSNorm)."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(rms_norm(residual + x), residual + x): the residual add before a layer's norm. x, residual:
        [T, hidden]; neither input is modified."""
        h = residual + x
        return cls.rms_norm(h, weight, eps), h

    @staticmethod
    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotate-half RoPE (Su et al. 2021). q [T, heads, head_dim], k [T, kv_heads, head_dim]; cos, sin
        [T, 1, head_dim] in q's dtype. Returns new (q, k)."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] (gate ‖ up) → silu(gate) * up [T, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuLayerOps(TorchLayerOps):
    """The same ops in kvfleet's C++ CPU kernels (float32 / bfloat16 / float16 CPU tensors).

    ``rope`` rotates q and k in place (they are fresh views of the qkv projection's output);
    ``add_rms_norm`` writes the sum into ``x`` (the fresh o_proj output), never into ``residual``."""

    def __init__(self):
        ops = torch.ops.kvfleet
        self._rms, self._add_rms = ops.rms_norm_cpu, ops.fused_add_rms_norm_cpu
        self._rope, self._silu_mul = ops.rotary_embedding_cpu, ops.silu_and_mul_cpu

    def rms_norm(self, x, weight, eps):
        out = torch.empty_like(x)
        self._rms(out, x, weight, eps)
        return out

    def add_rms_norm(self, x, residual, weight, eps):
        out = torch.empty_like(x)
        self._add_rms(out, x, residual, weight, eps)  # x += residual, out = rms_norm(x)
        return out, x

    def rope(self, q, k, cos, sin):
        self._rope(q, k, cos.squeeze(1), sin.squeeze(1))
        return q, k

    def silu_and_mul(self, x):
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        self._silu_mul(out, x)
        return out


TORCH_OPS = TorchLayerOps()


def cpu_layer_ops() -> CpuLayerOps | None:
    """The fused CPU ops, or None when kvfleet's CPU kernel library cannot be built here (see
    ``attention.cpu_ext.load_error``)."""
    from ...attention.cpu_ext import load

    return CpuLayerOps() if load() is not None else None


def use_layer_ops(model: torch.nn.Module, ops: TorchLayerOps) -> None:
    """Run ``model``'s decoder layers and final norm with ``ops``."""
    model.layer_ops = ops
    for layer in model.layers:
        layer.ops = ops
