"""Pieces the benchmark scripts share: a median timer, the --threads/--repeats command line of the
per-kernel benchmarks, the CPU line every figure is printed and stored with, and the JSON result file
under benchmarks/results/."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_line() -> str:
    """The CPU model, its vector flags and the kernel build in use (attention/cpu_ext.py), e.g.
    ``Intel(R) Xeon(R) Processor [avx2 avx512f ... amx_bf16 ...] (2 CPUs, kernels built for x86-64-v4)``:
    figures differ by CPU, so each is reported with it."""
    from kvfleet_server.attention import cpu_ext

    return cpu_ext.cpu_description()


def print_cpu() -> str:
    line = cpu_line()
    print(f"CPU: {line}", flush=True)
    return line


def kernel_bench_args(doc: str, repeats: int = 30) -> argparse.Namespace:
    """Parse ``--threads`` (default: torch's) and ``--repeats`` and apply the thread count."""
    import torch

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=repeats)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print_cpu()
    return args


def write_json(res: dict, name: str, out: str | None = None) -> str:
    """Write ``res`` to ``out`` (default benchmarks/results/NAME.json), with the CPU line under "cpu";
    returns the path."""
    res = {"cpu": cpu_line(), **res}
    out = out or os.path.join(RESULTS, f"{name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    return out
