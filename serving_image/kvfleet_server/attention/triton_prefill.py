"""Prefill and chunked-prefill ("extend") attention in Triton over the paged cache: every chunk of a
step, of any length, in one launch (FlashAttention-2's tiling, Dao 2023; SGLang's extend_attention
and vLLM's prefix-prefill kernels solve the same problem).

Each chunk's new K/V are written to the cache first (``triton_common.store_kvcache``), so one
path covers both cases: query ``i`` of a chunk (absolute position ``prefix + i``) attends the chunk's
cached keys ``j <= prefix + i``, read in place through its block table. Grid ``(num_chunks,
num_heads, cdiv(max_q_len, BLOCK_M))``: programs past a chunk's length exit at once; the key loop
stops at the causal limit of the program's last query.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (INTERPRETED, cache_view, fp8_kind, load_kv_scales, load_kv_tiles, padded_head_dim,
                            tile_dot)


@triton.jit
def _extend_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, q_start_ptr, q_len_ptr, ctx_ptr, scales_ptr,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
                   sm_scale,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, FP8_TYPE: tl.constexpr,
                   IEEE: tl.constexpr):
    p = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q_len = tl.load(q_len_ptr + p)
    if mt * BLOCK_M < q_len:
        q_start = tl.load(q_start_ptr + p)
        ctx = tl.load(ctx_ptr + p)
        prefix = ctx - q_len
        kvh = h // GROUP
        offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        k_scale, v_scale = load_kv_scales(scales_ptr, FP8)
        qk_scale = sm_scale * 1.4426950408889634
        q_pos = prefix + offs_m  # absolute positions of the tile's queries
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        bt_row = bt_ptr + p * stride_bt
        kv_end = tl.minimum(prefix + (mt + 1) * BLOCK_M, ctx)
        for s0 in range(0, kv_end, BLOCK_N):
            tok = s0 + tl.arange(0, BLOCK_N)
            tok_mask = tok < kv_end
            k, v = load_kv_tiles(kc_ptr, vc_ptr, bt_row, tok, tok_mask, kvh, offs_d, d_mask, k_scale, v_scale,
                                 stride_cb, stride_cs, stride_ch, BLOCK_SIZE, FP8, FP8_TYPE)
            s = tile_dot(q, k, q.dtype, IEEE, True)
            s = s * qk_scale
            allowed = (tok[None, :] <= q_pos[:, None]) & tok_mask[None, :]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            pr = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            pv = tile_dot(pr, v, q.dtype, IEEE, False)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           block_tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                           ctx_lens: torch.Tensor, max_q_len: int, scale: float,
                           kv_scales: torch.Tensor | None = None, block_m: int = 32, block_n: int = 32) -> None:
    """Causal attention of prefill chunks over their paged contexts, written into ``out``.

    Args:
        q: [T, num_heads, head_dim] flat batch; chunk p's queries are rows
            [q_starts[p], q_starts[p] + q_lens[p]).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] holding every chunk's
            prefix AND its new tokens (write them first); model dtype or FP8.
        out: [T, num_heads, head_dim], only the chunks' rows are written.
        block_tables: [P, max_blocks] int; q_starts, q_lens, ctx_lens: [P] int (ctx = prefix + q_len).
        max_q_len: the longest chunk (host int: sizes the grid).
        kv_scales: float32 [2] (k_scale, v_scale) for an FP8 cache.

    fp32 queries use IEEE fp32 dot products (no TF32), so fp32 results match the fp32 reference;
    bf16 / fp16 use the tensor-core dot with fp32 accumulation. Under the interpreter every dot runs
    in fp32 (triton 3.9's interpreter computes bf16 dots wrongly), so the CPU tests check the bf16
    loads, stores and softmax but not the bf16 dot itself: benchmarks/gpu/check.sh does, on a GPU.
    """
    P = q_lens.shape[0]
    if P == 0:
        return
    T, H, D = q.shape
    nb, bs, kvh, hd = k_cache.shape
    if bs & (bs - 1) or H % kvh or hd != D:
        raise ValueError(f"paged_extend_attention: block_size {bs} must be a power of two, num_heads {H} a "
                         f"multiple of num_kv_heads {kvh}, head_dim {D} == cache head_dim {hd}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    fp8 = fp8_kind(k_cache.dtype)
    kc, vc = cache_view(k_cache), cache_view(v_cache)
    grid = (P, H, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, kc, vc, out, block_tables, q_starts, q_lens, ctx_lens, kv_scales if fp8 is not None else q_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2),
        scale,
        GROUP=H // kvh, HEAD_DIM=D, D_PAD=padded_head_dim(D), BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        FP8=fp8 is not None, FP8_TYPE=fp8 if fp8 is not None else tl.float32,
        IEEE=q.dtype == torch.float32 or INTERPRETED,
    )
