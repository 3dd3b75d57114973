"""Prefix-caching benchmark on the real model (issue 7): a long shared system prompt followed by short
questions, run through kvfleet's engine with prefix caching off, block-only, and block + partial-block
matching. Reports TTFT p50 (requests sent one at a time, so TTFT is pure prefill work), throughput of a
concurrent batch, and the hit rate against the best possible (every shared-prefix token after the first
request). Writes JSON under benchmarks/results/.

    python benchmarks/prefix_cache.py                    # 2,000-token prefix, 16 questions of 50-200 tokens
    python benchmarks/prefix_cache.py --quick            # 500-token prefix, 6 questions

``--compare-prefix-caching`` measures the same thing end to end over HTTP instead: it starts two real
``kvfleet-server`` processes on 127.0.0.1 (``--enable-prefix-caching`` and ``--no-enable-prefix-caching``),
runs kvfleet-bench's shared-prefix dataset against each at every ``--concurrency`` (the system prompt is
sized with the server's /tokenize to ``--prefix-tokens``; a fresh seed, hence a fresh system prompt, per
concurrency), reads the prefix-cache counters from /metrics before and after, and prints TTFT p50,
throughput and the hit rate against the best possible side by side:

    python benchmarks/prefix_cache.py --compare-prefix-caching --num-questions 16 --concurrency 1 4
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
    ap.add_argument("--compare-prefix-caching", action="store_true",
                    help="start kvfleet-server with caching on and off and benchmark both over HTTP")
    ap.add_argument("--prefix-tokens", type=int, default=2000, help="(compare) shared system prompt, in tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="(compare) max concurrency levels")
    ap.add_argument("--server-arg", action="append", default=[], help="(compare) extra kvfleet-server argument")
    args = ap.parse_args(argv)
    if args.compare_prefix_caching:
        return compare(args)
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


# ---------------------------------------------------------------------------------------- over HTTP

PREFIX_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total")


def scrape_counters(url):
    """The prefix-cache and prompt-token counters of a server's /metrics (summed over label sets)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(PREFIX_COUNTERS, 0.0)
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def tokenize(url, text):
    import httpx

    r = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def completion_prompt(req):
    """The text kvfleet-bench sends on /v1/completions for a shared-prefix request."""
    return (req.system + "\n\n" if req.system else "") + req.prompt


def best_possible_hits(token_lists, history=()):
    """Upper bound on the prompt tokens any prefix cache can reuse for ``token_lists``, whatever order they
    arrive in, on a server that already served the prompts ``history``.

    m_i = prompt i's longest common token prefix with any other prompt (of this run or the history), capped
    at its length - 1 (the last prompt token is always computed, for the logits); h_i the same against the
    history only. The first prompt of the run to arrive reuses at most h_i and every other at most m_i, so
    the bound is sum(m) - min(m - h); for prompts sent one at a time in list order with one shared system
    prompt it is reached exactly.
    """
    def lcp(a, b):
        k = 0
        for x, y in zip(a, b):
            if x != y:
                break
            k += 1
        return k

    if not token_lists:
        return 0
    h = [min(len(t) - 1, max((lcp(t, u) for u in history), default=0)) for t in token_lists]
    m = [max(h[i], min(len(t) - 1, max((lcp(t, u) for j, u in enumerate(token_lists) if j != i), default=0)))
         for i, t in enumerate(token_lists)]
    return sum(m) - min(mi - hi for mi, hi in zip(m, h))


def sized_dataset(url, args, seed):
    """kvfleet-bench shared-prefix requests whose system prompt is about ``args.prefix_tokens`` tokens and
    whose questions are ``args.question_len`` tokens (word counts calibrated with the server's /tokenize)."""
    from kvfleet_server.bench import make_dataset

    probe = make_dataset("shared-prefix", 1, 200, 1, 0.0, 1000, seed)[0]
    per_word_sys = len(tokenize(url, probe.system)) / 1000
    per_word_q = len(tokenize(url, probe.prompt)) / 200
    words = max(1, round(args.prefix_tokens / per_word_sys))
    qmin, qmax = args.question_len
    mid = (qmin + qmax) / 2
    in_words = max(1, round(mid / per_word_q))
    ratio = (qmax - qmin) / (qmax + qmin)
    reqs = make_dataset("shared-prefix", args.num_questions, in_words, args.output_len, ratio, words, seed)
    return reqs, words, in_words, ratio


def _run_one(url, reqs, concurrency):
    import asyncio

    from kvfleet_server.bench import run_benchmark

    before = scrape_counters(url)
    s = asyncio.run(run_benchmark(url, None, reqs, max_concurrency=concurrency, progress=False))
    after = scrape_counters(url)
    d = {k: after[k] - before[k] for k in PREFIX_COUNTERS}
    s.pop("_results", None)
    return s, d


