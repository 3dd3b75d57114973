"""Serving runtimes (``spec.engine.runtime``) and the one table of which server flags each accepts.

- ``kvfleet`` (the default): ``kvfleet-server`` in the serving image (the chart's ``servingImage``); its own
  flag check (``kvfleet_server.flags.parse_flags``) judges the rendered command line at render time.
- ``vllm``: upstream vLLM's OpenAI server, ``vllm serve MODEL [flags]`` in ``vllm/vllm-openai:<tag>`` (the
  chart's ``vllmImage``, the operator's ``KVFLEET_VLLM_IMAGE``). kvfleet-server's flags, endpoints and metric
  names are vLLM's, so the same spec renders the same flags, port, probes (``/health``) and metrics
  (``/metrics``, ``vllm:*``: the autoscaler reads both alike).

``FLAGS`` lists every flag the operator renders from a spec field, and kvfleet-server's own flags that vLLM
lacks (``extraArgs`` could pass them), with the runtimes whose server accepts each; a row with ``value`` covers
only the values of a flag one runtime lacks (vLLM has ``--quantization``, but no ``int8``). A setting the
chosen runtime lacks is refused at render, naming the spec field (``refusals``); a flag the operator derives
from the spec rather than the user setting it (``--device``) is omitted where the runtime derives it itself.
Other ``extraArgs`` of the vllm runtime reach vLLM unchecked (its CLI is its own; it exits at start-up on a
bad one, which the InferenceService's status then shows).

The vllm column follows vLLM's CLI as of vLLM 0.23 (``vllm/config/*.py``, the ``EngineArgs`` and frontend
arguments; the PRs named per row); tests/operator/test_runtime.py parses the rendered arguments with vLLM's
own parser where vllm is installed. Pure: standard library only.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KVFLEET = "kvfleet"
VLLM = "vllm"
#: vllm/vllm-openai tag the operator runs without KVFLEET_VLLM_IMAGE: at least v0.18 (--shutdown-timeout,
#: vllm-project/vllm#34730)
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.23.0"
EXTRA_ARGS = "spec.engine.extraArgs"


@dataclass(frozen=True)
class Runtime:
    """How a runtime's server container is started.

    Attributes:
        name: the ``spec.engine.runtime`` value.
        command: the container command; the arguments follow (``command_args``).

    Model downloads run kvfleet's ``kvfleet-download`` in kvfleet's serving image whatever the runtime
    (``render.downloader``).
    """

    name: str
    command: tuple[str, ...]


RUNTIMES = {
    KVFLEET: Runtime(KVFLEET, ("kvfleet-server",)),
    VLLM: Runtime(VLLM, ("vllm", "serve")),
}
BOTH = frozenset(RUNTIMES)
KVFLEET_ONLY = frozenset({KVFLEET})


@dataclass(frozen=True)
class ServerFlag:
    """One server flag (or some of its values) and the runtimes whose server accepts it.

    Attributes:
        flag: the command-line flag, e.g. ``"--quantization"``.
        field: the spec field it is rendered from (``EXTRA_ARGS`` for a flag only extraArgs can pass).
        runtimes: runtimes whose server accepts it.
        why: what the other runtimes lack, in words (the refusal's tail).
        value: when set, the row covers only the flag's values for which it is true.
        derived: the operator derives the flag from the spec; a runtime without it derives the setting
            itself, so the flag is omitted there instead of refused.
    """

    flag: str
    field: str
    runtimes: frozenset[str]
    why: str = ""
    value: Callable[[str], bool] | None = None
    derived: bool = False


def _speculative(text: str) -> dict[str, Any]:
    try:
        cfg = json.loads(text)
    except ValueError:
        return {}
    return cfg if isinstance(cfg, dict) else {}


FLAGS: tuple[ServerFlag, ...] = (
    # rendered from spec fields (api.RENDERED_FLAGS)
    ServerFlag("--model", "spec.model.uri", BOTH),  # vllm serve takes it as its positional MODEL
    ServerFlag("--model", "spec.model.uri", KVFLEET_ONLY,
               "bundled://smollm2 is the GGUF inside kvfleet's CPU serving image", value=lambda v: v == "smollm2"),
    ServerFlag("--served-model-name", "spec.model.name", BOTH),
    ServerFlag("--tokenizer", "spec.model.tokenizer", BOTH),
    ServerFlag("--host", "(always 0.0.0.0)", BOTH),
    ServerFlag("--port", "spec.service.port", BOTH),
    ServerFlag("--device", "spec.resources.gpus", KVFLEET_ONLY,
               "vLLM runs on the platform it was built for (--device was removed in vLLM 0.10, "
               "vllm-project/vllm#21349)", derived=True),
    ServerFlag("--device", "spec.resources.gpus", KVFLEET_ONLY,
               "serving on CPUs (resources.gpus 0): the vllm/vllm-openai image serves on NVIDIA GPUs; "
               "use runtime kvfleet", value=lambda v: v == "cpu"),
    ServerFlag("--dtype", "spec.engine.dtype", BOTH),
    ServerFlag("--block-size", "spec.engine.blockSize", BOTH),
    ServerFlag("--gpu-memory-utilization", "spec.engine.gpuMemoryUtilization", BOTH),
    ServerFlag("--max-model-len", "spec.engine.maxModelLen", BOTH),
    ServerFlag("--max-num-seqs", "spec.engine.maxNumSeqs", BOTH),
    ServerFlag("--max-num-batched-tokens", "spec.engine.maxNumBatchedTokens", BOTH),
    ServerFlag("--enable-prefix-caching", "spec.engine.enablePrefixCaching", BOTH),
    ServerFlag("--no-enable-prefix-caching", "spec.engine.enablePrefixCaching", BOTH),
    ServerFlag("--quantization", "spec.engine.quantization", BOTH),
    ServerFlag("--quantization", "spec.engine.quantization", KVFLEET_ONLY,
               "vLLM has no int8/int4 method that quantizes a float checkpoint at load (its --quantization "
               "names checkpoint formats such as awq, gptq, compressed-tensors; fp8 and gguf are shared)",
               value=lambda v: v in ("int8", "int4")),
    ServerFlag("--kv-cache-dtype", "spec.engine.kvCacheDtype", BOTH),
    ServerFlag("--tensor-parallel-size", "spec.engine.tensorParallelSize", BOTH),
    ServerFlag("--speculative-config", "spec.engine.speculative", BOTH),
    ServerFlag("--speculative-config", "spec.engine.speculative.method", KVFLEET_ONLY,
               "layer_skip is kvfleet's method (the target's first layers draft); vLLM's include ngram and "
               "draft_model", value=lambda v: _speculative(v).get("method") == "layer_skip"),
    ServerFlag("--speculative-config", "spec.engine.speculative.disableByBatchSize", KVFLEET_ONLY,
               "vLLM's disable_by_batch_size must be at least 2",
               value=lambda v: isinstance(_speculative(v).get("disable_by_batch_size"), int)
               and _speculative(v)["disable_by_batch_size"] < 2),
    ServerFlag("--enable-lora", "spec.adapters", BOTH),
    ServerFlag("--lora-modules", "spec.adapters", BOTH),
    ServerFlag("--max-loras", "spec.engine.maxLoras", BOTH),
    ServerFlag("--max-lora-rank", "spec.engine.maxLoraRank", BOTH),
    ServerFlag("--max-cpu-loras", "spec.engine.maxCpuLoras", BOTH),
    ServerFlag("--shutdown-timeout", "spec.engine.shutdownTimeoutSeconds", BOTH),  # vLLM >= 0.18
    ServerFlag("--num-threads", "spec.resources.cpu", KVFLEET_ONLY,
               "kvfleet's CPU engine threads (vLLM's CPU backend reads VLLM_CPU_OMP_THREADS_BIND)", derived=True),
    # kvfleet-server's own flags (extraArgs)
    ServerFlag("--enable-jump-forward", EXTRA_ARGS, KVFLEET_ONLY,
               "kvfleet's grammar jump-forward (vLLM has none)"),
    ServerFlag("--cpu-weight-prepack", EXTRA_ARGS, KVFLEET_ONLY, "kvfleet's CPU linear kernel"),
    ServerFlag("--no-cpu-weight-prepack", EXTRA_ARGS, KVFLEET_ONLY, "kvfleet's CPU linear kernel"),
    ServerFlag("--cpu-fused-ops", EXTRA_ARGS, KVFLEET_ONLY, "kvfleet's fused CPU kernels"),
    ServerFlag("--no-cpu-fused-ops", EXTRA_ARGS, KVFLEET_ONLY, "kvfleet's fused CPU kernels"),
    ServerFlag("--max-queue-len", EXTRA_ARGS, KVFLEET_ONLY, "kvfleet's cap on waiting requests (429)"),
    ServerFlag("--log-level", EXTRA_ARGS, KVFLEET_ONLY,
               "kvfleet's log level (vLLM reads the VLLM_LOGGING_LEVEL environment variable)"),
)
#: flag -> spec field, for every flag the operator renders from the spec (extraArgs may not repeat them)
RENDERED_FLAGS = {f.flag: f.field for f in FLAGS if f.value is None and f.field != EXTRA_ARGS}


def _pairs(args: list[str]) -> list[tuple[int, int, str, str | None]]:
    """(start, end, flag, value) of each ``--flag [value]`` / ``--flag=value`` in ``args``."""
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            i += 1
            continue
        if "=" in arg:
            flag, value = arg.split("=", 1)
            out.append((i, i + 1, flag, value))
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append((i, i + 2, arg, args[i + 1]))
            i += 2
        else:
            out.append((i, i + 1, arg, None))
            i += 1
    return out


def _rows(flag: str, value: str | None) -> tuple[ServerFlag | None, list[ServerFlag]]:
    """The flag's own row and the value rows ``value`` matches."""
    rows = [f for f in FLAGS if f.flag == flag]
    own = next((f for f in rows if f.value is None), None)
    return own, [f for f in rows if f.value is not None and value is not None and f.value(value)]


def refusals(runtime: str, args: list[str]) -> list[str]:
    """Messages ("FIELD: ...") for each flag or value in ``args`` (a rendered command line) that ``runtime``'s
    server lacks; empty when it accepts them all (flags outside ``FLAGS`` are the runtime's own business)."""
    out = []
    for _, _, flag, value in _pairs(args):
        own, by_value = _rows(flag, value)
        for row in by_value + ([own] if own is not None and not own.derived else []):
            if runtime not in row.runtimes:
                shown = f"{flag} {value}" if row.value is not None else flag
                out.append(f"{row.field}: runtime {runtime} does not support {shown}: {row.why}")
    return out


def command_args(runtime: str, args: list[str]) -> list[str]:
    """The container arguments of ``runtime`` for kvfleet-style ``args`` (``--model PATH`` first).

    kvfleet: ``args`` unchanged. vllm: ``MODEL`` positional (``vllm serve MODEL``; vLLM deprecates
    ``--model`` there), then the other flags, without the derived flags vLLM lacks (``--device``)."""
    if runtime == KVFLEET:
        return list(args)
    out: list[str] = []
    model = None
    last = 0
    for start, end, flag, value in _pairs(args):
        out += args[last:start]
        last = end
        own, _ = _rows(flag, value)
        if flag == "--model":
            model = value
        elif not (own is not None and own.derived and runtime not in own.runtimes):
            out += args[start:end]
    out += args[last:]
    return ([model] if model is not None else []) + out
