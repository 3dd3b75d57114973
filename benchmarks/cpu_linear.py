"""F.linear (MKL) vs oneDNN's prepacked float32 linear vs kvfleet's panel kernel (model/layers/cpu_prepack.py,
attention/csrc/linear_cpu.cpp) on SmolLM2-135M's weight shapes, side by side in one run, at the row counts
of decode (1, 8, 32), draft verification (5) and prefill (256, 2048).

    python benchmarks/cpu_linear.py [--threads 2] [--repeats 30]

Three tables: one shape at a time (its weights stay in the CPU's caches between calls); all 120
decoder linears of the model in a row (the weights stream from memory, as in a decode step: GB/s is
weight bytes over time); and a bfloat16 model's linears (``F.linear`` in bfloat16, which torch hands to
oneDNN: AMX tiles where the CPU has them, AVX512-BF16 or converted float32 otherwise) against float32,
in GFLOP/s. Median of ``--repeats`` calls (of 5 passes for the streamed table); max
relative error against float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import kernel_bench_args, median_seconds

from kvfleet_server.attention import cpu_ext
from kvfleet_server.model.layers.cpu_prepack import pack_panels

#: (name, K, N): fused qkv, o, gate_up, down, and the (tied) LM head
SHAPES = [("qkv_proj", 576, 960), ("o_proj", 576, 576), ("gate_up_proj", 576, 3072), ("down_proj", 1536, 576),
          ("lm_head", 576, 49152)]
ROWS = [1, 5, 8, 32, 256, 2048]
NUM_LAYERS = 30


def kernels(w: torch.Tensor) -> dict:
    """name → (callable x → y) for one weight [N, K]."""
    onednn = torch.ops.mkldnn._reorder_linear_weight(w)
    out = {"F.linear": lambda x: F.linear(x, w),
           "oneDNN": lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")}
    if cpu_ext.load() is not None:
        panels, n = pack_panels(w), w.shape[0]
        out["panels"] = lambda x: torch.ops.kvfleet.linear_packed_cpu(x, panels, n, None)
    return out


def main() -> None:
    args = kernel_bench_args(__doc__)
    names = list(kernels(torch.zeros(16, 16)))
    print(f"threads {args.threads}; float32; median of {args.repeats} calls; ratios against oneDNN")
    print("one shape at a time (weights in cache):")
    print(f"{'shape':14s} {'rows':>5s} " + " ".join(f"{n + ' us':>12s}" for n in names)
          + " " + " ".join(f"{'oneDNN/' + n:>16s}" for n in names if n != "oneDNN") + f" {'max rel err':>12s}")
    for name, k, n in SHAPES:
        w = torch.randn(n, k) / k ** 0.5
        ks = kernels(w)
        for m in ROWS:
            if name == "lm_head" and m > 256:
                continue  # the head only projects sampled rows
            x = torch.randn(m, k)
            t = {kn: median_seconds(lambda f=f: f(x), args.repeats) for kn, f in ks.items()}
            ref = F.linear(x.double(), w.double())
            err = max(float((f(x).double() - ref).abs().max() / ref.abs().max()) for f in ks.values())
            print(f"{name:14s} {m:5d} " + " ".join(f"{t[kn] * 1e6:12.0f}" for kn in names) + " "
                  + " ".join(f"{t['oneDNN'] / t[kn]:15.2f}x" for kn in names if kn != "oneDNN") + f" {err:12.1e}")
    print(f"\nall {4 * NUM_LAYERS} decoder linears in a row (weights streamed from memory):")
    layer = [s for s in SHAPES if s[0] != "lm_head"] * NUM_LAYERS
    ws = [torch.randn(n, k) / k ** 0.5 for _, k, n in layer]
    per = [kernels(w) for w in ws]
    nbytes = sum(w.numel() * 4 for w in ws)
    print(f"{'rows':>5s} " + " ".join(f"{n + ' ms':>12s} {'GB/s':>6s}" for n in names)
          + " " + " ".join(f"{'oneDNN/' + n:>16s}" for n in names if n != "oneDNN"))
    for m in [1, 2, 5, 8, 16, 32]:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        t = {kn: median_seconds(lambda kn=kn: [p[kn](xs[w.shape[1]]) for w, p in zip(ws, per)],
                                max(5, args.repeats // 6)) for kn in names}
        print(f"{m:5d} " + " ".join(f"{t[kn] * 1e3:12.1f} {nbytes / t[kn] / 1e9:6.1f}" for kn in names) + " "
              + " ".join(f"{t['oneDNN'] / t[kn]:15.2f}x" for kn in names if kn != "oneDNN"))
    print("\nbfloat16 model (F.linear in bfloat16: oneDNN, AMX where the CPU has amx_bf16) vs float32 F.linear, GFLOP/s:")
    print(f"{'shape':14s} {'rows':>5s} {'float32':>9s} {'bfloat16':>9s} {'bf16/f32':>9s}")
    for name, k, n in SHAPES[:4]:
        w = torch.randn(n, k) / k ** 0.5
        wb = w.bfloat16()
        for m in (8, 256, 2048):
            x = torch.randn(m, k)
            xb = x.bfloat16()
            t32 = median_seconds(lambda: F.linear(x, w), args.repeats)
            t16 = median_seconds(lambda: F.linear(xb, wb), args.repeats)
            flops = 2 * m * k * n
            print(f"{name:14s} {m:5d} {flops / t32 / 1e9:9.0f} {flops / t16 / 1e9:9.0f} {t32 / t16:8.2f}x")


if __name__ == "__main__":
    main()
