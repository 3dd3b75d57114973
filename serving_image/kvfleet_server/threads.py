"""The engine's thread policy: how many compute threads a rank runs on the CPUs this process may use.
Pure apart from reading the affinity and the cgroup quota; the operator renders ``--num-threads`` for CPU
pods with the same rule (``threads_for_cpus``)."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """CPUs this process may use: its affinity set, capped by a cgroup v2 CPU quota (a pod's CPU limit),
    rounded down (a 2.5-CPU limit gives 2: a third busy thread would be throttled), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def threads_for_cpus(cpus: int, tensor_parallel_size: int = 1) -> int:
    """Compute engine threads per rank on ``cpus`` CPUs: all of them, shared by the tensor-parallel ranks;
    at least 1. Chosen from ``benchmarks/serving.py`` (docs/server.md): on this project's 2-core machine,
    with the benchmark client on the same cores, 2 engine threads served 1.74x the output tok/s of 1
    (all but one, vLLM's CPU rule) at concurrency 16 and 1.43x with a shared prefix at 4, with lower TTFT
    — the HTTP side needs little CPU. More threads than CPUs (PyTorch's default: every core of the node
    in a CPU-limited pod) spin-wait against each other and slow every step several-fold. The operator
    renders ``--num-threads`` for CPU pods with the same rule."""
    return max(1, cpus // tensor_parallel_size)


def default_num_threads(tensor_parallel_size: int = 1) -> int:
    """``threads_for_cpus`` of the CPUs this process may use (``available_cpus``)."""
    return threads_for_cpus(available_cpus(), tensor_parallel_size)
