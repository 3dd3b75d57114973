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
from .backend import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        num_blocks, block_size, kvh, hd = k_cache.shape
        slots, k_new, v_new = meta.slot_mapping, k, v
        if meta.has_pad_slots:  # padded rows (PAD_SLOT_ID) write nothing
            keep = slots >= 0
            slots, k_new, v_new = slots[keep], k[keep], v[keep]
        if kv_scales is not None:
            fp8 = k_cache.dtype
            if meta.kv_calibrate and not bool(kv_scales[0] > 0):
                kv_quant.calibrate(kv_scales, k, v, fp8)
            k8, v8 = kv_quant.quantize(k, kv_scales[0], fp8), kv_quant.quantize(v, kv_scales[1], fp8)
            if meta.has_pad_slots:
                k8w, v8w = k8[keep], v8[keep]
            else:
                k8w, v8w = k8, v8
            # CPU index kernels do not take float8: move the bytes as uint8
            k_cache.view(torch.uint8).view(-1, kvh, hd).index_copy_(0, slots, k8w.view(torch.uint8))
            v_cache.view(torch.uint8).view(-1, kvh, hd).index_copy_(0, slots, v8w.view(torch.uint8))
            k, v = kv_quant.dequantize(k8, kv_scales[0], q.dtype), kv_quant.dequantize(v8, kv_scales[1], q.dtype)

            def read(flat: torch.Tensor, idx: torch.Tensor, which: int) -> torch.Tensor:
                rows = flat.view(torch.uint8).index_select(0, idx).view(fp8)
                return kv_quant.dequantize(rows, kv_scales[which], q.dtype)
        else:
            k_cache.view(-1, kvh, hd).index_copy_(0, slots, k_new)
            v_cache.view(-1, kvh, hd).index_copy_(0, slots, v_new)

            def read(flat: torch.Tensor, idx: torch.Tensor, which: int) -> torch.Tensor:
                return flat.index_select(0, idx)
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
            qp = q[rows].transpose(0, 1).unsqueeze(0)
            if p.mask is None:
                kk = k[rows].transpose(0, 1).unsqueeze(0)
                vv = v[rows].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
            else:
                kk = read(k_flat, p.block_table, 0).view(-1, kvh, hd)[: p.ctx_len].transpose(0, 1).unsqueeze(0)
                vv = read(v_flat, p.block_table, 1).view(-1, kvh, hd)[: p.ctx_len].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kk, vv, attn_mask=p.mask, scale=scale, enable_gqa=True)
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out
