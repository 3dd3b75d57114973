"""Quantization side by side, in one run (issue 11): for every weight format and KV-cache dtype on the
real SmolLM2-135M-Instruct — weight bytes, KV blocks at a fixed pool size, accuracy against float32
(perplexity on fixed windows of the stdlib's ``pydoc_data.topics``, per-token log-likelihood change,
greedy agreement on the 32 throughput prompts) and throughput (32 prompts × 64 greedy tokens, and
batch-1 decode). Prints a table with ratios to fp32 and bf16; writes JSON under benchmarks/results/.

The float reference is the bundled Q4_1 GGUF dequantized to float32 and saved as a Hugging Face
directory (``evaluate.export_float_checkpoint``): fp32 / bf16 run it unquantized, fp8 / int8 / int4
quantize it at load; "fp8-gptq" serves ``kvfleet-quantize``'s GPTQ-rounded FP8 checkpoint of it (written
once next to the float directory); "gguf" serves the .gguf file itself, packed. When llama-cpp-python is
importable (not a project dependency), llama.cpp's decode speed on the same .gguf is added.

    python benchmarks/quantization.py                      # everything (an hour on a busy shared 2-core CPU)
    python benchmarks/quantization.py --methods fp32,int8 --windows 2 --throughput-prompts 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time

METHODS = {
    # name: (model source, EngineConfig overrides)
    "fp32": ("float", dict(dtype="float32")),
    "bf16": ("float", dict(dtype="bfloat16")),
    "gguf": ("gguf", dict()),  # the default for a .gguf file: packed, bfloat16 activations
    "int8": ("float", dict(quantization="int8")),  # dtype auto: bfloat16 activations
    "int4": ("float", dict(quantization="int4")),
    "fp8": ("float", dict(quantization="fp8")),  # dtype auto: float32 activations on CPU (weight-only)
    # kvfleet-quantize's GPTQ FP8_DYNAMIC checkpoint of the same float weights (calibrated on stdlib
    # docstrings, not the scored text): the same grid, scales and kernels as fp8
    "fp8-gptq": ("fp8-gptq", dict()),
    "fp32+kv-fp8": ("float", dict(dtype="float32", kv_cache_dtype="fp8")),
    "gguf-fp32": ("gguf", dict(dtype="float32", quantization="gguf")),  # packed, exact float32 path
    "bf16+kv-fp8": ("float", dict(dtype="bfloat16", kv_cache_dtype="fp8")),
}


def throughput_prompts(n: int, seed: int = 0) -> list[str]:
    """n short English prompts from the reference text (the peers' workload shape: 32 prompts)."""
    from kvfleet_server.evaluate import reference_text

    paras = [p.strip() for p in reference_text().split("\n\n") if 200 < len(p.strip()) < 600]
    rng = random.Random(seed)
    return [p[:240] for p in rng.sample(paras, n)]


def run_method(name, src, overrides, args, windows, prompts, ref):
    from kvfleet_server import LLM, SamplingParams
    from kvfleet_server.evaluate import greedy_agreement, loglik_change, perplexity, score_windows

    t0 = time.perf_counter()
    llm = LLM(src, device="cpu", num_threads=args.threads, kv_cache_memory_bytes=args.kv_bytes,
              max_num_seqs=64, **overrides)
    eng = llm.engine
    r = {"method": name, "load_seconds": time.perf_counter() - t0, "weight_bytes": eng.weight_bytes,
         "activation_dtype": str(eng.dtype).replace("torch.", ""), "quantization": eng.quantization,
         "kv_cache_dtype": str(eng.kv_cache_dtype).replace("torch.", ""), "kv_blocks": eng.num_blocks}
    scores = score_windows(llm, windows)
    eng.kv.pool.reset_prefix_cache()
    r["perplexity"] = perplexity(scores)
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    toks = None
    if not args.accuracy_only:
        r.update(_throughput(llm, eng, greedy, prompts, args))
        toks = r.pop("tokens")
    if ref is not None:
        ch = loglik_change(scores, ref["scores"])
        r["perplexity_change_pct"] = 100 * (r["perplexity"] / ref["perplexity"] - 1)
        r["loglik_change"] = {"mean": ch.mean, "mean_abs": ch.mean_abs, "max_abs": ch.max_abs}
        if toks is not None:
            r["greedy"] = greedy_agreement(toks, ref["tokens"])
    del llm, eng
    return r, scores, toks


def _throughput(llm, eng, greedy, prompts, args) -> dict:
    """32 prompts × output_len greedy tokens (median of ``repeats``) and batch-1 decode of the first prompt."""
    runs = []
    for _ in range(args.repeats):
        eng.kv.pool.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, greedy)
        runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    one = []
    for _ in range(args.batch1_repeats):
        eng.kv.pool.reset_prefix_cache()
        t = time.perf_counter()
        o = llm.generate(prompts[0], greedy)[0]
        one.append(len(o.outputs[0].token_ids) / (time.perf_counter() - t))
    return {"throughput_tok_s": statistics.median(runs), "throughput_runs": runs,
            "batch1_tok_s": statistics.median(one), "tokens": [o.outputs[0].token_ids for o in outs]}


