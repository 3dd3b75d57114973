"""PyTorch reference attention backend (CPU and any device): K/V are gathered through the block
table and fed to ``torch.nn.functional.scaled_dot_product_attention`` (GQA via ``enable_gqa``).

Decodes of a step run as batched SDPA calls (one per group of similar context length) over their
gathered, padded contexts, with the query heads of a kv head folded into the query axis; each prefill
chunk runs its own call (plain causal when it starts at position 0, else masked over its prefix).

FP8 KV cache (``kv_scales`` given): new K/V are quantized on write and every read dequantizes
(``kv_quant``); a chunk starting at position 0 attends over the quantize-dequantized new K/V too, so
results do not depend on whether a prefix came from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kv_quant
from .backend import AttentionBackend, AttentionMetadata, PrefillSpan


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's new K/V ([T, kv_heads, head_dim]) into their slots (``meta.slot_mapping``; pad
    rows skipped), quantizing for an FP8 cache (calibrating an uncalibrated layer first).

    Returns the K/V a chunk starting at position 0 should attend over: the inputs, or for an FP8 cache
    their quantize-dequantized values (so results do not depend on whether a prefix came from the cache).
    """
    kvh, hd = k_cache.shape[2], k_cache.shape[3]
    slots, k_new, v_new = meta.slot_mapping, k, v
    keep = None
    if meta.has_pad_slots:  # padded rows (PAD_SLOT_ID) write nothing
        keep = slots >= 0
        slots, k_new, v_new = slots[keep], k[keep], v[keep]
    if kv_scales is None:
        k_cache.view(-1, kvh, hd).index_copy_(0, slots, k_new)
        v_cache.view(-1, kvh, hd).index_copy_(0, slots, v_new)
        return k, v
    fp8 = k_cache.dtype
    if meta.kv_calibrate and not bool(kv_scales[0] > 0):
        kv_quant.calibrate(kv_scales, k, v, fp8)
    k8, v8 = kv_quant.quantize(k, kv_scales[0], fp8), kv_quant.quantize(v, kv_scales[1], fp8)
    k8w, v8w = (k8[keep], v8[keep]) if keep is not None else (k8, v8)
    # CPU index kernels do not take float8: move the bytes as uint8
    k_cache.view(torch.uint8).view(-1, kvh, hd).index_copy_(0, slots, k8w.view(torch.uint8))
    v_cache.view(torch.uint8).view(-1, kvh, hd).index_copy_(0, slots, v8w.view(torch.uint8))
    return kv_quant.dequantize(k8, kv_scales[0], k.dtype), kv_quant.dequantize(v8, kv_scales[1], v.dtype)


def causal_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention of a chunk starting at position 0 over itself.
    q: [n, heads, head_dim]; k, v: [n, kv_heads, head_dim] → [n, heads, head_dim]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                       enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def cache_reader(k_cache: torch.Tensor, kv_scales: torch.Tensor | None, dtype: torch.dtype):
    """read(flat, idx, which) → the rows ``idx`` of a cache viewed [num_blocks, -1], in ``dtype``
    (FP8 rows dequantized with the layer's K (which=0) or V (which=1) scale)."""
    if kv_scales is None:
        return lambda flat, idx, which: flat.index_select(0, idx)
    fp8 = k_cache.dtype

    def read(flat: torch.Tensor, idx: torch.Tensor, which: int) -> torch.Tensor:
        rows = flat.view(torch.uint8).index_select(0, idx).view(fp8)
        return kv_quant.dequantize(rows, kv_scales[which], dtype)
    return read


def masked_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: PrefillSpan, read,
                   scale: float) -> torch.Tensor:
    """A chunk over its cached prefix: the span's context gathered through its block table, SDPA with
    its mask. q: [q_len, heads, head_dim] → [q_len, heads, head_dim]."""
    num_blocks, _, kvh, hd = k_cache.shape
    kk = read(k_cache.view(num_blocks, -1), p.block_table, 0).view(-1, kvh, hd)[: p.ctx_len]
    vv = read(v_cache.view(num_blocks, -1), p.block_table, 1).view(-1, kvh, hd)[: p.ctx_len]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kk.transpose(0, 1).unsqueeze(0),
                                       vv.transpose(0, 1).unsqueeze(0), attn_mask=p.mask, scale=scale,
                                       enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        num_blocks, block_size, kvh, hd = k_cache.shape
        k, v = write_kv(k, v, k_cache, v_cache, meta, kv_scales)
        read = cache_reader(k_cache, kv_scales, q.dtype)
        out = torch.empty_like(q)
        k_flat = k_cache.view(num_blocks, -1)
        v_flat = v_cache.view(num_blocks, -1)
        for g in meta.decode_groups:
            rows = slice(g.start, g.start + g.count)
            idx = g.block_tables.view(-1)  # index_select on [num_blocks, block] rows is the fastest gather
            kk = read(k_flat, idx, 0).view(g.count, -1, kvh, hd).transpose(1, 2)
            vv = read(v_flat, idx, 1).view(g.count, -1, kvh, hd).transpose(1, 2)
            # GQA without repeating K/V: the query heads sharing a kv head become that head's
            # "query positions" ([count, kv_heads, group, head_dim]); head h uses kv head h // group
            qg = q[rows].view(g.count, kvh, -1, hd)
            o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=g.mask, scale=scale)
            out[rows] = o.reshape(g.count, -1, hd)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.mask is None:
                out[rows] = causal_prefill(q[rows], k[rows], v[rows], scale)
            else:
                out[rows] = masked_prefill(q[rows], k_cache, v_cache, p, read, scale)
        return out
