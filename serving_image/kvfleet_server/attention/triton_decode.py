"""Paged decode attention in Triton: one query token per sequence over its cached context, read in
place through the block table (no gather), split over the context (flash-decoding, Dao et al. 2023;
vLLM's paged attention v2 / SGLang's decode_attention kernels follow the same plan).

Grid ``(num_seqs, num_kv_heads, num_splits)``: one program takes all ``G = num_heads / num_kv_heads``
query heads of one kv head (GQA: each K/V tile is loaded once for the whole group; the heads are the
rows of tl.dot, padded to 16 as in SGLang's grouped decode kernel) over one slice of the context, keeping an online softmax (running max, sum, weighted V). A second kernel merges the
slices with their log-sum-exp. The context length is read on the device, so the launch depends only
on shapes (a CUDA graph can replay it for any context up to the block table's width); splits past a
sequence's context exit at once.

Supported: any power-of-two block size, any head_dim (padded to a power of two, masked), query in
float32 / bfloat16 / float16, a cache in the model dtype or FP8 (e4m3 / e5m2, per-layer scales,
dequantized on load).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (INTERPRETED, cache_view, fp8_kind, load_kv_scales, load_kv_tiles, padded_head_dim,
                            tile_dot)


@triton.jit
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, scales_ptr, o_part_ptr, lse_ptr,
                         stride_qt, stride_qh, stride_bt, stride_cb, stride_cs, stride_ch,
                         sm_scale, NUM_SPLITS,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, FP8: tl.constexpr, FP8_TYPE: tl.constexpr,
                         IEEE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    # each split takes a whole number of BLOCK_N tiles
    tiles = tl.cdiv(ctx, BLOCK_N)
    tiles_per_split = tl.cdiv(tiles, NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    # the group's query heads as the M rows of the dots (padded to 16 rows, tl.dot's minimum)
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    k_scale, v_scale = load_kv_scales(scales_ptr, FP8)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for s0 in range(start, end, BLOCK_N):
        tok = s0 + tl.arange(0, BLOCK_N)
        tok_mask = tok < end
        k, v = load_kv_tiles(kc_ptr, vc_ptr, bt_row, tok, tok_mask, kvh, offs_d, d_mask, k_scale, v_scale,
                             stride_cb, stride_cs, stride_ch, BLOCK_SIZE, FP8, FP8_TYPE)
        s = tile_dot(q, k, q.dtype, IEEE, True)
        s = tl.where(tok_mask[None, :], s * qk_scale, float("-inf"))  # [G_PAD, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tile_dot(p, v, q.dtype, IEEE, False)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # partial results: o = acc / l, lse (base 2) = m + log2(l); an empty split leaves lse = -inf
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    H = tl.num_programs(1) * GROUP
    row = (b * H + heads) * NUM_SPLITS + split
    tl.store(o_part_ptr + row[:, None] * D_PAD + offs_d[None, :], o, mask=g_mask[:, None])
    tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(o_part_ptr, lse_ptr, out_ptr, stride_ot, stride_oh, NUM_SPLITS,
                          S_PAD: tl.constexpr,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    base = (b * H + h) * NUM_SPLITS
    lse = tl.load(lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty context (a padded row): output zeros
    w = tl.exp2(lse - m)
    o = tl.load(o_part_ptr + (base + offs_s)[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    den = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                       num_sms: int = 132) -> int:
    """Context splits per sequence: enough programs for ~2 waves over ``num_sms`` multiprocessors, no
    slice shorter than 256 tokens, at most 64 (pure, host-side: depends only on shapes)."""
    programs = max(1, num_seqs * num_kv_heads)
    want = -(-2 * num_sms // programs)
    by_len = max(1, (max_blocks * block_size) // 256)
    return int(max(1, min(want, by_len, 64)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           kv_scales: torch.Tensor | None = None, num_splits: int | None = None,
                           out: torch.Tensor | None = None, block_n: int = 64) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged context.

    Args:
        q: [B, num_heads, head_dim] (float32 / bfloat16 / float16), head h uses kv head
            h // (num_heads / num_kv_heads).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], the model dtype or FP8.
        block_tables: [B, max_blocks] int (entries past a sequence's context are never read).
        context_lens: [B] int, tokens of each sequence in the cache (its new token included); 0 gives
            a zero output row (a padded row).
        scale: softmax scale (head_dim ** -0.5).
        kv_scales: float32 [2] (k_scale, v_scale) for an FP8 cache.
        num_splits: context splits (``default_num_splits`` when None).
        out: optional [B, num_heads, head_dim] output (CUDA graphs reuse a static one).

    Returns [B, num_heads, head_dim] in q's dtype. Raises ValueError for a block size that is not a
    power of two or head counts that do not divide.
    """
    B, H, D = q.shape
    nb, bs, kvh, hd = k_cache.shape
    if bs & (bs - 1) or H % kvh or hd != D:
        raise ValueError(f"paged_decode_attention: block_size {bs} must be a power of two, num_heads {H} a "
                         f"multiple of num_kv_heads {kvh}, head_dim {D} == cache head_dim {hd}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    group = H // kvh
    d_pad = padded_head_dim(D)
    splits = num_splits or default_num_splits(B, kvh, block_tables.shape[1], bs,
                                              _num_sms(q.device))
    o_part = torch.empty(B * H * splits, d_pad, dtype=torch.float32, device=q.device)
    lse = torch.empty(B * H * splits, dtype=torch.float32, device=q.device)
    fp8 = fp8_kind(k_cache.dtype)
    kc, vc = cache_view(k_cache), cache_view(v_cache)
    _decode_split_kernel[(B, kvh, splits)](
        q, kc, vc, block_tables, context_lens, kv_scales if fp8 is not None else context_lens, o_part, lse,
        q.stride(0), q.stride(1), block_tables.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
        scale, splits,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, D_PAD=d_pad,
        BLOCK_SIZE=bs, BLOCK_N=block_n, FP8=fp8 is not None, FP8_TYPE=fp8 if fp8 is not None else tl.float32,
        IEEE=q.dtype == torch.float32 or INTERPRETED,
    )
    _decode_reduce_kernel[(B, H)](
        o_part, lse, out, out.stride(0), out.stride(1), splits,
        S_PAD=triton.next_power_of_2(splits), HEAD_DIM=D, D_PAD=d_pad,
    )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter on the CPU: a few splits, so that the merge is exercised
