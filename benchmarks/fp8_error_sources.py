"""Where FP8's accuracy loss comes from (issue 11, Must show 2), on the real SmolLM2-135M-Instruct in
float32: perplexity on fixed windows of ``pydoc_data.topics`` when only some tensors are rounded to
FP8, and with other scale choices than the engine's.

One float32 engine is loaded once; each variant rounds the weights in place (or K/V as the attention
backend receives them) and rescores the same windows with the prefix cache emptied. The rounding is
the engine's own (``quantize_per_channel_fp8``; ``kv_quant.calibrate/quantize/dequantize``), so the
"weights fp8 (engine)" and "kv fp8 (engine: ...)" rows compute what ``--quantization fp8`` and
``--kv-cache-dtype fp8`` do (the engine's own figures differ in the last digits: its CPU kernels round
float32 differently from the torch backend used here). The other rows are diagnostics, not engine modes:

- weights: all projections (the engine), one projection kind at a time, an MSE-optimal per-channel
  scale (searched over 0.7–1.2 × absmax/448), one scale per tensor, one per 32-wide group, int8
  per-channel (the int8 method's rounding, kept in float32 activations), bfloat16 rounding;
- weights, continued: every linear's input rotated by 64-wide Hadamard blocks (W·Hᵀ rounded), only
  down_proj's / o_proj's, and GPTQ's error-compensating rounding onto the engine's grid, calibrated on
  stdlib module docstrings;
- KV cache: q, k, v in the Hadamard basis over head_dim (the engine since the rotation), only K
  rotated with V kept float; plain K and V (the engine before, headroom 4), K only, V only, headroom 1 (vLLM's
  ``calc_kv_scales``: absmax / fp8 max) and 16, scale 1.0 (vLLM's default without checkpoint scales), one
  scale per KV head, e5m2 (all plain).

    python benchmarks/fp8_error_sources.py --windows 2 --window-len 256
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

F8 = torch.float8_e4m3fn


def _fp8_channel(w, mult=1.0):
    s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448 * mult
    return (w / s).clamp(-448, 448).to(F8).float() * s


def _fp8_mse(w):
    best, best_err = None, None
    for mult in (0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0, 1 / 1.05, 1 / 1.1, 1 / 1.2):
        q = _fp8_channel(w, mult)
        err = ((q - w) ** 2).sum(1, keepdim=True)
        if best is None:
            best, best_err = q, err
        else:
            best, best_err = torch.where(err < best_err, q, best), torch.minimum(err, best_err)
    return best


def _fp8_tensor(w):
    s = w.abs().amax().clamp(min=1e-12) / 448
    return (w / s).to(F8).float() * s


def _fp8_group32(w):
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return ((g / s).to(F8).float() * s).view(n, k)


def _rotated(fn, block: int):
    """Round ``W @ R^T`` with ``fn`` and rotate back (``R`` block-diagonal Hadamard over the input dimension,
    symmetric: ``R^T = R``): what a linear computes when its input is rotated online, ``(W R^T)(R x)``
    (QuaRot's trick)."""
    from kvfleet_server.attention.kv_quant import hadamard

    h = hadamard(block, torch.float32)

    def run(w):
        n, k = w.shape
        wr = (w.view(n, k // block, block) @ h).view(n, k)
        return (fn(wr).view(n, k // block, block) @ h).view(n, k)
    return run


def _gptq_fp8(w: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """kvfleet-quantize's GPTQ rounding onto the engine's grid, dequantized (float32 [N, K])."""
    from kvfleet_server.quantize.gptq import gptq_fp8

    w8, s = gptq_fp8(w, hessian)
    return w8.float() * s[:, None]


def _int8_channel(w):
    s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(w / s).clamp(-127, 127) * s


def _engine_fp8(w):
    from kvfleet_server.model.layers.quant.fp8 import quantize_per_channel_fp8

    w8, s = quantize_per_channel_fp8(w)
    return w8.float() * s[:, None]


WEIGHT_VARIANTS = {  # name: (rounding or {name suffix: rounding}, projections it applies to; None = all)
    "weights fp8 (engine)": (_engine_fp8, None),
    "weights fp8, qkv_proj only": (_engine_fp8, "qkv_proj"),
    "weights fp8, o_proj only": (_engine_fp8, "o_proj"),
    "weights fp8, gate_up_proj only": (_engine_fp8, "gate_up_proj"),
    "weights fp8, down_proj only": (_engine_fp8, "down_proj"),
    "weights fp8, MSE-optimal channel scale": (_fp8_mse, None),
    "weights fp8, one scale per tensor": (_fp8_tensor, None),
    "weights fp8, one scale per 32 (not the issue's format)": (_fp8_group32, None),
    "weights fp8, input rotated (Hadamard 64 blocks)": (_rotated(_engine_fp8, 64), None),
    "weights fp8, down_proj's input rotated (Hadamard 64 blocks)": (
        {"down_proj": _rotated(_engine_fp8, 64), "": _engine_fp8}, None),
    "weights fp8, down_proj's and o_proj's inputs rotated": (
        {"down_proj": _rotated(_engine_fp8, 64), "o_proj": _rotated(_engine_fp8, 64), "": _engine_fp8}, None),
    "weights fp8, GPTQ rounding (calibrated on stdlib docstrings)": ("gptq", None),
    "weights int8 per channel (float32 activations)": (_int8_channel, None),
    "weights bfloat16": (lambda w: w.to(torch.bfloat16).float(), None),
}
KV_VARIANTS = {  # name: (quantize K, quantize V, headroom or "one", per head, dtype[, rotated])
    "kv fp8 (engine: q, k, v rotated by a Hadamard over head_dim)": (True, True, 4.0, False,
                                                                      torch.float8_e4m3fn, True),
    "kv fp8, K only, rotated": (True, False, 4.0, False, torch.float8_e4m3fn, True),
    "kv fp8, plain K/V (the engine before the rotation, headroom 4)": (True, True, 4.0, False, torch.float8_e4m3fn),
    "kv fp8, K only": (True, False, 4.0, False, torch.float8_e4m3fn),
    "kv fp8, V only": (False, True, 4.0, False, torch.float8_e4m3fn),
    "kv fp8, headroom 1 (vLLM calc_kv_scales)": (True, True, 1.0, False, torch.float8_e4m3fn),
    "kv fp8, headroom 16": (True, True, 16.0, False, torch.float8_e4m3fn),
    "kv fp8, scale 1.0 (vLLM default)": (True, True, "one", False, torch.float8_e4m3fn),
    "kv fp8, one scale per KV head": (True, True, 4.0, True, torch.float8_e4m3fn),
    "kv fp8_e5m2": (True, True, 4.0, False, torch.float8_e5m2),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--window-len", type=int, default=256)
    ap.add_argument("--only", default="", help="comma-separated substrings: run the variants whose names match")
    ap.add_argument("--float-dir", default=os.path.join(tempfile.gettempdir(), "kvfleet-smollm2-float32"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fp8_error_sources.json"))
    args = ap.parse_args(argv)
    from kvfleet_server import LLM
    from kvfleet_server.attention import kv_quant, torch_ref
    from kvfleet_server.config import bundled_model_path
    from kvfleet_server.evaluate import (export_float_checkpoint, fixed_windows, loglik_change, perplexity,
                                         reference_text, score_windows)
    from kvfleet_server.model.layers.embedding import VocabEmbedding
    from kvfleet_server.model.layers.linear import Linear
    from kvfleet_server.model.tokenizer import Tokenizer

    if not os.path.isfile(os.path.join(args.float_dir, "model.safetensors")):
        export_float_checkpoint(bundled_model_path(), args.float_dir)
    tokenizer = Tokenizer.from_path(args.float_dir, [])
    ids = tokenizer.encode(reference_text(), add_special_tokens=False)
    windows = fixed_windows(ids, args.window_len, args.windows)
    # the torch attention backend (its forward is patched below) and plain float weights (rewritten below)
    llm = LLM(args.float_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20,
              max_num_batched_tokens=max(512, args.window_len), num_threads=1, attention_backend="torch",
              cpu_weight_prepack=False)
    linears = [(n, m) for n, m in llm.engine.model.named_modules()
               if isinstance(m, Linear) and not isinstance(m, VocabEmbedding)]
    original = {n: m.weight.data.clone() for n, m in linears}
    kv_mode: dict = {}
    layer_scales: dict[int, tuple] = {}
    plain_forward = torch_ref.TorchAttentionBackend.forward

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, kv_scales=None):  # noqa: ARG001 (float cache)
        if kv_mode:
            qk, qv, headroom, per_head, dt, *rot = kv_mode["spec"]
            fmax = torch.finfo(dt).max
            h = kv_quant.hadamard(k.shape[-1], torch.float32) if rot else None
            if rot:  # what is stored is x @ H; attention then uses q @ H (equal dot products)
                k, v = kv_quant.rotate(k, h), kv_quant.rotate(v, h)
            if k_cache.data_ptr() not in layer_scales:  # calibrated on the first prefill, as the engine does
                dims = (0, 2) if per_head else (0, 1, 2)
                layer_scales[k_cache.data_ptr()] = tuple(
                    torch.ones(()) if headroom == "one" else (x.abs().amax(dims, keepdim=per_head) * headroom / fmax)
                    for x in (k, v))
            ks, vs = layer_scales[k_cache.data_ptr()]
            if qk:
                k = kv_quant.dequantize(kv_quant.quantize(k, ks, dt), ks, k.dtype)
            if qv:
                v = kv_quant.dequantize(kv_quant.quantize(v, vs, dt), vs, v.dtype)
            if rot:
                k, v = kv_quant.rotate(k, h), kv_quant.rotate(v, h)
        return plain_forward(self, q, k, v, k_cache, v_cache, meta, scale, None)

    torch_ref.TorchAttentionBackend.forward = forward

    def gptq_rounding(llm, linears, original, calib_ids):
        """Σ xᵀx of every linear's inputs over the calibration windows (float weights; kvfleet-quantize's
        calibration), then a {name: rounding} that rounds each linear with GPTQ."""
        from kvfleet_server.quantize.calibration import collect_hessians

        for n, m in linears:
            m.weight.data.copy_(original[n])
        hess = collect_hessians(llm, fixed_windows(calib_ids, 512, min(4, len(calib_ids) // 512)))
        # decoder projections only (an untied lm_head is not calibrated: it rounds to nearest)
        return {n: (lambda w, n=n: _gptq_fp8(w, hess[n])) if n in hess else _engine_fp8 for n, _ in linears}

    def score():
        layer_scales.clear()
        llm.engine.kv.pool.reset_prefix_cache()
        return score_windows(llm, windows)

    ref = score()
    ref_ppl = perplexity(ref)
    rows = [{"variant": "float32", "perplexity": ref_ppl}]
    print(f"{'variant':<58}{'ppl':>9}{'Δppl %':>8}{'Δll mean':>10}{'|Δll| mean':>11}")
    print(f"{'float32 (reference)':<58}{ref_ppl:>9.4f}")
    wanted = [s for s in args.only.split(",") if s]
    variants = [(n, "w", v) for n, v in WEIGHT_VARIANTS.items()] + [(n, "kv", v) for n, v in KV_VARIANTS.items()]
    for name, kind, spec in variants:
        if wanted and not any(s in name for s in wanted):
            continue
        if kind == "w":
            fn, only = spec
            if fn == "gptq":
                from kvfleet_server.quantize.calibration import calibration_text

                fn = gptq_rounding(llm, linears, original,
                                   tokenizer.encode(calibration_text(), add_special_tokens=False))
            for n, m in linears:
                f = fn if callable(fn) else next(g for suffix, g in fn.items() if n.endswith(suffix))
                m.weight.data.copy_(f(original[n]) if only is None or n.endswith(only) else original[n])
        else:
            kv_mode["spec"] = spec
        scores = score()
        for n, m in linears:
            m.weight.data.copy_(original[n])
        kv_mode.clear()
        ppl, ch = perplexity(scores), loglik_change(scores, ref)
        rows.append({"variant": name, "perplexity": ppl, "perplexity_change_pct": 100 * (ppl / ref_ppl - 1),
                     "loglik_change_mean": ch.mean, "loglik_change_mean_abs": ch.mean_abs})
        print(f"{name:<58}{ppl:>9.4f}{100 * (ppl / ref_ppl - 1):>8.2f}{ch.mean:>10.4f}{ch.mean_abs:>11.4f}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"windows": args.windows, "window_len": args.window_len, "results": rows}, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
