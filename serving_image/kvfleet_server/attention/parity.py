"""Random paged-attention cases and a side-by-side run of two backends on them: the kernels' check
against the torch oracle (tests under the Triton interpreter, benchmarks/gpu/ on a GPU).

A case is a list of sequences ``(prefix_len, q_len)``: ``q_len == 1`` is a decode, longer a prefill
chunk (``prefix_len > 0``: chunked prefill / extend over a cached prefix). Block tables are random
permutations of the pool (non-contiguous), and with ``share`` every second sequence reuses the first
full prefix blocks of the one before it (prefix caching's shared blocks). The metadata follows
``executor/model_runner.py``'s conventions (decodes first, one decode group, spans with masks).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from . import kv_quant
from .backend import AttentionBackend, AttentionMetadata, DecodeGroup, PrefillSpan

# (name, sequences (prefix, q_len)): decodes first; contexts not multiples of the block size; shared
# blocks between neighbours; chunked prefill over a cached prefix; a fresh prefill
SEQS = {
    "decode": [(37, 1), (16, 1), (5, 1), (70, 1)],
    "extend": [(0, 9), (21, 7), (24, 11)],
    "mixed": [(37, 1), (16, 1), (0, 9), (20, 7)],
}
#: (num_heads, num_kv_heads): GQA ratios 1, 3, 4, 8
GQA = [(4, 4), (6, 2), (8, 2), (8, 1)]


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KVH, D] new tokens
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D], prefixes filled
    v_cache: torch.Tensor
    meta: AttentionMetadata
    kv_scales: torch.Tensor | None
    scale: float


def make_case(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, device="cpu", kv_cache_dtype: torch.dtype | None = None, share: bool = True,
              seed: int = 0) -> Case:
    """A random case (decodes must come first in ``seqs``)."""
    g = torch.Generator().manual_seed(seed)
    kvd = kv_cache_dtype or dtype
    seqs = list(seqs)
    nblk = [-(-(p + n) // block_size) for p, n in seqs]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for i, (p, n) in enumerate(seqs):
        t = perm[used: used + nblk[i]]
        used += nblk[i]
        if share and i % 2 == 1:  # reuse the previous sequence's full prefix blocks
            shared = min(p // block_size, seqs[i - 1][0] // block_size)
            t[:shared] = tables[i - 1][:shared]
        tables.append(t)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    T = sum(n for _, n in seqs)
    q, k, v = rnd(T, num_heads, head_dim), rnd(T, num_kv_heads, head_dim), rnd(T, num_kv_heads, head_dim)
    kv_scales = None
    k_cache = rnd(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = rnd(num_blocks, block_size, num_kv_heads, head_dim)
    if kv_quant.is_fp8(kvd):
        kv_scales = torch.tensor([0.02, 0.03], dtype=torch.float32, device=device)
        k_cache = kv_quant.quantize(k_cache, kv_scales[0], kvd)
        v_cache = kv_quant.quantize(v_cache, kv_scales[1], kvd)
    slots, groups, spans, row = [], [], [], 0
    dec = [i for i, (_, n) in enumerate(seqs) if n == 1]
    assert dec == list(range(len(dec))), "decodes first"
    if dec:
        mb = max(nblk[i] for i in dec)
        bt = torch.tensor([tables[i] + [tables[i][0]] * (mb - len(tables[i])) for i in dec], device=device)
        ctx = torch.tensor([seqs[i][0] + 1 for i in dec], device=device)
        mask = (torch.arange(mb * block_size, device=device)[None, :] < ctx[:, None])[:, None, None, :]
        groups.append(DecodeGroup(0, len(dec), bt, mask, ctx))
    for i, (p, n) in enumerate(seqs):
        bt = tables[i]
        slots += [bt[t // block_size] * block_size + t % block_size for t in range(p, p + n)]
        if n > 1:
            pos = torch.arange(p, p + n, device=device)
            mask = torch.arange(p + n, device=device)[None, :] <= pos[:, None] if p > 0 else None
            spans.append(PrefillSpan(row, n, p + n, torch.tensor(bt, device=device), mask))
        row += n
    meta = AttentionMetadata(torch.tensor(slots, device=device), num_decodes=len(dec), decode_groups=groups,
                             prefills=spans)
    return Case(q, k, v, k_cache, v_cache, meta, kv_scales, head_dim ** -0.5)


def run_backend(backend: AttentionBackend, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [T, H, D], K cache, V cache after the write) of ``backend`` on a private copy of the case."""
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    meta = copy.copy(case.meta)
    meta.backend_cache = {}
    scales = None if case.kv_scales is None else case.kv_scales.clone()
    out = backend.forward(case.q, case.k, case.v, kc, vc, meta, case.scale, kv_scales=scales)
    return out, kc, vc


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| in float32."""
    x, ref = x.float(), ref.float()
    return float((x - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def compare(backend: AttentionBackend, oracle: AttentionBackend, case: Case) -> dict:
    """Relative error of ``backend`` vs ``oracle`` on the output, and whether both wrote the same cache."""
    out, kc, vc = run_backend(backend, case)
    ref, rkc, rvc = run_backend(oracle, case)
    same_cache = bool(torch.equal(kc.view(torch.uint8), rkc.view(torch.uint8))
                      and torch.equal(vc.view(torch.uint8), rvc.view(torch.uint8)))
    return {"rel_err": rel_err(out, ref), "cache_equal": same_cache}
