"""kvfleet's C++ CPU paged-attention kernel vs the torch reference backend (gather + SDPA), one layer's
attention on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, block size 16, float32),
side by side in one run: per-call time (median of --repeats), the ratio, and the max relative error.

    python benchmarks/cpu_attention.py [--threads 2] [--repeats 30]

Rows: the peer workload's decode step (32 sequences of 20-200 prompt + 32 output tokens), the
shared-prefix serving row (4 decodes over ~1,400 tokens), a batch-1 decode at 1,000 tokens, and spans of
5 (a decode with 4 drafts), 16 and 48 tokens over a 1,400-token cached prefix (prefix-cache hit then the
question). Spans of more than ``cpu_backend.KERNEL_MAX_SPAN`` rows go through SDPA in the cpu backend, so
the 48-token row times that path; the kernel's own time on it is printed on the last line.
"""

from __future__ import annotations

import copy

import torch
from _common import kernel_bench_args, median_seconds

from kvfleet_server.attention.cpu_backend import CpuPagedAttentionBackend
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
    from kvfleet_server.attention import cpu_backend

    case = make_case([(1400, 48)], 9, 3, 64, 16, torch.float32, share=False)
    limit, cpu_backend.KERNEL_MAX_SPAN = cpu_backend.KERNEL_MAX_SPAN, 1 << 30
    try:
        print(f"{'  the 48-token chunk in the kernel itself':44s} {'':9s} {timed(cpu, case, args.repeats) * 1e3:8.3f}")
    finally:
        cpu_backend.KERNEL_MAX_SPAN = limit


if __name__ == "__main__":
    main()
