"""Offline throughput: kvfleet's engine vs Hugging Face transformers' batched ``generate`` on the same
weights, in one process.

Workload (issue 2): 64 synthetic prompts of 100-500 tokens (fixed seed), 128 output tokens each, greedy,
ignore_eos (transformers: ``eos_token_id=-1``), float32, the bundled SmolLM2-135M-Instruct GGUF. Prints
output tokens/s for both and the ratio; writes JSON under benchmarks/results/.

    python benchmarks/offline_throughput.py                 # the full workload
    python benchmarks/offline_throughput.py --quick         # 8 prompts × 32 tokens smoke run
    python benchmarks/offline_throughput.py --num-prompts 32 --output-len 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import torch


def make_prompts(n: int, min_len: int, max_len: int, vocab_lo: int = 100, vocab_hi: int = 49000, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def run_kvfleet(model, prompts, output_len, max_num_batched_tokens, max_num_seqs):
    from kvfleet_server import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32", device="cpu", max_num_batched_tokens=max_num_batched_tokens,
              max_num_seqs=max_num_seqs)
    load_s = time.perf_counter() - t0
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.engine.kv.pool.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    dt = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    return {"seconds": dt, "load_seconds": load_s, "output_tokens": sum(map(len, toks)),
            "preemptions": sum(o.metrics.num_preemptions for o in outs)}, toks


def run_transformers(model_path, prompts, output_len, batch_size):
    from transformers import AutoModelForCausalLM

    d, f = os.path.dirname(model_path), os.path.basename(model_path)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    pad = 2
    with torch.inference_mode():
        w = torch.tensor([prompts[0][:8]])
        model.generate(w, attention_mask=torch.ones_like(w), max_new_tokens=4, do_sample=False, eos_token_id=-1,
                       pad_token_id=pad)
        t0 = time.perf_counter()
        toks = []
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b : b + batch_size]
            L = max(map(len, batch))
            ids = torch.tensor([[pad] * (L - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
            g = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, do_sample=False,
                               eos_token_id=-1, pad_token_id=pad)
            toks += g[:, L:].tolist()
        dt = time.perf_counter() - t0
    return {"seconds": dt, "load_seconds": load_s, "output_tokens": sum(map(len, toks)), "batch_size": batch_size}, toks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=500)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads for both (default: torch's)")
    ap.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch size (default: all prompts)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="8 prompts × 32 tokens")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/offline_throughput.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.output_len = 8, 32
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvfleet_server.config import resolve_model

    model_path = resolve_model(args.model)
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len)
    load_before = os.getloadavg()
    res = {"workload": {"num_prompts": args.num_prompts, "prompt_len": [args.min_len, args.max_len],
                        "prompt_tokens": sum(map(len, prompts)), "output_len": args.output_len, "greedy": True,
                        "ignore_eos": True, "dtype": "float32", "model": model_path},
           "machine": {"threads": torch.get_num_threads(), "cpus": os.cpu_count(), "loadavg_before": load_before,
                       "torch": torch.__version__, "python": platform.python_version()}}
    kv, kv_toks = run_kvfleet(args.model, prompts, args.output_len, args.max_num_batched_tokens, args.max_num_seqs)
    kv["tok_per_s"] = kv["output_tokens"] / kv["seconds"]
    res["kvfleet"] = kv
    print(f"kvfleet:      {kv['output_tokens']} tokens in {kv['seconds']:.1f}s = {kv['tok_per_s']:.1f} tok/s")
    if not args.skip_hf:
        hf, hf_toks = run_transformers(model_path, prompts, args.output_len, args.hf_batch_size or args.num_prompts)
        hf["tok_per_s"] = hf["output_tokens"] / hf["seconds"]
        res["transformers"] = hf
        res["ratio"] = kv["tok_per_s"] / hf["tok_per_s"]
        res["identical_sequences"] = sum(a == b for a, b in zip(kv_toks, hf_toks))
        print(f"transformers: {hf['output_tokens']} tokens in {hf['seconds']:.1f}s = {hf['tok_per_s']:.1f} tok/s "
              f"(batch {hf['batch_size']})")
        print(f"ratio kvfleet / transformers: {res['ratio']:.2f}x; identical sequences "
              f"{res['identical_sequences']}/{len(prompts)}")
    res["machine"]["loadavg_after"] = os.getloadavg()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "offline_throughput.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {out} (load average before {load_before[0]:.1f}, after {res['machine']['loadavg_after'][0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
