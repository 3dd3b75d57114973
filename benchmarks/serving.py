"""Serving benchmark of kvfleet-server on the bundled SmolLM2-135M-Instruct (or --model).

For each server configuration (``--config NAME=FLAGS``, repeatable; default one, ``kvfleet``, with the
``--server-arg`` flags):
1. launches ``kvfleet-server`` and measures launch → first 200 on /health (cold start);
2. runs ``kvfleet-bench`` for each row (dataset, concurrency);
3. prints one table, the ratio of each configuration's output tok/s to the first's per row, and writes
   everything to a JSON file.

    python benchmarks/serving.py --num-prompts 32 --concurrency 1 8   # random + shared-prefix at 1 and 8
    python benchmarks/serving.py --issue16-rows --repeats 3 \\
        --config before="--attention-backend torch" --config after=""
``--issue16-rows`` replaces the rows by issue 16's two: random 128-word prompts × 64 tokens at
concurrency 16, and a 1,024-word shared system prompt + 48-word questions × 32 tokens at concurrency 4.
With ``--repeats N`` each row runs N times per configuration, configurations alternating per repeat
(each server stays up), each row and repeat with its own prompts (the dataset seed numbers them: the same
prompts again would be served from the prefix cache), and the run with the median output tok/s is kept.
With ``--vllm-python`` (``benchmarks/_vllm.py``) a ``vllm`` configuration is added last: ``vllm serve`` of the
same weights as float32 safetensors with ``--vllm-arg`` flags (default ``--dtype float32``).
Any other OpenAI-compatible server can be measured the same way with ``kvfleet-bench --base-url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

import _vllm
from _common import print_cpu
from kvfleet_server.bench import make_dataset, run_benchmark

#: (dataset, concurrency, input words, shared-prefix words, output tokens)
ISSUE16_ROWS = [("random", 16, 128, 0, 64), ("shared-prefix", 4, 48, 1024, 32)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(model: str, flags: list[str], vllm_python: str | None = None):
    """A kvfleet-server process, or with ``vllm_python`` a ``vllm serve`` of the same weights as float32
    safetensors (``benchmarks/_vllm.py``: same threads, no CPU reserved for its front end); yields (url, cold
    start seconds: launch → first 200 on /health)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    common = ["--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log", *flags]
    if vllm_python:
        from kvfleet_server.config import resolve_model
        from kvfleet_server.threads import default_num_threads

        weights = _vllm.hf_checkpoint(resolve_model(model))  # converted before the cold-start clock starts
        t0 = time.monotonic()
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", weights, *common]
        # the threads kvfleet-server takes by default (threads.py)
        proc = subprocess.Popen(cmd, env=_vllm.env(default_num_threads()), stdout=subprocess.DEVNULL)
    else:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "kvfleet_server.cli", "--model", model, *common])
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server {flags} exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        yield url, time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench_row(url: str, row: tuple, num_prompts: int, seed: int = 0) -> dict:
    """One row's run; ``seed`` picks the prompts (and the shared prefix), so that a repeat on a server that
    stays up is not served from the prefix cache its previous run filled."""
    dataset, conc, input_len, prefix_len, output_len = row
    reqs = make_dataset(dataset, num_prompts, input_len, output_len, prefix_len=prefix_len, seed=seed)
    s = asyncio.run(run_benchmark(url, None, reqs, max_concurrency=conc, progress=False,
                                  endpoint="chat" if dataset == "shared-prefix" else "completions"))
    s.pop("_results")
    s.update(dataset=dataset, concurrency=conc, input_len=input_len, prefix_len=prefix_len, output_len=output_len)
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=64, help="random: prompt words; shared-prefix: question words")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: system prompt words")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--server-arg", action="append", default=[], help="extra kvfleet-server flag (repeatable)")
    p.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                   help="a server configuration to compare (repeatable; the first is the baseline of the ratios)")
    _vllm.add_argument(p)
    p.add_argument("--vllm-arg", action="append", default=["--dtype", "float32"],
                   help="flags of the vllm configuration (default --dtype float32)")
    p.add_argument("--issue16-rows", action="store_true", help="issue 16's two serving rows (see above)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "serving.json"),
                   help="JSON result path (default benchmarks/results/serving.json)")
    args = p.parse_args(argv)
    cpu = print_cpu()
    configs = [(c.split("=", 1)[0], shlex.split(c.split("=", 1)[1]) if "=" in c else []) for c in args.config]
    configs = configs or [("kvfleet", args.server_arg)]
    if args.vllm_python:
        configs.append(("vllm", args.vllm_arg))
    rows = ISSUE16_ROWS if args.issue16_rows else [
        (d, c, args.input_len, args.prefix_len if d == "shared-prefix" else 0, args.output_len)
        for d in ("random", "shared-prefix") for c in args.concurrency]

    results: dict[str, dict] = {}
    with ExitStack() as stack:
        urls = {}
        for name, flags in configs:  # one server at a time comes up; all stay up for the alternation
            urls[name], cold = stack.enter_context(
                server(args.model, flags, args.vllm_python if name == "vllm" else None))
            results[name] = {"flags": flags, "cold_start_s": cold, "runs": [[] for _ in rows]}
            print(f"{name}: launch -> first 200 on /health: {cold:.2f} s", flush=True)
        for rep in range(args.repeats):
            for i, row in enumerate(rows):
                for name, _ in configs:
                    s = bench_row(urls[name], row, args.num_prompts, seed=rep * len(rows) + i)
                    results[name]["runs"][i].append(s)
                    print(f"  {name} {row[0]} c{row[1]}: {s['output_throughput']:.1f} tok/s", flush=True)
    for r in results.values():
        r["rows"] = []
        for runs in r.pop("runs"):
            med = sorted(runs, key=lambda s: s["output_throughput"])[len(runs) // 2]
            med["runs_output_throughput"] = [round(s["output_throughput"], 1) for s in runs]
            r["rows"].append(med)
    print(f"{'config':<10}{'dataset':<14}{'conc':>5}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}{'E2E p50':>9}  (ms){'':>3}ratio")
    base = results[configs[0][0]]["rows"]
    for name, r in results.items():
        for s, b in zip(r["rows"], base):
            s["ratio_to_" + configs[0][0]] = s["output_throughput"] / b["output_throughput"]
            print(f"{name:<10}{s['dataset']:<14}{s['concurrency']:>5}{s['output_throughput']:>11.1f}"
                  f"{s['ttft_ms']['p50']:>10.0f}{s['ttft_ms']['p99']:>10.0f}{s['itl_ms']['p50']:>9.1f}"
                  f"{s['itl_ms']['p99']:>9.1f}{s['e2e_ms']['p50']:>9.0f}{s['ratio_to_' + configs[0][0]]:>10.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu, "model": args.model, "repeats": args.repeats, "median_of": "output tok/s per row",
                   "configs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