def compare(args):
    """Start kvfleet-server with caching on, then off; run the same shared-prefix requests against each."""
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "tests", "server"))
    from server_fixtures import start_server

    extra = list(args.server_arg)
    if args.threads:
        extra += ["--num-threads", str(args.threads)]
    res = {"workload": {k: v for k, v in vars(args).items()}, "loadavg_before": os.getloadavg(), "runs": []}
    datasets = {}
    for caching in (True, False):
        flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
        log = os.path.join(here, "results", f"prefix_cache_server_{'on' if caching else 'off'}.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        srv = start_server(["--model", args.model, flag, "--disable-uvicorn-access-log", *extra], log,
                           ready_timeout=300)
        history = []  # prompts this server has seen (its cache may hold them)
        try:
            for c in args.concurrency:
                if c not in datasets:  # a fresh system prompt per concurrency (same lead-in words, though)
                    reqs, words, in_words, ratio = sized_dataset(srv.url, args, seed=c)
                    toks = [tokenize(srv.url, completion_prompt(r)) for r in reqs]
                    sys_len = len(tokenize(srv.url, reqs[0].system))
                    datasets[c] = (reqs, {"prefix_words": words, "question_words": in_words, "range_ratio": ratio,
                                          "system_prompt_tokens": sys_len, "prompt_tokens": sum(map(len, toks)),
                                          "question_tokens_min_max": [min(map(len, toks)) - sys_len,
                                                                      max(map(len, toks)) - sys_len],
                                          "_tokens": toks,
                                          "system_prompt_only_best_hit_tokens": (len(reqs) - 1) * sys_len})
                reqs, info = datasets[c]
                toks = info["_tokens"]
                info["best_possible_hit_tokens"] = best_possible_hits(toks, history)
                s, d = _run_one(srv.url, reqs, c)
                history += toks
                run = {"prefix_caching": caching, "concurrency": c, "counters_delta": d,
                       **{k: v for k, v in info.items() if k != "_tokens"},
                       "hit_rate": d["vllm:prefix_cache_hits_total"] / d["vllm:prefix_cache_queries_total"]
                       if d["vllm:prefix_cache_queries_total"] else 0.0,
                       "best_possible_hit_rate": info["best_possible_hit_tokens"] / info["prompt_tokens"],
                       "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_mean_ms": s["ttft_ms"]["mean"],
                       "output_throughput": s["output_throughput"],
                       "total_token_throughput": s["total_token_throughput"],
                       "request_throughput": s["request_throughput"], "duration_s": s["duration_s"],
                       "completed": s["completed"], "failed": s["failed"], "errors": s["errors"]}
                res["runs"].append(run)
                print(f"caching={'on ' if caching else 'off'} c={c}: TTFT p50 {run['ttft_p50_ms']:.0f} ms, "
                      f"{run['request_throughput']:.2f} req/s, {run['total_token_throughput']:.0f} tok/s, "
                      f"hit rate {run['hit_rate']:.1%} (best {run['best_possible_hit_rate']:.1%}), "
                      f"{run['completed']}/{len(reqs)} ok", flush=True)
        finally:
            srv.stop()
    res["loadavg_after"] = os.getloadavg()
    print()
    print(format_compare(res["runs"]))
    out = args.out or os.path.join(here, "results", "prefix_cache_server.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    print("wrote", out)
    return 0 if all(r["failed"] == 0 for r in res["runs"]) else 1


def format_compare(runs):
    """Markdown table: per concurrency, caching on vs off, with on/off ratios."""
    lines = ["| concurrency | caching | TTFT p50 (ms) | req/s | total tok/s | hits / queries (tokens) | hit rate "
             "| best possible |",
             "|---|---|---|---|---|---|---|---|"]
    by = {(r["concurrency"], r["prefix_caching"]): r for r in runs}
    for c in sorted({r["concurrency"] for r in runs}):
        for caching in (True, False):
            r = by.get((c, caching))
            if r is None:
                continue
            d = r["counters_delta"]
            lines.append(f"| {c} | {'on' if caching else 'off'} | {r['ttft_p50_ms']:.0f} | "
                         f"{r['request_throughput']:.2f} | {r['total_token_throughput']:.0f} | "
                         f"{d['vllm:prefix_cache_hits_total']:.0f} / {d['vllm:prefix_cache_queries_total']:.0f} | "
                         f"{r['hit_rate']:.1%} | {r['best_possible_hit_rate']:.1%} |")
        on, off = by.get((c, True)), by.get((c, False))
        if on and off:
            lines.append(f"| {c} | on/off | {on['ttft_p50_ms'] / off['ttft_p50_ms']:.1%} | "
                         f"{on['request_throughput'] / off['request_throughput']:.2f}x | "
                         f"{on['total_token_throughput'] / off['total_token_throughput']:.2f}x | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
