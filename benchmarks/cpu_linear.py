"""F.linear (MKL) vs oneDNN's prepacked float32 linear (model/layers/cpu_prepack.py) on SmolLM2-135M's
weight shapes, side by side in one run: median microseconds per call and the ratio, at the row counts
of decode (1, 8, 32), draft verification (5) and prefill (256, 2048).

    python benchmarks/cpu_linear.py [--threads 2] [--repeats 30]

The weights of one shape fit in the CPU's caches here, unlike a whole model's: the in-engine effect is
benchmarks/offline_throughput.py's ``default`` vs ``no-prepack`` variants.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import kernel_bench_args, median_seconds

#: (name, K, N): fused qkv, o, gate_up, down, and the (tied) LM head
SHAPES = [("qkv_proj", 576, 960), ("o_proj", 576, 576), ("gate_up_proj", 576, 3072), ("down_proj", 1536, 576),
          ("lm_head", 576, 49152)]
ROWS = [1, 5, 8, 32, 256, 2048]


def main() -> None:
    args = kernel_bench_args(__doc__)
    print(f"threads {args.threads}; median of {args.repeats} calls; float32")
    print(f"{'shape':14s} {'rows':>5s} {'F.linear us':>12s} {'prepacked us':>13s} {'speed-up':>9s} {'max rel err':>12s}")
    for name, k, n in SHAPES:
        w = torch.randn(n, k) / k ** 0.5
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        for m in ROWS:
            if name == "lm_head" and m > 256:
                continue  # the head only projects sampled rows
            x = torch.randn(m, k)
            a = median_seconds(lambda: F.linear(x, w), args.repeats)
            b = median_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), args.repeats)
            ref = F.linear(x.double(), w.double())
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").double()
            err = float((out - ref).abs().max() / ref.abs().max())
            print(f"{name:14s} {m:5d} {a * 1e6:12.0f} {b * 1e6:13.0f} {a / b:8.2f}x {err:12.1e}")


if __name__ == "__main__":
    main()
