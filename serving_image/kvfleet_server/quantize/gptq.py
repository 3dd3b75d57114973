"""GPTQ's error-compensating rounding onto FP8 (Frantar et al. 2023, "GPTQ: Accurate Post-Training
Quantization for Generative Pre-trained Transformers", Algorithm 1 with lazy block updates).

The grid is the fp8 method's: float8_e4m3fn codes with one scale per output row, s[n] = max_k |w[n, k]| / 448
(what ``--quantization fp8`` computes at load). Round-to-nearest rounds every weight on its own; GPTQ
rounds the columns in order and spreads each column's rounding error over the columns not yet rounded,
weighted by the inverse of the layer's input second moments H = Σ xᵀx over calibration tokens, so the
layer's output error ‖X Wᵀ − X Qᵀ‖ (not the weight error) is what is minimised. Rows are independent
given H, so the q/k/v (or gate/up) parts of a fused projection can be rounded apart with its one H.
Pure tensor functions.
"""

from __future__ import annotations

import torch

from ..model.layers.quant.fp8 import FP8_DTYPE, FP8_MAX


def gptq_fp8(w: torch.Tensor, hessian: torch.Tensor, block: int = 128,
             damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float, hessian [K, K] (Σ xᵀx of the layer's inputs, float64 preferred) →
    (w8 [N, K] float8_e4m3fn, scale [N] float32) with w ≈ w8 · scale[:, None].

    ``damp``: fraction of H's mean diagonal added to the diagonal (GPTQ's dampening; it keeps the
    Cholesky factorisation defined). Inputs that never fire (H[k, k] = 0) get weight 0 in column k.
    Raises ValueError when the shapes disagree."""
    n, k = w.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian has shape {list(hessian.shape)}, expected [{k}, {k}] for a weight [{n}, {k}]")
    W = w.double().clone()
    s = W.abs().amax(1).clamp(min=1e-12) / FP8_MAX
    H = hessian.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=H.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.empty(n, k, dtype=FP8_DTYPE)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1, E1, h1 = W[:, i1:i2].clone(), torch.zeros(n, i2 - i1, dtype=W.dtype), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = (W1[:, i] / s).clamp(-FP8_MAX, FP8_MAX).float().to(FP8_DTYPE)
            codes[:, i1 + i] = c
            err = (W1[:, i] - c.double() * s) / h1[i, i]
            W1[:, i:] -= err[:, None] * h1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ hinv[i1:i2, i2:]
    return codes, s.float()


def output_error(w: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, hessian: torch.Tensor) -> float:
    """‖X Wᵀ − X Qᵀ‖²_F over the calibration inputs, = trace((W − Q) H (W − Q)ᵀ), with Q = w8 · scale:
    the quantity GPTQ minimises (float)."""
    d = (w.double() - w8.double() * scale.double()[:, None])
    return float(((d @ hessian.double()) * d).sum())
