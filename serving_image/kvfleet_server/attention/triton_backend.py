"""Triton attention backend: ``triton_common.store_kvcache`` writes the step's K/V into their slots,
``triton_decode`` attends the decode rows in one launch and ``triton_prefill`` every prefill chunk
in one more, all reading K/V in place through the block tables (the torch backend gathers them).

Per-step tensors the kernels need (stacked block tables and lengths) are built once per step, by
the first layer, and kept in ``AttentionMetadata.backend_cache``; the other layers reuse them.

Runs on CUDA, and on the CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set before triton
is imported; slow, used by the tests against the torch oracle).
"""

from __future__ import annotations

import torch

from . import kv_quant
from .backend import AttentionBackend, AttentionMetadata
from .triton_common import store_kvcache
from .triton_decode import paged_decode_attention
from .triton_prefill import paged_extend_attention


def _decode_inputs(meta: AttentionMetadata, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(block tables [D, max_blocks], context lengths [D]) of all decode groups stacked."""
    groups = meta.decode_groups
    lens = [g.context_lens for g in groups]
    if len(groups) == 1:
        return groups[0].block_tables, lens[0]
    width = max(g.block_tables.shape[1] for g in groups)
    tables = [torch.nn.functional.pad(g.block_tables, (0, width - g.block_tables.shape[1])) for g in groups]
    return torch.cat(tables), torch.cat(lens)


def _prefill_inputs(meta: AttentionMetadata, device):
    spans = meta.prefills
    width = max(p.block_table.shape[0] for p in spans)
    tables = torch.stack([torch.nn.functional.pad(p.block_table, (0, width - p.block_table.shape[0]))
                          for p in spans])
    ints = torch.tensor([[p.q_start, p.q_len, p.ctx_len] for p in spans], dtype=torch.int64).T.contiguous()
    ints = ints.to(device)
    return tables, ints[0], ints[1], ints[2], max(p.q_len for p in spans)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels (CUDA; the CPU under ``TRITON_INTERPRET=1``).

    ``num_splits`` fixes the decode kernel's context splits (None: ``default_num_splits``);
    ``decode_block_n`` is its K/V tile in tokens (a power of two, at least 16)."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, num_splits: int | None = None, decode_block_n: int = 64):
        self.num_splits = num_splits
        self.decode_block_n = decode_block_n

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        if kv_scales is not None and meta.kv_calibrate and not bool(kv_scales[0] > 0):
            kv_quant.calibrate(kv_scales, k, v, k_cache.dtype)
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        out = torch.empty_like(q)
        cache = meta.backend_cache
        if meta.decode_groups:
            if "decode" not in cache:
                cache["decode"] = _decode_inputs(meta, q.device)
            tables, lens = cache["decode"]
            D = meta.num_decodes
            paged_decode_attention(q[:D], k_cache, v_cache, tables, lens, scale, kv_scales,
                                   num_splits=self.num_splits, out=out[:D], block_n=self.decode_block_n)
        if meta.prefills:
            if "prefill" not in cache:
                cache["prefill"] = _prefill_inputs(meta, q.device)
            tables, q_starts, q_lens, ctx_lens, max_q = cache["prefill"]
            paged_extend_attention(q, k_cache, v_cache, out, tables, q_starts, q_lens, ctx_lens, max_q, scale,
                                   kv_scales)
        return out
