"""Serving benchmark of kvfleet-server on the bundled SmolLM2-135M-Instruct (or --model).

1. launches ``kvfleet-server`` and measures launch → first 200 on /health (cold start);
2. runs ``kvfleet-bench`` for each dataset (random, shared-prefix) at each concurrency (default 1 and 8);
3. prints one table and writes everything to a JSON file.

    python benchmarks/serving.py --num-prompts 32 --concurrency 1 8   # JSON: benchmarks/results/serving.json
Any other OpenAI-compatible server can be measured the same way with ``kvfleet-bench --base-url``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvfleet_server.bench import make_dataset, run_benchmark


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=64, help="random: prompt words; shared-prefix: question words")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: system prompt words")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--server-arg", action="append", default=[], help="extra kvfleet-server flag (repeatable)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "serving.json"),
                   help="JSON result path (default benchmarks/results/serving.json)")
    args = p.parse_args(argv)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet_server.cli", "--model", args.model, "--host", "127.0.0.1",
                             "--port", str(port), "--disable-uvicorn-access-log", *args.server_arg])
    try:
        while True:
            if proc.poll() is not None:
                print(f"server exited with {proc.returncode}", file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        cold_start = time.monotonic() - t0
        print(f"cold start: launch -> first 200 on /health: {cold_start:.2f} s", flush=True)
        runs = []
        for dataset in ("random", "shared-prefix"):
            for conc in args.concurrency:
                reqs = make_dataset(dataset, args.num_prompts, args.input_len, args.output_len,
                                    prefix_len=args.prefix_len, seed=0)
                s = asyncio.run(run_benchmark(url, None, reqs, max_concurrency=conc, progress=False,
                                              endpoint="chat" if dataset == "shared-prefix" else "completions"))
                s.pop("_results")
                s.update(dataset=dataset, concurrency=conc)
                runs.append(s)
        print(f"{'dataset':<14}{'conc':>5}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
              f"{'ITL p50':>9}{'E2E p50':>9}{'E2E p99':>9}  (ms)")
        for s in runs:
            print(f"{s['dataset']:<14}{s['concurrency']:>5}{s['request_throughput']:>8.2f}{s['output_throughput']:>11.1f}"
                  f"{s['ttft_ms']['p50']:>10.0f}{s['ttft_ms']['p99']:>10.0f}{s['itl_ms']['p50']:>9.1f}"
                  f"{s['e2e_ms']['p50']:>9.0f}{s['e2e_ms']['p99']:>9.0f}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"cold_start_s": cold_start, "model": args.model, "runs": runs}, f, indent=1)
        return 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
