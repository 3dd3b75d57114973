"""Rotary position embeddings (RoFormer, Su et al. 2021) in the "rotate half" layout used by
Hugging Face Llama/Qwen2, with rope scaling types "linear" and "llama3" (Llama 3.1).

The inverse frequencies and the cos/sin tables are computed exactly as transformers computes them
(float32, ``positions ⊗ inv_freq``), so logits match transformers to float rounding.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, shape [head_dim // 2], float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    rtype = scaling["rope_type"]
    if rtype == "freq_factors":  # llama.cpp GGUFs store Llama-3.1 scaling as per-frequency divisors
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    factor = float(scaling["factor"])
    if rtype == "linear":
        return inv_freq / factor
    if rtype == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unknown rope_type {rtype!r}")


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_positions, head_dim] float32 (both halves repeated)."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = (inv_freq[:, None].float() @ pos[None, :]).t()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim] (already in x's dtype)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
