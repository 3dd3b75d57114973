"""CPU paged-attention backend: decode rows and spans over a cached prefix (decodes with draft tokens,
prefill chunks) attend through their block tables in place, in kvfleet's C++ kernels
(``csrc/paged_attention_cpu.cpp``, built by ``cpu_ext``); the torch reference gathers every context into
a padded copy first, at every layer and step. A span of ``SPAN_MIN_ROWS`` rows or more over a context of
at most ``SPAN_MAX_CONTEXT`` tokens, float32 query and cache, head_dim a multiple of 16 (a verification of 3
or more drafts, a chunk over a prefix-cache hit or over its sequence's earlier chunks, a chunk from position
0) goes to the span kernel, which reads the sequence's keys and values once for all of its rows
(``paged_span_attention_cpu``); other spans of up to ``KERNEL_MAX_SPAN`` rows go to the per-row kernel.
The rest (other dtypes, longer contexts) is gathered and attended with SDPA — flash attention on the CPU
for chunks from position 0 — as in the torch backend (vLLM's torch-SDPA CPU backend made that split; its
0.32 CPU engine attends prefill and decode in one kernel, ``cpu_attention_with_kv_cache``). K/V
writes go to ``reshape_and_cache_cpu`` (one copy per row), FP8 caches (quantized on write) to the torch
backend's ``write_kv``.

The per-step row tables (which row attends which sequence's first how many tokens) are built once,
by the first layer, and kept in ``AttentionMetadata.backend_cache``.
"""

from __future__ import annotations

import torch

from .backend import AttentionBackend, AttentionMetadata
from .torch_ref import cache_reader, causal_prefill, masked_prefill, write_kv

#: spans over a cached prefix with at most this many rows (not taken by the span kernel) go through the
#: per-row kernel, longer ones through SDPA
KERNEL_MAX_SPAN = 8  # benchmarks/cpu_attention.py over a 1,400-token prefix: 5 rows 1.5x, 8 rows 1.1x, 16 rows 0.8x
#: float32 spans of at least SPAN_MIN_ROWS rows over contexts of at most SPAN_MAX_CONTEXT tokens go to the
#: span kernel. Over a cached prefix (benchmarks/cpu_attention.py, SmolLM2's 9 / 3 heads, 2 threads):
#: 2026-12-04, 1.5x the per-row kernel at 17 rows over 250 tokens, 1.1x at 5, 1.7-2.0x at 17-33 rows over
#: 1,400 (under 4 rows its panel copies cost more than they save); 2026-12-07 (Zen 4), SDPA took 1.3-1.9x
#: its time at 65-1,024 rows over 250-1,400 tokens (contexts up to 2,048), within the same distance of the
#: oracle. Chunks from position 0 attend over themselves, reading their own K/V back from the cache (written
#: first): SDPA's flash attention took 1.4-4x its time at 8-1,100 rows (2026-12-07). SPAN_MAX_CONTEXT bounds
#: the panels the kernel copies the context's K/V into at every layer (KVH x context x head_dim x 2 float32).
#: Its rows agree with the per-row kernel's to float32 rounding (~1e-7), not bit for bit: a greedy near-tie
#: may resolve differently with drafts.
SPAN_MIN_ROWS, SPAN_MAX_CONTEXT = 4, 2048


def _in_span_kernel(p, q, k_cache, kv_scales) -> bool:
    return (SPAN_MIN_ROWS <= p.q_len and p.ctx_len <= SPAN_MAX_CONTEXT and kv_scales is None
            and q.dtype == torch.float32 and k_cache.dtype == torch.float32 and q.shape[-1] % 16 == 0)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Each [num_kv_heads, head_dim] row of ``t`` is one contiguous span (reshape_and_cache_cpu copies it whole)."""
    return t.stride(-1) == 1 and t.stride(1) == t.shape[2]


def _in_kernel(p) -> bool:
    return p.mask is not None and p.q_len <= KERNEL_MAX_SPAN


def paged_rows(meta: AttentionMetadata, in_span_kernel: tuple[bool, ...] = ()) -> tuple[torch.Tensor, ...] | None:
    """(tables [S, W], rows [R], row_seq [R], row_len [R]) int64 for every row the per-row kernel attends:
    the decodes, and each span over a cached prefix of at most KERNEL_MAX_SPAN rows (its row i sees
    prefix + i + 1 tokens) that ``in_span_kernel`` (per prefill, default none) does not give to the span
    kernel. None when the step has no such row."""
    tables, rows, seqs, lens = [], [], [], []
    s = 0
    for g in meta.decode_groups:
        tables.append(g.block_tables)
        rows.append(torch.arange(g.start, g.start + g.count))
        seqs.append(torch.arange(s, s + g.count))
        lens.append(g.context_lens)
        s += g.count
    for i, p in enumerate(meta.prefills):
        if not _in_kernel(p) or (in_span_kernel and in_span_kernel[i]):
            continue
        tables.append(p.block_table[None])
        rows.append(torch.arange(p.q_start, p.q_start + p.q_len))
        seqs.append(torch.full((p.q_len,), s))
        lens.append(torch.arange(p.prefix_len + 1, p.ctx_len + 1))
        s += 1
    if not rows:
        return None
    width = max(t.shape[1] for t in tables)
    table = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables])
    return (table.long().contiguous(), torch.cat(rows).long(), torch.cat(seqs).long(), torch.cat(lens).long())


class CpuPagedAttentionBackend(AttentionBackend):
    """Paged attention on the CPU with kvfleet's C++ kernel (float32 / bfloat16 / float16 queries; a
    cache in the model dtype or FP8 e4m3 / e5m2)."""

    name = "cpu"

    def __init__(self):
        from .cpu_ext import load, load_error

        if load() is None:
            raise RuntimeError(f"the CPU paged-attention kernel could not be built: {load_error()}")
        self.op = torch.ops.kvfleet.paged_attention_cpu
        self.span_op = torch.ops.kvfleet.paged_span_attention_cpu
        self.write_op = torch.ops.kvfleet.reshape_and_cache_cpu

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        if kv_scales is None and _rows_contiguous(k) and _rows_contiguous(v):  # FP8 quantizes in write_kv
            self.write_op(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            k, v = write_kv(k, v, k_cache, v_cache, meta, kv_scales)
        read = cache_reader(k_cache, kv_scales, q.dtype)
        out = torch.empty_like(q)
        cache = meta.backend_cache
        if "cpu_rows" not in cache:  # the same for every layer: decided by the first
            cache["cpu_span"] = tuple(_in_span_kernel(p, q, k_cache, kv_scales) for p in meta.prefills)
            cache["cpu_rows"] = paged_rows(meta, cache["cpu_span"])
        if cache["cpu_rows"] is not None:
            tables, rows, row_seq, row_len = cache["cpu_rows"]
            ks, vs = (1.0, 1.0) if kv_scales is None else (float(kv_scales[0]), float(kv_scales[1]))
            self.op(out, q, k_cache, v_cache, tables, rows, row_seq, row_len, scale, ks, vs)
        for p, span in zip(meta.prefills, cache["cpu_span"]):
            rows_ = slice(p.q_start, p.q_start + p.q_len)
            if span:
                self.span_op(out, q, k_cache, v_cache, p.block_table, p.q_start, p.q_len, p.prefix_len, scale)
            elif p.mask is None:
                out[rows_] = causal_prefill(q[rows_], k[rows_], v[rows_], scale)
            elif not _in_kernel(p):
                out[rows_] = masked_prefill(q[rows_], k_cache, v_cache, p, read, scale)
        return out
