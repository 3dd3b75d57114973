"""Tensor-parallel overhead (issue 12): the same batch through the engine at TP = 1 and TP = N, one
engine per size, side by side in one run; per decode step the wall time, and within it the time rank 0
spends broadcasting the step's batch (pickle + two gloo broadcasts over the CPU group), in the
all-reduces (2 per layer: o_proj, down_proj; plus the embedding's) and in the logits gather; and the
all-reduce's transfer cost alone (ranks idle, no compute to wait for). Prints ratios and writes JSON
under benchmarks/results/.

    python benchmarks/tensor_parallel.py                      # SmolLM2 (9/3 heads), TP 1 vs 3, this machine
    python benchmarks/tensor_parallel.py --tp 1 3 --requests 16 --output-len 64

On a CPU the ranks are processes on the same cores (gloo; rank r ≥ 1 pinned when there is a core per
rank): no speed-up is expected on a 2-core machine, the point is the overhead. The same command runs
unchanged on a machine with ≥ N GPUs (``--device auto`` picks CUDA; NCCL for the all-reduces, gloo for
the broadcast); timed collectives synchronize the device, which adds a little to the CUDA step time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def run_size(args, tp: int) -> dict:
    import torch

    from kvfleet_server import EngineConfig, LLMEngine, SamplingParams

    cfg = dict(model=args.model, tensor_parallel_size=tp, device=args.device, dtype=args.dtype,
               max_model_len=args.prompt_len + args.output_len + 16, num_threads=args.num_threads)
    if args.kv_cache_memory_bytes:
        cfg["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes // tp
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(**cfg))
    build_s = time.perf_counter() - t0
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    runs = []
    try:
        for rep in range(args.repeats):
            for i in range(args.requests):
                prompt = [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)]
                eng.add_request(f"r{rep}-{i}", prompt, SamplingParams(temperature=0, max_tokens=args.output_len,
                                                                      ignore_eos=True))
            eng.tp.timer.enabled = True
            steps = []
            t_run = time.perf_counter()
            tokens = 0
            while eng.has_unfinished():
                eng.tp.timer.reset()
                t = time.perf_counter()
                eng.step()
                dt = time.perf_counter() - t
                it = eng.last_iteration
                tokens += it.num_generation_tokens
                sec = dict(eng.tp.timer.seconds)
                steps.append({"s": dt, "decode": it.num_prompt_tokens == 0, "bytes": eng.tp.timer.broadcast_bytes,
                              **{k: sec.get(k, 0.0) for k in ("broadcast", "all_reduce", "gather")}})
            wall = time.perf_counter() - t_run
            dec = [s for s in steps if s["decode"]] or steps
            runs.append({
                "tok_per_s": tokens / wall,
                "decode_step_ms": 1e3 * statistics.median(s["s"] for s in dec),
                "broadcast_ms": 1e3 * statistics.median(s["broadcast"] for s in dec),
                "all_reduce_ms": 1e3 * statistics.median(s["all_reduce"] for s in dec),
                "gather_ms": 1e3 * statistics.median(s["gather"] for s in dec),
                "broadcast_bytes": statistics.median(s["bytes"] for s in dec),
                "decode_steps": len(dec),
            })
        eng.tp.timer.enabled = False
        # the transfer alone: all-reduce of one decode step's activation with every rank idle
        probe_ms = 1e3 * eng.runner.probe_all_reduce(args.requests, 50) if tp > 1 else 0.0
    finally:
        eng.shutdown()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    per_step = 2 * eng.model_config.num_hidden_layers + 1  # o_proj + down_proj per layer, the embedding
    return {"tp": tp, "build_s": build_s, "device": eng.device, "runs": runs, **med,
            "all_reduce_idle_ms": probe_ms, "all_reduces_per_step": per_step,
            "all_reduce_transfer_ms_per_step": probe_ms * per_step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="runs per size; medians are reported")
    p.add_argument("--num-threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20,
                   help="KV pool of TP = 1; TP = N gets 1/N per rank (the same number of blocks)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "tensor_parallel.json"))
    args = p.parse_args()
    results = [run_size(args, tp) for tp in args.tp]
    base = results[0]
    print(f"model={args.model} requests={args.requests} prompt={args.prompt_len} output={args.output_len} "
          f"threads/rank={args.num_threads} device={base['device']} (medians of {args.repeats} runs)")
    print(f"{'TP':>3} {'tok/s':>8} {'decode step ms':>15} {'broadcast ms':>13} {'all-reduce ms':>14} "
          f"{'gather ms':>10} {'bcast bytes':>12} {'comm % of step':>15} {'step vs TP1':>12} "
          f"{'AR transfer ms/step':>20}")
    for r in results:
        comm = r["broadcast_ms"] + r["all_reduce_ms"] + r["gather_ms"]
        r["comm_fraction"] = comm / r["decode_step_ms"]
        r["step_ratio_vs_first"] = r["decode_step_ms"] / base["decode_step_ms"]
        r["tok_s_ratio_vs_first"] = r["tok_per_s"] / base["tok_per_s"]
        print(f"{r['tp']:>3} {r['tok_per_s']:>8.1f} {r['decode_step_ms']:>15.1f} {r['broadcast_ms']:>13.2f} "
              f"{r['all_reduce_ms']:>14.1f} {r['gather_ms']:>10.2f} {r['broadcast_bytes']:>12.0f} "
              f"{100 * r['comm_fraction']:>14.1f}% {r['step_ratio_vs_first']:>11.2f}x "
              f"{r['all_reduce_transfer_ms_per_step']:>20.1f}")
    print("all-reduce ms = rank 0's time inside the all-reduces of a step: the transfer plus waiting for the "
          "slowest rank's matmuls; AR transfer ms/step = idle-rank all-reduce latency x all-reduces per step")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
