"""Multi-LoRA throughput: output tokens/s of a batch of 32 requests spread over 0, 1, 4 and 16 distinct adapters
against the base model alone (LoRA off), in one process, configurations alternating per repeat.

Workload: the bundled SmolLM2-135M-Instruct in float32 (the offline benchmark's weights), 32 token-id prompts
of 64-128 tokens (fixed seed), 64 greedy output tokens each (ignore_eos); ``--enable-lora --max-loras 16
--max-lora-rank R`` with PEFT adapters of rank R on all seven projections (seeded random weights, written
by tests/server/lora_helpers.py); request i runs adapter i mod N. "0 adapters" is LoRA on with every request
on the base model (what enabling LoRA costs by itself). Prints the median output tok/s of each
configuration and its ratio to the base model, with the CPU model.

    python benchmarks/lora.py --repeats 3 --threads 2
    python benchmarks/lora.py --rank 8 --adapters 0 1 4 16
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

from _common import write_json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server"))
from lora_helpers import make_adapter  # noqa: E402


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def run(eng, prompts, loras, output_len: int) -> float:
    """Output tokens/s of the whole batch (added at once, stepped to completion)."""
    from kvfleet_server import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params, lora_request=loras[i % len(loras)] if loras else None)
    tokens = 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                tokens += len(o.outputs[0].token_ids)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from kvfleet_server import EngineConfig, LLMEngine

    threads = args.threads or torch.get_num_threads()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randrange(64, 129))] for _ in range(args.batch)]
    common = dict(model="smollm2", dtype="float32", device="cpu", num_threads=threads, max_model_len=512,
                  kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    n_max = max(args.adapters)
    with tempfile.TemporaryDirectory() as tmp:
        base = LLMEngine(EngineConfig(**common))
        mc = base.model_config

        class Cfg:  # the projection sizes lora_helpers.make_adapter needs
            hidden_size, num_attention_heads, num_key_value_heads = mc.hidden_size, mc.num_attention_heads, \
                mc.num_key_value_heads
            head_dim, intermediate_size, num_hidden_layers = mc.head_dim, mc.intermediate_size, mc.num_hidden_layers

        mods = [{"name": f"a{i}", "path": make_adapter(os.path.join(tmp, f"a{i}"), Cfg, r=args.rank,
                                                       alpha=2 * args.rank, seed=i, std=0.01)}
                for i in range(n_max)]
        lora = LLMEngine(EngineConfig(**common, enable_lora=True, max_loras=max(n_max, 1), max_lora_rank=args.rank,
                                      max_cpu_loras=max(n_max, 1), lora_modules=mods))
        configs = {"base model (LoRA off)": (base, [])}
        for n in args.adapters:
            configs[f"{n} adapters"] = (lora, [lora.get_lora(f"a{i}") for i in range(n)])
        for eng, loras in configs.values():  # warm-up: first touches of the KV pool and the adapter slots
            run(eng, prompts[:4], loras, 4)
        results: dict[str, list[float]] = {k: [] for k in configs}
        for _ in range(args.repeats):
            for name, (eng, loras) in configs.items():
                results[name].append(run(eng, prompts, loras, args.output_len))
    med = {k: statistics.median(v) for k, v in results.items()}
    ref = med["base model (LoRA off)"]
    print(f"CPU: {cpu_model()}, {threads} threads; batch {args.batch}, {args.output_len} output tokens, "
          f"rank {args.rank} on q,k,v,o,gate,up,down; median of {args.repeats}")
    print(f"{'configuration':24s} {'out tok/s':>10s} {'× base':>8s}   runs")
    for name, v in med.items():
        runs = ", ".join(f"{x:.1f}" for x in results[name])
        print(f"{name:24s} {v:10.1f} {v / ref:7.2f}x   {runs}")
    write_json({"cpu": cpu_model(), "threads": threads, "rank": args.rank, "batch": args.batch,
                "output_len": args.output_len, "runs": results, "median": med,
                "ratio_to_base": {k: v / ref for k, v in med.items()}}, "lora")


if __name__ == "__main__":
    main()
