"""Prefix-caching benchmark on the real model (issue 7): a long shared system prompt followed by short
questions, run through kvfleet's engine with prefix caching off, block-only, and block + partial-block
matching. Reports TTFT p50 (requests sent one at a time, so TTFT is pure prefill work), throughput of a
concurrent batch, and the hit rate against the best possible (every shared-prefix token after the first
request). Writes JSON under benchmarks/results/.

    python benchmarks/prefix_cache.py                    # 2,000-token prefix, 16 questions of 50-200 tokens
    python benchmarks/prefix_cache.py --quick            # 500-token prefix, 6 questions
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch


def workload(prefix_len, n, qmin, qmax, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 49000) for _ in range(prefix_len)]
    return prefix, [prefix + [rng.randrange(100, 49000) for _ in range(rng.randint(qmin, qmax))] for _ in range(n)]


def measure(eng, prompts, output_len, mode):
    from kvfleet_server import SamplingParams

    eng.scheduler.enable_prefix_caching = mode != "off"
    eng.scheduler.partial_block_matching = mode == "block+partial"
    eng.kv.pool.reset_prefix_cache()
    p = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ttfts, hits, queries = [], 0, 0
    # 1) one at a time: TTFT
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        eng.add_request(f"{mode}-s{i}", prompt, p)
        first = None
        while eng.has_unfinished():
            for o in eng.step():
                if first is None and o.outputs[0].token_ids:
                    first = time.perf_counter() - t0
            hits += eng.last_iteration.prefix_cache_hits
            queries += eng.last_iteration.prefix_cache_queries
        ttfts.append(first)
    # 2) all at once: throughput (the cache is warm from part 1 when caching is on)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        eng.add_request(f"{mode}-b{i}", prompt, p)
    ntok = 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                ntok += len(o.outputs[0].token_ids)
    dt = time.perf_counter() - t0
    return {"ttft_p50_s": statistics.median(ttfts[1:]), "ttft_first_s": ttfts[0], "ttfts_s": ttfts,
            "hit_tokens": hits, "query_tokens": queries, "batch_tok_per_s": ntok / dt, "batch_seconds": dt}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--num-questions", type=int, default=16)
    ap.add_argument("--question-len", type=int, nargs=2, default=[50, 200])
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.prefix_len, args.num_questions = 500, 6
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvfleet_server import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(model=args.model, dtype="float32", device="cpu"))
    prefix, prompts = workload(args.prefix_len, args.num_questions, *args.question_len)
    best = (len(prompts) - 1) * len(prefix)  # the first request has to compute the prefix
    res = {"workload": vars(args), "loadavg_before": os.getloadavg(), "best_possible_hit_tokens": best}
    for mode in ("off", "block", "block+partial"):
        r = measure(eng, prompts, args.output_len, mode)
        r["hit_rate_vs_best"] = r["hit_tokens"] / best if best else 0.0
        res[mode] = r
        print(f"{mode:14s} TTFT p50 {r['ttft_p50_s'] * 1000:8.1f} ms (first {r['ttft_first_s'] * 1000:.0f} ms)  "
              f"batch {r['batch_tok_per_s']:7.1f} tok/s  hits {r['hit_tokens']}/{r['query_tokens']} tokens "
              f"({r['hit_rate_vs_best']:.1%} of best possible {best})")
    for mode in ("block", "block+partial"):
        res[mode]["ttft_vs_off"] = res[mode]["ttft_p50_s"] / res["off"]["ttft_p50_s"]
        print(f"{mode}: cached TTFT = {res[mode]['ttft_vs_off']:.1%} of uncached")
    res["loadavg_after"] = os.getloadavg()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "prefix_cache.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    print("wrote", out)


if __name__ == "__main__":
    main()
