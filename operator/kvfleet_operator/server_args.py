"""The serving container's command line: every engine field as its vLLM-style flag (``server_args``), checked
against kvfleet-server's own flag parser (``check_server_args``) and put in the runtime's form
(``container_args``). Pure: no I/O."""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Mapping

from kvfleet_server.errors import UnsupportedFeatureError
from kvfleet_server.flags import FlagError, parse_flags
from kvfleet_server.threads import threads_for_cpus

from . import api, runtime
from .apply import quantity
from .unrealisable import Unrealisable


def server_args(spec: api.InferenceServiceSpec, paths: Mapping[str, str]) -> list[str]:
    """Server flags for every engine field (vLLM's flag names, kvfleet-server's form: ``--model`` first),
    then extraArgs; ``container_args`` turns them into the runtime's arguments. ``paths``: the path the
    server loads for each model uri (``cache.PodStorage.paths``)."""
    e = spec.engine
    gpu = spec.gpus > 0
    args = ["--model", paths[spec.model.uri], "--served-model-name", spec.served_model_name,
            "--host", "0.0.0.0", "--port", str(spec.service.port),
            "--device", "cuda" if gpu else "cpu", "--dtype", e.dtype]
    if spec.model.tokenizer:
        args += ["--tokenizer", paths[spec.model.tokenizer]]
    args += ["--block-size", str(e.block_size)]
    if gpu:
        args += ["--gpu-memory-utilization", f"{e.gpu_memory_utilization:g}"]
    for flag, value in (("--max-model-len", e.max_model_len), ("--max-num-seqs", e.max_num_seqs),
                        ("--max-num-batched-tokens", e.max_num_batched_tokens)):
        if value is not None:
            args += [flag, str(value)]
    args.append("--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching")
    if e.quantization != "none":
        args += ["--quantization", e.quantization]
    args += ["--kv-cache-dtype", e.kv_cache_dtype, "--tensor-parallel-size", str(e.tensor_parallel_size)]
    sp = e.speculative
    if sp is not None and sp.method is not None:
        cfg: dict[str, Any] = {"method": "draft_model" if sp.method == "draft" else sp.method}
        if sp.num_speculative_tokens is not None:
            cfg["num_speculative_tokens"] = sp.num_speculative_tokens
        if sp.draft_model:
            cfg["model"] = paths[sp.draft_model]
        if sp.prompt_lookup_min is not None:
            cfg["prompt_lookup_min"] = sp.prompt_lookup_min
        if sp.prompt_lookup_max is not None:
            cfg["prompt_lookup_max"] = sp.prompt_lookup_max
        if sp.num_draft_layers is not None:
            cfg["num_draft_layers"] = sp.num_draft_layers
        if sp.disable_by_batch_size is not None:
            cfg["disable_by_batch_size"] = sp.disable_by_batch_size
        args += ["--speculative-config", json.dumps(cfg, sort_keys=True, separators=(",", ":"))]
    if spec.adapters:
        args += ["--enable-lora", "--max-loras", str(spec.max_loras), "--max-lora-rank", str(e.max_lora_rank)]
        if e.max_cpu_loras is not None:
            args += ["--max-cpu-loras", str(e.max_cpu_loras)]
        args += ["--lora-modules", *(f"{a.name}={paths[a.uri]}" for a in spec.adapters)]
    args += ["--shutdown-timeout", str(e.shutdown_timeout_seconds)]
    threads = cpu_threads(spec)
    if threads is not None:
        args += ["--num-threads", str(threads)]
    return args + list(e.extra_args)


def cpu_threads(spec: api.InferenceServiceSpec) -> int | None:
    """--num-threads of a CPU pod: the server's own rule (``threads_for_cpus``) over the CPUs the pod
    requests, rounded down (2500m → 2, 500m → 1). None for GPU pods or when no CPU is requested (the
    server then reads its cgroup limit and affinity)."""
    if spec.gpus > 0 or spec.resources.cpu is None:
        return None
    cpus = quantity(spec.resources.cpu)  # validated by the spec: never None here
    return threads_for_cpus(max(1, math.floor(cpus)))


def check_server_args(args: list[str]) -> None:
    """Ask kvfleet-server's own flag check (``kvfleet_server.flags.parse_flags`` and the one refusal list,
    ``kvfleet_server.unsupported``) whether it would start with ``args``; Unrealisable naming the spec
    field when it would exit at start-up instead. The verdict is a pure function of ``args`` and is kept
    for the last 256 argument lists: building the server's parser costs about 2 ms, and every reconcile
    pass renders the same arguments again."""
    refusal = _refusal(tuple(args))
    if refusal is not None:
        raise Unrealisable(*refusal)


@functools.lru_cache(maxsize=256)
def _refusal(args: tuple[str, ...]) -> tuple[str, str] | None:
    """(reason, message) of the Unrealisable ``args`` make, or None when kvfleet-server accepts them."""
    try:
        parse_flags(list(args))
    except UnsupportedFeatureError as exc:
        where = api.RENDERED_FLAGS.get(exc.param or "", "spec.engine.extraArgs")
        return "UnsupportedFeature", f"{where}: kvfleet-server would refuse it: {exc}"
    except FlagError as exc:
        return "InvalidExtraArgs", f"spec.engine.extraArgs: kvfleet-server would refuse the command line: {exc}"
    except ValueError as exc:
        return "InvalidSpec", f"kvfleet-server would refuse its flags: {exc}"
    return None


def container_args(spec: api.InferenceServiceSpec, args: list[str]) -> list[str]:
    """The server container's arguments for ``server_args`` output, in the form of ``spec.engine.runtime``.

    Raises Unrealisable(UnsupportedFeature) naming each field whose setting the runtime lacks
    (``runtime.refusals``), and, for kvfleet, whatever ``check_server_args`` refuses."""
    name = spec.engine.runtime
    refused = runtime.refusals(name, args)
    if refused:
        raise Unrealisable("UnsupportedFeature", "; ".join(refused))
    if name == runtime.KVFLEET:
        check_server_args(args)
    return runtime.command_args(name, args)
