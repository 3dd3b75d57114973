"""The prepared GPU check (benchmarks/gpu/check.sh runs it): one run, under 8 minutes on an H200 by
construction, nothing beyond torch, triton and kvfleet's pure-Python dependencies (no network).

  1. kernels: each Triton kernel vs the torch backend on random paged inputs (relative error; odd
     context lengths, shared blocks, GQA 1/4/8, fp32 and bf16, an FP8 cache);
  2. decode: a random-weight model with Llama-3.1-8B shapes in bf16 (config built in code): step time
     at batch 1, 8, 64, 256 (context 512) eager and with CUDA graphs, tok/s, achieved bytes/s (weights
     but the embedding table + KV, read per step) / the measured device-to-device copy bandwidth;
  3. prefill: tok/s of 4 x 1024-token prompts and achieved TFLOP/s / the measured bf16 matmul rate;
  4. server: kvfleet-server on that model shape (SmolLM2's tokenizer, so vocab 49152) answering one
     streamed request.

Time budget (H200, by construction): model build + random fill ~20 s; section 1 ~15 s (24 small
launches + compile); section 2: 4 sizes x (10 warm-up + 30 timed eager, capture + 30 timed graphs)
~60 s, most of it Triton compiles; section 3: 3 + 5 prefills of 4096 tokens ~15 s; section 4: save
16 GB of safetensors, start, load, one request ~120-180 s. check.sh kills it at 470 s.

``--dry-run``: tiny shapes on the CPU under the Triton interpreter (graphs are CUDA-only: skipped),
what CI runs. Writes ``results.json`` into the results directory and prints a table last.
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
from kvfleet_server.model.llama import LlamaForCausalLM  # noqa: E402

LLAMA_8B = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TINY = dict(LLAMA_8B, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)

FULL = dict(kernel_seqs=[(1023, 1), (2047, 1), (511, 1), (4000, 1), (0, 300), (777, 129)], kernel_hd=128,
            batches=[1, 8, 64, 256], ctx=512, warmup=10, iters=30, prefill=(4, 1024), copy_mib=1024, mm=8192)
DRY = dict(kernel_seqs=[(37, 1), (16, 1), (0, 9), (20, 7)], kernel_hd=16,
           batches=[1, 2], ctx=24, warmup=1, iters=2, prefill=(2, 16), copy_mib=4, mm=64)


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
    rows = []
    oracle = TorchAttentionBackend()
    for dtype in (torch.float32, torch.bfloat16):
        for h, kvh in ((8, 8), (32, 8), (32, 4)) if p is FULL else ((4, 4), (8, 2), (8, 1)):
            case = make_case(p["kernel_seqs"], h, kvh, p["kernel_hd"], 16 if p is FULL else 8, dtype, device=dev)
            r = compare(TritonAttentionBackend(), oracle, case)
            rows.append({"dtype": str(dtype)[6:], "gqa": h // kvh, **r})
    case = make_case(p["kernel_seqs"], 8, 2, p["kernel_hd"], 16, torch.bfloat16, device=dev,
                     kv_cache_dtype=torch.float8_e4m3fn)
    rows.append({"dtype": "bfloat16/fp8-kv", "gqa": 4, **compare(TritonAttentionBackend(), oracle, case)})
    return rows


def build_model(cfg: ModelConfig, dev, dtype):
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg, max_positions=cfg.max_position_embeddings, quant_config=QuantConfig(None, dtype))
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


def decode_and_prefill(p, dev, dtype, cfg: ModelConfig) -> tuple[list[dict], dict, dict]:
    model = build_model(cfg, dev, dtype)
    bs = 16
    B_max, ctx = max(p["batches"]), p["ctx"]
    P, L = p["prefill"]
    num_blocks = max(B_max * -(-ctx // bs), P * -(-L // bs)) + 1
    runner = ModelRunner(model, num_blocks, bs, str(dev), dtype, TritonAttentionBackend())
    itemsize = torch.empty((), dtype=dtype).element_size()
    # bytes a decode step reads: every weight but the embedding table (only B rows of it are read)
    weight_bytes = model_weight_bytes(model)
    embed_bytes = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * itemsize
    read_bytes = weight_bytes - embed_bytes
    per_tok = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
    bw = copy_bandwidth(dev, p["copy_mib"])
    graphs = None
    if dev.type == "cuda":
        graphs = DecodeGraphs(runner, sorted(p["batches"]), -(-ctx // bs))
        graphs.capture()
    rows = []
    for B in p["batches"]:
        inp = decode_inputs(B, ctx, bs)
        row = {"batch": B}
        for mode in ("eager", "graphs"):
            runner.graphs = graphs if mode == "graphs" else None
            if mode == "graphs" and graphs is None:
                row["graphs_s"] = None
                continue
            t = timed(lambda: runner.run(inp), dev, p["warmup"], p["iters"])
            row[f"{mode}_s"] = t
        best = min(v for k, v in row.items() if k.endswith("_s") and v)
        moved = read_bytes + B * ctx * per_tok
        row.update(tok_s=B / best, bytes_per_s=moved / best, bw_frac=moved / best / bw,
                   graph_speedup=(row["eager_s"] / row["graphs_s"]) if row.get("graphs_s") else None)
        rows.append(row)
    runner.graphs = None
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
    del runner, model, graphs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows, prefill, {"copy_bw_GBps": bw / 1e9, "weight_GB": weight_bytes / 1e9,
                           "read_per_step_GB_at_b1": (read_bytes + ctx * per_tok) / 1e9}


def server(p, cfg: ModelConfig, dev, workdir: str) -> dict:
    """Save the model shape with random weights (vocab 49152: SmolLM2's tokenizer), start kvfleet-server,
    stream one completion."""
    import httpx
    from transformers import AutoTokenizer, LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from kvfleet_server.config import bundled_model_path

    gguf = bundled_model_path()
    d = os.path.join(workdir, "model")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok.save_pretrained(d)
    hf = LlamaConfig(vocab_size=49152, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
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
    t0 = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while time.monotonic() - t0 < 300:
            if proc.poll() is not None:
                return {"ok": False, "error": proc.stdout.read()[-2000:]}
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        ready = time.monotonic() - t0
        chunks = []
        body = {"model": d, "prompt": "Hello", "max_tokens": 8, "stream": True, "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        return {"ok": bool(chunks), "chunks": len(chunks), "save_s": saved, "ready_s": ready,
                "text": "".join(c["choices"][0]["text"] for c in chunks)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def table(res: dict) -> str:
    lines = ["section            | result"]
    for r in res["kernels"]:
        lines.append(f"kernel {r['dtype']:<11} | GQA {r['gqa']}: rel err {r['rel_err']:.1e}, cache equal {r['cache_equal']}")
    for r in res["decode"]:
        g = f"{r['graphs_s'] * 1e3:.2f} ms" if r.get("graphs_s") else "n/a"
        sp = f"{r['graph_speedup']:.2f}x" if r.get("graph_speedup") else "n/a"
        lines.append(f"decode batch {r['batch']:<5} | eager {r['eager_s'] * 1e3:.2f} ms, graphs {g} ({sp}), "
                     f"{r['tok_s']:.0f} tok/s, {r['bw_frac'] * 100:.0f}% of copy bandwidth")
    pf = res["prefill"]
    lines.append(f"prefill {pf['tokens']:<10} | {pf['tok_s']:.0f} tok/s, {pf['tflops']:.1f} TFLOP/s = "
                 f"{pf['mm_frac'] * 100:.0f}% of matmul {pf['matmul_tflops']:.1f}")
    lines.append(f"server             | {'ok' if res['server'].get('ok') else 'FAILED'} "
                 f"({res['server'].get('chunks', 0)} chunks)")
    t = res["targets"]
    lines.append(f"targets (H200)     | decode b1 >= 70% bw: {t['decode_b1_bw']}; graphs >= 1.3x at b1: "
                 f"{t['graphs_b1']}; prefill >= 50% matmul: {t['prefill_mm']}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results_dir")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU, Triton interpreter (CI)")
    ap.add_argument("--skip-server", action="store_true")
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
           "dry_run": args.dry_run}
    res["kernels"] = kernels(p, dev)
    res["decode"], res["prefill"], res["reference"] = decode_and_prefill(p, dev, dtype, cfg)
    if args.skip_server:
        res["server"] = {"ok": None}
    else:
        with tempfile.TemporaryDirectory() as wd:
            res["server"] = server(p, cfg, dev, wd)
    b1 = next(r for r in res["decode"] if r["batch"] == 1)
    res["targets"] = {"decode_b1_bw": b1["bw_frac"] >= 0.7, "graphs_b1": bool(b1.get("graph_speedup"))
                      and b1["graph_speedup"] >= 1.3, "prefill_mm": res["prefill"]["mm_frac"] >= 0.5}
    if args.dry_run:
        res["targets"] = {k: "n/a (dry run)" for k in res["targets"]}
    res["wall_s"] = time.monotonic() - t0
    with open(os.path.join(args.results_dir, "results.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    print(table(res))
    ok = all(r["rel_err"] < (1e-4 if r["dtype"] == "float32" else 2e-2) and r["cache_equal"] for r in res["kernels"])
    return 0 if ok and res["server"].get("ok") is not False else 1


if __name__ == "__main__":
    sys.exit(main())
