"""Offline throughput: kvfleet's engine (its defaults, torch.compile'd layers, and the torch reference
attention of before the CPU kernel) vs Hugging Face transformers' static-batch ``generate`` on the same
weights, in one process.

Default workload, the peer workload of issue 16: 32 token-id prompts of 20-200 tokens (fixed seed),
64 output tokens each, greedy, ignore_eos (transformers: ``eos_token_id=-1``), float32, the bundled
SmolLM2-135M-Instruct GGUF. Prints output tokens/s of each, the ratios, token identity with
transformers, and where kvfleet's step time goes (model forward, logits, sampler, the rest: scheduler,
detokenizer, Python); with ``--repeats N`` each kvfleet variant runs N times, alternating, and the median
is reported. Variants (``--variants``): ``default`` = ``LLM(model)`` as a user gets it (the C++ CPU
paged-attention kernel and fused layer ops, oneDNN-prepacked linears, the CPU's compilation default:
eager), ``no-prepack`` = the same with ``F.linear``, ``no-fused-ops`` = the same with torch's
element-wise ops, ``compiled`` = ``-O3`` (piecewise torch.compile), ``before`` = eager with
``--attention-backend torch``, ``F.linear`` and torch's element-wise ops (the engine before the CPU
kernels and prepacking). With ``--vllm-python`` vLLM's CPU engine runs the same token ids on the same
float32 weights in a process beside kvfleet (``benchmarks/_vllm.py`` says how to install it beside the project), and the
ratio to it and the token identity are printed. Writes JSON under benchmarks/results/.

    python benchmarks/offline_throughput.py                        # the peer workload
    python benchmarks/offline_throughput.py --repeats 3 --threads 2
    python benchmarks/offline_throughput.py --quick                # 8 prompts × 32 tokens smoke run
    python benchmarks/offline_throughput.py --repeats 3 --threads 2 --variants default --vllm-python /opt/vllm-venv/bin/python
    python benchmarks/offline_throughput.py --num-prompts 64 --min-len 100 --max-len 500 --output-len 128
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import statistics
import time
from contextlib import contextmanager

import torch
import _vllm
from _common import print_cpu, write_json


def matmul_ceiling(cfg, prompt_tokens: int, num_prompts: int, output_len: int, rows: int = 512) -> dict:
    """Issue 16's ceiling: the workload's weight-matmul FLOPs at this machine's float32 matmul rate.

    FLOPs = 2 × (prompt tokens × decoder-layer weights + forwards that sample × (layer weights + lm_head));
    each prompt's first output token comes from its prefill's last position, so decoding adds
    ``output_len - 1`` forwards per prompt. The rate is ``torch.mm`` on this process's threads over the
    model's projection shapes with ``rows`` rows (median of 7 each; the layer shapes weighted by their FLOPs):
    the best a forward made only of these matmuls could do. Returns tflop, gflop_per_s, seconds, tok_per_s."""
    h, kvd = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    qd = cfg.num_attention_heads * cfg.head_dim
    layer = [(h, qd + 2 * kvd), (qd, h), (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)]
    layer_params = cfg.num_hidden_layers * sum(k * n for k, n in layer)
    head_params = h * cfg.vocab_size
    sampled = num_prompts * output_len
    flops = 2 * (prompt_tokens * layer_params + (sampled - num_prompts) * layer_params + sampled * head_params)

    def seconds_per_flop(k: int, n: int) -> float:
        a, b = torch.randn(rows, k), torch.randn(k, n)
        for _ in range(2):
            a @ b
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            a @ b
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) / (2 * rows * k * n)

    layer_s = sum(seconds_per_flop(k, n) * k * n for k, n in layer) / sum(k * n for k, n in layer)
    head_s = seconds_per_flop(h, cfg.vocab_size)
    seconds = (flops - 2 * sampled * head_params) * layer_s + 2 * sampled * head_params * head_s
    return {"tflop": flops / 1e12, "gflop_per_s": flops / seconds / 1e9, "seconds": seconds,
            "tok_per_s": sampled / seconds, "rows": rows}


def make_prompts(n: int, min_len: int, max_len: int, vocab_lo: int = 100, vocab_hi: int = 49000, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


@contextmanager
def step_breakdown(llm):
    """Accumulate seconds spent in the model forward (runner.execute), the logits, the sampler and the
    whole step; yields the dict, filled on exit ("other" = scheduler, detokenizer, Python)."""
    from kvfleet_server.engine import llm_engine

    eng, acc = llm.engine, {"forward": 0.0, "logits": 0.0, "sampler": 0.0, "step": 0.0, "steps": 0}

    def timed(key, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t
        return wrapper

    saved = (eng.runner.execute, eng.runner.compute_logits, llm_engine.sample, eng.step)
    eng.runner.execute = timed("forward", saved[0])
    eng.runner.compute_logits = timed("logits", saved[1])
    llm_engine.sample = timed("sampler", saved[2])
    step = timed("step", saved[3])

    def counted():
        acc["steps"] += 1
        return step()
    eng.step = counted
    try:
        yield acc
    finally:
        eng.runner.execute, eng.runner.compute_logits, llm_engine.sample, eng.step = saved
        for k in ("forward", "logits", "sampler"):
            acc[k] = round(acc[k], 3)
        acc["other"] = round(acc["step"] - acc["forward"] - acc["logits"] - acc["sampler"], 3)
        acc["step"] = round(acc["step"], 3)


VARIANTS = {
    "default": {},
    "no-prepack": {"cpu_weight_prepack": False},
    "no-fused-ops": {"cpu_fused_ops": False},
    "compiled": {"compilation_config": {"level": 3}},
    "before": {"attention_backend": "torch", "cpu_weight_prepack": False, "cpu_fused_ops": False,
               "enforce_eager": True},
}


def load_kvfleet(model, max_num_batched_tokens, max_num_seqs, **variant):
    from kvfleet_server import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32", device="cpu", max_num_batched_tokens=max_num_batched_tokens,
              max_num_seqs=max_num_seqs, **variant)
    load_s = time.perf_counter() - t0
    llm.generate([[100] * 8] * 2, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    return llm, load_s


def run_kvfleet(llm, prompts, output_len):
    from kvfleet_server import SamplingParams

    llm.engine.kv.pool.reset_prefix_cache()
    with step_breakdown(llm) as breakdown:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
        dt = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    n = sum(map(len, toks))
    return {"seconds": dt, "output_tokens": n, "tok_per_s": n / dt, "step_breakdown_s": breakdown,
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


def vllm_job(args, model_path: str, prompts) -> _vllm.Job:
    """vLLM's CPU engine on the same float32 weights, token ids, scheduler budget and threads
    (``benchmarks/_vllm.py``), loaded and warmed up: each ``run()`` is one timed run; ``.version`` is vLLM's."""
    job = _vllm.Job(args.vllm_python, {"kind": "offline", "model": _vllm.hf_checkpoint(model_path), "prompts": prompts,
                                       "max_tokens": args.output_len, "ignore_eos": True,
                                       "engine": vllm_engine_args(args)}, torch.get_num_threads())
    try:
        job.version = job.read()["version"]  # ready
    except BaseException:
        job.__exit__(None, None, None)
        raise
    return job


