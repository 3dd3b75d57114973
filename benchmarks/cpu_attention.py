"""kvfleet's C++ CPU paged-attention kernel vs the torch reference backend (gather + SDPA), one layer's
attention on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, block size 16, float32),
side by side in one run: per-call time (median of --repeats), the ratio, and the max relative error.

    python benchmarks/cpu_attention.py [--threads 2] [--repeats 30]

Rows: the peer workload's decode step (32 sequences of 20-200 prompt + 32 output tokens), the
shared-prefix serving row (4 decodes over ~1,400 tokens), a batch-1 decode at 1,000 tokens, and spans of
5 (a decode with 4 drafts), 16 and 48 tokens over a 1,400-token cached prefix (prefix-cache hit then the
question), each in the path the cpu backend takes (float32 spans of 4 rows or more: the span kernel). A second
table times spans of 2-257 rows over a 250- and a 1,400-token prefix (a decode with 1-64 drafts, the
spec_decode benchmark's contexts being ~250 tokens; a chunk over a prefix-cache hit) in each of the three
paths the cpu backend can take — the span kernel (``SPAN_MIN_ROWS`` float32 rows or more), the per-row
kernel, gather + SDPA — and names the one it takes. A third table times chunks that start at position 0
(8-1,100 rows) in the span kernel and in SDPA; the last line, the peer decode step over 30 layers' caches
streamed from memory.
"""

from __future__ import annotations

import copy
import timeit

import torch
from _common import kernel_bench_args, median_seconds

from kvfleet_server.attention.cpu_backend import CpuPagedAttentionBackend, paged_rows
from kvfleet_server.attention.parity import make_case, rel_err, run_backend
from kvfleet_server.attention.torch_ref import TorchAttentionBackend

ROWS = {
    "peer decode step (32 seqs, ctx 52-232)": [(52 + (i * 37) % 181, 1) for i in range(32)],
    "shared-prefix decode (4 seqs, ctx ~1400)": [(1400 + 13 * i, 1) for i in range(4)],
    "batch-1 decode (ctx 1000)": [(1000, 1)],
    "5-token draft span over a 1400-token prefix": [(1400, 5)],
    "16-token chunk over a 1400-token prefix": [(1400, 16)],
    "48-token chunk over a 1400-token prefix": [(1400, 48)],
}


def timed(backend, case, repeats: int) -> float:
    """Median seconds of one forward (the same slots rewritten each time; per-step tables rebuilt)."""
    kc, vc = case.k_cache.clone(), case.v_cache.clone()

    def forward():
        meta = copy.copy(case.meta)
        meta.backend_cache = {}
        backend.forward(case.q, case.k, case.v, kc, vc, meta, case.scale)
    return median_seconds(forward, repeats)


def main() -> None:
    args = kernel_bench_args(__doc__)
    ref, cpu = TorchAttentionBackend(), CpuPagedAttentionBackend()
    print(f"threads {args.threads}; median of {args.repeats} calls of one layer's attention (KV write included)")
    print(f"{'row':44s} {'torch ms':>9s} {'cpu ms':>8s} {'speed-up':>9s} {'rel err':>9s}")
    for name, seqs in ROWS.items():
        seqs = sorted(seqs, key=lambda s: s[1] > 1)  # decodes first
        case = make_case(seqs, 9, 3, 64, 16, torch.float32, share=False)
        t_ref, t_cpu = timed(ref, case, args.repeats), timed(cpu, case, args.repeats)
        err = rel_err(run_backend(cpu, case)[0], run_backend(ref, case)[0])
        print(f"{name:44s} {t_ref * 1e3:9.3f} {t_cpu * 1e3:8.3f} {t_ref / t_cpu:8.2f}x {err:9.1e}")
    spans(cpu, args.repeats)
    from_zero(cpu, args.repeats)
    streamed_decode(cpu, args.repeats)