def run_llama_cpp(gguf_path, prompts, output_len, threads):
    try:
        from llama_cpp import Llama
    except ImportError:
        return {"available": False, "note": "llama-cpp-python is not installed (not a project dependency)"}
    llm = Llama(model_path=gguf_path, n_threads=threads, verbose=False, n_ctx=1024)
    t = time.perf_counter()
    n = 0
    for p in prompts[:1]:
        out = llm(p, max_tokens=output_len, temperature=0.0)
        n += out["usage"]["completion_tokens"]
    return {"available": True, "batch1_tok_s": n / (time.perf_counter() - t)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    ap.add_argument("--windows", type=int, default=6, help="perplexity windows (fixed, from the start of the text)")
    ap.add_argument("--window-len", type=int, default=512, help="tokens per perplexity window")
    ap.add_argument("--throughput-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="runs of the 32-prompt batch per method (median)")
    ap.add_argument("--batch1-repeats", type=int, default=3, help="runs of the batch-1 decode per method (median)")
    ap.add_argument("--accuracy-only", action="store_true",
                    help="perplexity and log-likelihood only (no throughput, no greedy agreement)")
    ap.add_argument("--threads", type=int, default=1, help="engine threads (the test machine is shared)")
    ap.add_argument("--kv-bytes", type=int, default=64 << 20, help="kv_cache_memory_bytes for every method")
    ap.add_argument("--float-dir", default=None, help="reuse an exported float32 checkpoint directory")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quantization.json"))
    args = ap.parse_args(argv)
    from kvfleet_server.config import bundled_model_path
    from kvfleet_server.evaluate import export_float_checkpoint, fixed_windows, reference_text
    from kvfleet_server.model.tokenizer import Tokenizer

    gguf = bundled_model_path()
    float_dir = args.float_dir or os.path.join(tempfile.gettempdir(), "kvfleet-smollm2-float32")
    if not os.path.isfile(os.path.join(float_dir, "model.safetensors")):
        export_float_checkpoint(gguf, float_dir)
    tok = Tokenizer.from_path(float_dir, [])
    windows = fixed_windows(tok.encode(reference_text(), add_special_tokens=False), args.window_len, args.windows)
    prompts = throughput_prompts(args.throughput_prompts)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    if names[0] != "fp32":
        names.insert(0, "fp32")  # the reference
    sources = {"float": float_dir, "gguf": gguf, "fp8-gptq": float_dir + "-fp8-gptq"}
    if "fp8-gptq" in names and not os.path.isfile(os.path.join(sources["fp8-gptq"], "model.safetensors")):
        from kvfleet_server.quantize.cli import main as quantize

        if quantize(["--model", float_dir, "--output", sources["fp8-gptq"]]) != 0:
            raise SystemExit("kvfleet-quantize failed")
    results, ref = [], None
    for name in names:
        src_kind, overrides = METHODS[name]
        r, scores, toks = run_method(name, sources[src_kind], overrides, args, windows, prompts, ref)
        if ref is None:
            ref = {"scores": scores, "tokens": toks, "perplexity": r["perplexity"]}
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("greedy", "throughput_runs")}), flush=True)
        _write(args, prompts, results, None)  # partial results survive an interrupted run
    base = {r["method"]: r for r in results}
    nan = float("nan")
    for r in results:
        for b in ("fp32", "bf16"):
            if b in base and "throughput_tok_s" in r:
                r[f"throughput_vs_{b}"] = r["throughput_tok_s"] / base[b]["throughput_tok_s"]
                r[f"batch1_vs_{b}"] = r["batch1_tok_s"] / base[b]["batch1_tok_s"]
    llama_cpp = None if args.accuracy_only else run_llama_cpp(gguf, prompts, args.output_len, args.threads)
    print(f"\n{'method':<13}{'act':>9}{'weights MiB':>12}{'KV blocks':>10}{'ppl':>8}{'Δppl %':>8}"
          f"{'Δll mean':>9}{'greedy ≡':>9}{'agree tok':>10}{'tok/s b32':>10}{'×fp32':>7}{'×bf16':>7}"
          f"{'tok/s b1':>9}{'×bf16':>7}")
    for r in results:
        g = r.get("greedy", {})
        print(f"{r['method']:<13}{r['activation_dtype']:>9}{r['weight_bytes'] / 2**20:>12.1f}{r['kv_blocks']:>10}"
              f"{r['perplexity']:>8.3f}{r.get('perplexity_change_pct', 0):>8.2f}"
              f"{r.get('loglik_change', {}).get('mean', 0):>9.4f}{g.get('identical', 1):>9.2f}"
              f"{g.get('mean_tokens_until_divergence', args.output_len):>10.1f}{r.get('throughput_tok_s', nan):>10.1f}"
              f"{r.get('throughput_vs_fp32', 1):>7.2f}{r.get('throughput_vs_bf16', float('nan')):>7.2f}"
              f"{r.get('batch1_tok_s', nan):>9.1f}{r.get('batch1_vs_bf16', float('nan')):>7.2f}")
    print("llama.cpp:", llama_cpp)
    _write(args, prompts, results, llama_cpp)
    print("wrote", args.out)
    return 0


def _write(args, prompts, results, llama_cpp) -> None:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                               "note": "shared CPU; other work ran at the same time"},
                   "workload": {"perplexity_windows": args.windows, "window_len": args.window_len,
                                "throughput_prompts": len(prompts), "output_len": args.output_len,
                                "kv_cache_memory_bytes": args.kv_bytes},
                   "results": results, "llama_cpp": llama_cpp}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