def vllm_engine_args(args) -> dict:
    return {"dtype": "float32", "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs, "max_model_len": max(2048, args.max_len + args.output_len), "seed": 0}


def median_run(runs: list[dict]) -> dict:
    """The run with the median tok/s (all runs' tok/s kept under "runs_tok_per_s")."""
    by = sorted(runs, key=lambda r: r["tok_per_s"])
    med = dict(by[len(by) // 2])
    med["runs_tok_per_s"] = [round(r["tok_per_s"], 1) for r in runs]
    med["median_tok_per_s"] = statistics.median(r["tok_per_s"] for r in runs)
    return med


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of each kvfleet variant (median reported)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="kvfleet engine variants to run (the first is the headline)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads for both (default: torch's)")
    ap.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch size (default: all prompts)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    _vllm.add_argument(ap)
    ap.add_argument("--quick", action="store_true", help="8 prompts × 32 tokens")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/offline_throughput.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.output_len = 8, 32
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvfleet_server.config import resolve_model

    model_path = resolve_model(args.model)
    print_cpu()
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len)
    load_before = os.getloadavg()
    res = {"workload": {"num_prompts": args.num_prompts, "prompt_len": [args.min_len, args.max_len],
                        "prompt_tokens": sum(map(len, prompts)), "output_len": args.output_len, "greedy": True,
                        "ignore_eos": True, "dtype": "float32", "model": model_path},
           "machine": {"threads": torch.get_num_threads(), "cpus": os.cpu_count(), "loadavg_before": load_before,
                       "torch": torch.__version__, "python": platform.python_version()}}
    with vllm_job(args, model_path, prompts) if args.vllm_python else contextlib.nullcontext() as vllm:
        engines = {name: load_kvfleet(args.model, args.max_num_batched_tokens, args.max_num_seqs, **VARIANTS[name])
                   for name in args.variants}
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        toks: dict[str, list] = {}
        vllm_runs: list[dict] = []
        vllm_version = vllm.version if vllm else None
        for _ in range(args.repeats):  # alternate the variants (and vLLM): load drifts on a shared machine
            for name, (llm, _) in engines.items():
                r, toks[name] = run_kvfleet(llm, prompts, args.output_len)
                runs[name].append(r)
                print(f"kvfleet {name:15s}: {r['output_tokens']} tokens in {r['seconds']:.1f}s = "
                      f"{r['tok_per_s']:.1f} tok/s; step time {r['step_breakdown_s']}", flush=True)
            if vllm:
                v = vllm.run()
                vllm_runs.append(v)
                print(f"vLLM CPU engine        : {v['output_tokens']} tokens in {v['seconds']:.1f}s = "
                      f"{v['output_tokens'] / v['seconds']:.1f} tok/s", flush=True)
    for name, (llm, load_s) in engines.items():
        res[f"kvfleet_{name}"] = median_run(runs[name]) | {
            "load_seconds": load_s, "attention_backend": llm.engine.runner.backend.name,
            "compilation_level": llm.engine.config.resolved_compilation_level()}
    head = args.variants[0]
    kv = res[f"kvfleet_{head}"]
    res["headline_variant"] = head
    ceiling = matmul_ceiling(engines[head][0].engine.model.config, res["workload"]["prompt_tokens"],
                             args.num_prompts, args.output_len)
    res["matmul_ceiling"] = ceiling
    res["fraction_of_ceiling"] = kv["median_tok_per_s"] / ceiling["tok_per_s"]
    print(f"kvfleet {head} median {kv['median_tok_per_s']:.1f} tok/s = {res['fraction_of_ceiling']:.0%} of this "
          f"machine's matmul ceiling ({ceiling['tflop']:.2f} TFLOP of weight matmuls at "
          f"{ceiling['gflop_per_s']:.0f} GFLOP/s float32 = {ceiling['seconds']:.1f} s = "
          f"{ceiling['tok_per_s']:.0f} tok/s)")
    for name in args.variants[1:]:
        other = res[f"kvfleet_{name}"]["median_tok_per_s"]
        res[f"{head}_over_{name}"] = kv["median_tok_per_s"] / other
        res[f"{head}_equals_{name}"] = sum(a == b for a, b in zip(toks[head], toks[name]))
        print(f"{head} / {name}: {res[f'{head}_over_{name}']:.2f}x; identical sequences "
              f"{res[f'{head}_equals_{name}']}/{len(prompts)}")
    del engines
    if vllm_runs:
        rates = [r["output_tokens"] / r["seconds"] for r in vllm_runs]
        res["vllm"] = {"version": vllm_version, "engine": vllm_engine_args(args),
                       "runs_tok_per_s": [round(r, 1) for r in rates], "median_tok_per_s": statistics.median(rates),
                       "identical_to_kvfleet": sum(a == b for a, b in zip(toks[head], vllm_runs[-1]["token_ids"]))}
        res["ratio_to_vllm"] = kv["median_tok_per_s"] / res["vllm"]["median_tok_per_s"]
        # each repeat's kvfleet run (the headline variant) over that repeat's vLLM run: robust to a drifting machine
        res["ratio_to_vllm_pairwise_median"] = statistics.median(
            k["tok_per_s"] / r for k, r in zip(runs[head], rates))
        print(f"vLLM {res['vllm']['version']} CPU engine: runs {res['vllm']['runs_tok_per_s']} tok/s, median "
              f"{res['vllm']['median_tok_per_s']:.1f}; ratio kvfleet ({head}) / vLLM: {res['ratio_to_vllm']:.2f}x "
              f"(median of each repeat's ratio {res['ratio_to_vllm_pairwise_median']:.2f}x); "
              f"identical sequences {res['vllm']['identical_to_kvfleet']}/{len(prompts)}")
    if not args.skip_hf:
        hf, hf_toks = run_transformers(model_path, prompts, args.output_len, args.hf_batch_size or args.num_prompts)
        hf["tok_per_s"] = hf["output_tokens"] / hf["seconds"]
        res["transformers"] = hf
        res["ratio"] = kv["median_tok_per_s"] / hf["tok_per_s"]
        res["identical_sequences"] = sum(a == b for a, b in zip(toks[head], hf_toks))
        print(f"transformers: {hf['output_tokens']} tokens in {hf['seconds']:.1f}s = {hf['tok_per_s']:.1f} tok/s "
              f"(batch {hf['batch_size']})")
        print(f"ratio kvfleet ({head}) / transformers: {res['ratio']:.2f}x; identical sequences "
              f"{res['identical_sequences']}/{len(prompts)}")
    res["machine"]["loadavg_after"] = os.getloadavg()
    out = write_json(res, "offline_throughput", args.out)
    print(f"wrote {out} (load average before {load_before[0]:.1f}, after {res['machine']['loadavg_after'][0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