def from_zero(cpu, repeats: int) -> None:
    """Chunks that start at position 0 (causal over themselves): the span kernel against SDPA."""
    from kvfleet_server.attention import cpu_backend as cb

    print(f"\n{'chunk from position 0':30s} {'span kernel ms':>17s} {'SDPA ms':>17s} {'taken':>15s} "
          f"{'SDPA / taken':>13s}")
    saved = cb.SPAN_MIN_ROWS
    for rows in (8, 16, 64, 200, 700, 1100):
        case = make_case([(0, rows)], 9, 3, 64, 16, torch.float32, share=False)
        taken = "span kernel" if cb._in_span_kernel(case.meta.prefills[0], case.q, case.k_cache, None) else "SDPA"
        t_span = timed(cpu, case, repeats)
        try:
            cb.SPAN_MIN_ROWS = 1 << 30
            t_sdpa = timed(cpu, case, repeats)
        finally:
            cb.SPAN_MIN_ROWS = saved
        t_taken = t_span if taken == "span kernel" else t_sdpa
        print(f"{f'{rows} rows':30s} {t_span * 1e3:17.3f} {t_sdpa * 1e3:17.3f} {taken:>15s} {t_sdpa / t_taken:12.2f}x")


def streamed_decode(cpu, repeats: int, layers: int = 30) -> None:
    """The peer decode step over ``layers`` layers, each with its own cache, so that K/V stream from memory as
    in a real step (the tables above reuse one layer's cache, which stays in the CPU's caches): the best of
    ``repeats`` steps, per layer, and the K/V bytes read per second."""
    seqs = ROWS["peer decode step (32 seqs, ctx 52-232)"]
    cases = [make_case(seqs, 9, 3, 64, 16, torch.float32, share=False, seed=i) for i in range(layers)]
    tables, rows, row_seq, row_len = paged_rows(cases[0].meta)
    out = torch.empty_like(cases[0].q)

    def step():
        for c in cases:
            cpu.op(out, c.q, c.k_cache, c.v_cache, tables, rows, row_seq, row_len, c.scale, 1.0, 1.0)
    step()  # warm-up
    best = min(timeit.repeat(step, number=1, repeat=repeats))
    token_bytes = cases[0].k_cache[0, 0].nbytes  # one token's K (or V) row, every kv head
    kv_bytes = int(row_len.sum()) * token_bytes * 2 * layers
    print(f"\npeer decode step, {layers} layers' caches streamed from memory: {best / layers * 1e6:.0f} us per layer, "
          f"{kv_bytes / best / 1e9:.1f} GB/s of K/V")


def spans(cpu, repeats: int) -> None:
    """Each path's time on spans over a cached prefix; ratios against the path the backend takes."""
    from kvfleet_server.attention import cpu_backend as cb

    paths = {"span kernel": dict(SPAN_MIN_ROWS=1),
             "per-row kernel": dict(SPAN_MIN_ROWS=1 << 30, KERNEL_MAX_SPAN=1 << 30),
             "SDPA": dict(SPAN_MIN_ROWS=1 << 30, KERNEL_MAX_SPAN=0)}
    print(f"\n{'span over a cached prefix':30s} " + " ".join(f"{p + ' ms':>17s}" for p in paths)
          + f" {'taken':>15s} {'per-row / taken':>15s}")
    saved = {k: getattr(cb, k) for k in ("SPAN_MIN_ROWS", "KERNEL_MAX_SPAN")}
    for prefix in (250, 1400):
        for rows in (2, 4, 5, 9, 17, 33, 65, 129, 257):
            case = make_case([(prefix, rows)], 9, 3, 64, 16, torch.float32, share=False)
            p = case.meta.prefills[0]
            taken = ("span kernel" if cb._in_span_kernel(p, case.q, case.k_cache, None)
                     else "per-row kernel" if cb._in_kernel(p) else "SDPA")
            times = {}
            for name, limits in paths.items():
                try:
                    for k, v in limits.items():
                        setattr(cb, k, v)
                    times[name] = timed(cpu, case, repeats)
                finally:
                    for k, v in saved.items():
                        setattr(cb, k, v)
            print(f"{f'{rows} rows over {prefix} tokens':30s} " + " ".join(f"{t * 1e3:17.3f}" for t in times.values())
                  + f" {taken:>15s} {times['per-row kernel'] / times[taken]:14.2f}x")


if __name__ == "__main__":
    main()
