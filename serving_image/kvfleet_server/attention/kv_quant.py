"""FP8 KV cache: K and V stored as 8-bit floats with one scale per layer for K and one for V
(vLLM's ``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2``; fp8 means e4m3).

Stored value = clamp(x / scale, ±max) as float8; read value = stored · scale in the model dtype.
Scales come from the checkpoint (``self_attn.k_scale`` / ``v_scale``) or, when it has none, from the
first tokens written to the layer (the engine's first prefill): scale = absmax · HEADROOM / max,
fixed from then on so that cached blocks (prefix caching, copy-on-write, recompute after
preemption) always decode with the scale they were written with. Later values beyond the headroom
saturate at ±max.

Per layer the scales live in a float32 tensor [2] = (k_scale, v_scale); 0 means "not calibrated yet".

Rotation (``hadamard``): with engine-calibrated scales, each layer's q, k (after RoPE) and v enter the
attention backend multiplied by an orthonormal Hadamard matrix H over head_dim, and its output is
multiplied by H again (H = Hᵀ = H⁻¹): q·k and the attention-weighted sum of v are unchanged in exact
arithmetic, but the few large channels of K (RoPE's low frequencies) are spread over all of head_dim
before e4m3 rounds them, so the rounding errors of a score no longer add up in the channels that
dominate it (QuaRot, Ashkboos et al. 2024, rotates K and Q so). Measured on SmolLM2-135M in float32
(docs/quantization.md, 4 × 1024 windows): perplexity +0.4–0.6% against +1.4% without it. Layers whose
scales come from a checkpoint are not rotated (those scales were calibrated on the plain K/V); in a model
where only some layers have them, the others get the identity matrix, so that every layer runs the same
code (one compiled graph per piece).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("kvfleet.engine")

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: calibration headroom over the first prefill's absmax (e4m3 keeps ~3 significant bits at any
#: magnitude, so headroom costs little precision and guards against later, larger values)
HEADROOM = 4.0


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """"auto" → the model dtype; fp8 names → their float8 dtype. Raises ValueError for another name."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def hadamard(n: int, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor | None:
    """The orthonormal Sylvester-Hadamard matrix [n, n] (symmetric, its own inverse) in ``dtype``, or None
    when ``n`` is not a power of 2 (no Sylvester construction; the cache is then not rotated)."""
    if n < 1 or n & (n - 1):
        return None
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] @ r [head_dim, head_dim] in x's dtype. ``r`` is float32 (``hadamard``'s entries
    ±1/√n are not exact in bfloat16 or float16 when n is not a power of 4: at n = 128 a bfloat16 H
    scaled a round trip x·H·H by a systematic 1 − 7e-5), so a lower-precision x is multiplied in
    float32 and rounded once."""
    return x @ r if x.dtype == r.dtype else (x.float() @ r).to(x.dtype)


def calibrate(scales: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8: torch.dtype) -> None:
    """Set an uncalibrated layer's (k_scale, v_scale) from the absmax of its first K/V rows
    ([T, kv_heads, head_dim] each), with HEADROOM."""
    fmax = torch.finfo(fp8).max
    absmax = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
    scales.copy_((absmax * HEADROOM / fmax).clamp(min=1e-8))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("KV cache %s: a layer's k_scale %.3g, v_scale %.3g (first prefill's absmax x%.0f)", fp8,
                     *scales.tolist(), HEADROOM)


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(fp8).max
    return (x.float() / scale).clamp_(-fmax, fmax).to(fp8)


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x8.to(dtype) * scale.to(dtype)
