"""Pieces the benchmark scripts share: a median timer, the --threads/--repeats command line of the
per-kernel benchmarks, and the JSON result file under benchmarks/results/."""

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


def kernel_bench_args(doc: str, repeats: int = 30) -> argparse.Namespace:
    """Parse ``--threads`` (default: torch's) and ``--repeats`` and apply the thread count."""
    import torch

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=repeats)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def write_json(res: dict, name: str, out: str | None = None) -> str:
    """Write ``res`` to ``out`` (default benchmarks/results/NAME.json); returns the path."""
    out = out or os.path.join(RESULTS, f"{name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    return out
