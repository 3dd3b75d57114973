"""Pieces the Triton attention kernels share: the KV-cache write (slot mapping), loading a tile of
paged K/V through a block table (and the FP8 scales), the tile dot products, and the launch-side
helpers (dtype views, padded head_dim).

The KV cache layout is ``backend.py``'s: K and V each ``[num_blocks, block_size, num_kv_heads,
head_dim]``; token ``t`` of a sequence sits at block ``block_table[t // block_size]``, offset
``t % block_size``. An FP8 cache is passed to the kernels as its uint8 view (bit-cast back to float8
in the kernel, then multiplied by the layer's scale: dequantize on load, vLLM's per-tensor scheme).

Slot ``-1`` (``PAD_SLOT_ID``, vLLM's convention) marks a padded row (CUDA-graph batch padding): the
write kernel skips it, so padded rows never touch a real block.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import kv_quant


#: running under the Triton interpreter (TRITON_INTERPRET=1: the CPU tests)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


def fp8_kind(dtype: torch.dtype):
    """The Triton float8 type of an FP8 cache dtype, or None for a cache in the model dtype."""
    return _TL_FP8.get(dtype)


def cache_view(cache: torch.Tensor) -> torch.Tensor:
    """The tensor handed to the kernels: an FP8 cache as uint8 (bit-cast back in the kernel)."""
    return cache.view(torch.uint8) if cache.dtype in _TL_FP8 else cache


def padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to a power of two (at least 16, the smallest tl.dot operand); the extra lanes
    are masked."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def load_kv_tile(cache_ptr, bt_row_ptr, tok, tok_mask, kvh, offs_d, d_mask, scale,
                 stride_cb, stride_cs, stride_ch,
                 BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_TYPE: tl.constexpr):
    """K or V rows of token positions ``tok`` ([N]) of one sequence, kv head ``kvh``: [N, D_PAD] float32.

    The block of each token is read from the sequence's block table (``bt_row_ptr``), so the rows are
    read in place from their blocks, never gathered into a copy."""
    blk = tl.load(bt_row_ptr + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    off = (tok % BLOCK_SIZE).to(tl.int64)
    ptrs = cache_ptr + blk[:, None] * stride_cb + off[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
    m = tok_mask[:, None] & d_mask[None, :]
    if FP8:
        raw = tl.load(ptrs, mask=m, other=0)
        x = raw.to(FP8_TYPE, bitcast=True).to(tl.float32) * scale
    else:
        x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    return x


@triton.jit
def load_kv_tiles(kc_ptr, vc_ptr, bt_row_ptr, tok, tok_mask, kvh, offs_d, d_mask, k_scale, v_scale,
                  stride_cb, stride_cs, stride_ch,
                  BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_TYPE: tl.constexpr):
    """The K and V tiles (``load_kv_tile`` of each cache with its scale): two [N, D_PAD] float32."""
    k = load_kv_tile(kc_ptr, bt_row_ptr, tok, tok_mask, kvh, offs_d, d_mask, k_scale,
                     stride_cb, stride_cs, stride_ch, BLOCK_SIZE, FP8, FP8_TYPE)
    v = load_kv_tile(vc_ptr, bt_row_ptr, tok, tok_mask, kvh, offs_d, d_mask, v_scale,
                     stride_cb, stride_cs, stride_ch, BLOCK_SIZE, FP8, FP8_TYPE)
    return k, v


@triton.jit
def load_kv_scales(scales_ptr, FP8: tl.constexpr):
    """The layer's (k_scale, v_scale): float32 [2] at ``scales_ptr`` for an FP8 cache, (1.0, 1.0) for a
    cache in the model dtype (``scales_ptr`` is then not read)."""
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(scales_ptr)
        v_scale = tl.load(scales_ptr + 1)
    return k_scale, v_scale


@triton.jit
def tile_dot(a, b, DTYPE: tl.constexpr, IEEE: tl.constexpr, TRANS_B: tl.constexpr):
    """``a @ b`` (``a @ b.T`` when ``TRANS_B``): [M, K] x [K, N] -> [M, N] float32, float32
    accumulation. IEEE float32 products (no TF32) when ``IEEE``, else the tensor-core dot of the
    operands cast to ``DTYPE`` (the query's dtype; ``b`` is cast before it is transposed)."""
    if IEEE:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    else:
        a = a.to(DTYPE)
        b = b.to(DTYPE)
    if TRANS_B:
        b = tl.trans(b)
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cb, stride_cs, stride_ch,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, D_PAD)
        dm = d < HEAD_DIM
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dm)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dm)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
        tl.store(kc_ptr + dst, k, mask=dm)
        tl.store(vc_ptr + dst, v, mask=dm)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write new K/V rows into their cache slots in place (vLLM's reshape_and_cache).

    k, v: [T, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]; slot_mapping: [T] int64 flat slots, PAD_SLOT_ID rows skipped; kv_scales: float32 [2]
    (k_scale, v_scale) for an FP8 cache, else None. An FP8 cache gets ``kv_quant.quantize``'s values
    (the oracle's, bit for bit; the kernel moves the bytes).
    Returns the (k, v) rows as stored (quantized for FP8)."""
    T, kvh, hd = k.shape
    if kv_scales is not None:
        k = kv_quant.quantize(k, kv_scales[0], k_cache.dtype)
        v = kv_quant.quantize(v, kv_scales[1], v_cache.dtype)
    if T == 0:
        return k, v
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    kc, vc = cache_view(k_cache), cache_view(v_cache)
    kw, vw = cache_view(k), cache_view(v)
    _store_kvcache_kernel[(T, kvh)](
        kw, vw, kc, vc, slot_mapping,
        kw.stride(0), kw.stride(1), vw.stride(0), vw.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        HEAD_DIM=hd, D_PAD=triton.next_power_of_2(hd), BLOCK_SIZE=k_cache.shape[1],
    )
    return k, v
