"""The ``kvfleet-server`` command line: vLLM's flag names and meanings, and the start-up checks on them.

Torch-free, and reading nothing but the CPU affinity and cgroup quota (the default ``--num-threads``):
``kvfleet-operator render`` asks ``parse_flags`` about the command line it
renders, so a spec the server would refuse is refused at render time with the same message."""

from __future__ import annotations

import argparse
import json
import os

from .threads import default_num_threads


def _json_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _compilation_arg(text: str) -> dict:
    """vLLM's --compilation-config: a level (``-O3``) or a JSON object (``{"level": 3}``)."""
    return {"level": int(text)} if text.strip().isdigit() else _json_arg(text)


def _lora_module_arg(text: str) -> dict:
    """vLLM's --lora-modules item: ``name=path`` or JSON ``{"name", "path", "base_model_name"?}``."""
    if text.lstrip().startswith("{"):
        value = _json_arg(text)
        if not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str) \
                or set(value) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(f'must be name=path or {{"name", "path", "base_model_name"}}, got {text}')
        return value
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"must be name=path, got {text!r}")
    return {"name": name, "path": path}


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


class FlagError(ValueError):
    """A command line argparse refuses (unknown flag, bad value); the message names the flag."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises FlagError instead of exiting, so ``kvfleet-operator render`` can ask it too."""

    def error(self, message: str):
        raise FlagError(message)


class _HelpFormatter(argparse.HelpFormatter):
    """Shows "(default: X)" only for real defaults: not for None (the help says what unset means)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" not in text and action.default not in (None, argparse.SUPPRESS) \
                and action.option_strings and not isinstance(action, argparse._StoreTrueAction):
            text += " (default: %(default)s)"
        return text


# What the API key leaves open (api/app.py's OPEN_PATHS; tests/server/test_cli_flags.py keeps them equal).
API_KEY_HELP = ("require 'Authorization: Bearer <key>' on every endpoint except /health, /metrics, /version, "
                "/openapi.json, /docs, /docs/oauth2-redirect and /redoc (vLLM guards only /v1; kvfleet also "
                "guards /tokenize and /detokenize) (default: env VLLM_API_KEY or KVFLEET_API_KEY; the key is never "
                "printed here)")


def _config():
    from . import config

    return config


def _engine_default(name: str):
    from dataclasses import fields

    from .config import EngineConfig

    return next(f.default for f in fields(EngineConfig) if f.name == name)


def build_parser() -> argparse.ArgumentParser:
    """The command line, vLLM's flag names and meanings. Flags for features kvfleet lacks are parsed and
    then refused by name (``unsupported.ENGINE_REFUSALS``), never accepted and ignored."""
    p = _Parser(
        prog="kvfleet-server",
        description="OpenAI-compatible LLM server (vLLM's flag names). Serves /v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize, /version.",
        formatter_class=_HelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as in `vllm serve MODEL` (same as --model; give one or the other)")
    m.add_argument("--model", default=None,
                   help="HF-style model directory (safetensors + tokenizer), a .gguf file, or 'smollm2' for the "
                        "bundled SmolLM2-135M-Instruct GGUF (default: smollm2)")
    m.add_argument("--tokenizer", default=None, help="tokenizer directory or file (default: the model's own)")
    m.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) accepted in the request's 'model' field, all listed by /v1/models; the first "
                        "is reported in responses and labels the metrics (default: the --model string as given)")
    m.add_argument("--chat-template", default=None,
                   help="chat template (Jinja) for /v1/chat/completions: a file path or the template itself "
                        "(default: the tokenizer's own)")
    m.add_argument("--trust-remote-code", action="store_true",
                   help="vLLM: allow the model repository's own Python code. kvfleet never runs repository code "
                        "(it implements the Llama family itself), so the flag changes nothing; other "
                        "architectures are refused with or without it")
    m.add_argument("--revision", default=None, help="Hub revision to download (refused: not supported yet)")
    m.add_argument("--download-dir", default=None, help="Hub download directory (refused: not supported yet)")
    m.add_argument("--generation-config", default=_engine_default("generation_config"),
                   help="defaults of the sampling fields a request leaves unset: 'auto' = the model's "
                        "generation_config.json (a GGUF's general.sampling.* metadata), 'vllm' = vLLM's own "
                        "(the file is not read), or a directory holding generation_config.json")
    m.add_argument("--dtype", default="auto",
                   help="weights/activation dtype: auto (float32 on CPU, bfloat16 on CUDA and for int8/int4/gguf "
                        "weights on CPU), float32, float16 (GPU only), bfloat16")
    m.add_argument("--quantization", "-q", default=None,
                   help="weight quantization: fp8, int8, int4 (a float checkpoint quantized at load) or gguf "
                        "(a .gguf file kept packed; the default for .gguf files unless --dtype float32); see "
                        "docs/quantization.md")
    m.add_argument("--seed", type=int, default=0, help="random seed of the engine")
    m.add_argument("--max-logprobs", type=int, default=_engine_default("max_logprobs"),
                   help="most log-probabilities per token a request may ask for (logprobs, top_logprobs, "
                        "prompt_logprobs); -1: the vocabulary size")
    e = p.add_argument_group("engine")
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    e.add_argument("--block-size", type=_positive_int, default=_engine_default("block_size"),
                   help="tokens per KV-cache block")
    e.add_argument("--gpu-memory-utilization", type=float, default=_engine_default("gpu_memory_utilization"),
                   help="fraction of accelerator memory the engine may use (weights + KV cache)")
    e.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV-cache size in bytes per tensor-parallel rank (overrides --gpu-memory-utilization for "
                        "the KV pool; default: 1 GiB on CPU, derived from --gpu-memory-utilization on CUDA)")
    e.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length: prompt + generated tokens (default: the model's, capped at 8192 and "
                        "at what the KV pool holds)")
    e.add_argument("--max-num-seqs", type=_positive_int, default=_engine_default("max_num_seqs"),
                   help="most sequences in one batch (running requests)")
    e.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="most tokens computed in one engine step (prefill chunks + decodes) (default: 2048, "
                        "raised to --max-num-seqs when that is larger)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_engine_default("enable_prefix_caching"),
                   help="reuse the KV blocks of shared prompt prefixes (automatic prefix caching)")
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prefills into chunks of --max-num-batched-tokens (always on in kvfleet; "
                        "--no-enable-chunked-prefill is refused)")
    e.add_argument("--enforce-eager", action="store_true",
                   help="run the model eagerly (vLLM's flag): no torch.compile of the decoder layers and no CUDA "
                        "graphs (decode steps on CUDA otherwise replay graphs captured at batch sizes 1, 2, 4, 8, 16, "
                        "24, ... up to --max-num-seqs, capped at 512); starts faster, steps slower")
    e.add_argument("--cpu-weight-prepack", action=argparse.BooleanOptionalAction,
                   default=_engine_default("cpu_weight_prepack"),
                   help="kvfleet's flag: on the CPU without torch.compile, hold float32 linear weights packed once "
                        "in 16-column panels for kvfleet's AVX2 kernel (oneDNN's layout without the C++ kernels): "
                        "faster at decode's few rows than MKL, which re-packs the weight every call; "
                        "--no-cpu-weight-prepack keeps F.linear")
    e.add_argument("--cpu-fused-ops", action=argparse.BooleanOptionalAction, default=_engine_default("cpu_fused_ops"),
                   help="kvfleet's flag: on the CPU without torch.compile, run each layer's RMSNorm, residual add + "
                        "RMSNorm, RoPE and SiLU-and-mul in fused C++ kernels (one pass over memory each); "
                        "--no-cpu-fused-ops keeps torch's operator-by-operator ops")
    e.add_argument("--attention-backend", default=_engine_default("attention_backend"),
                   choices=list(_config().ATTENTION_BACKEND_CHOICES),
                   help="kvfleet's flag (vLLM uses the VLLM_ATTENTION_BACKEND environment variable): auto = the "
                        "Triton paged-attention kernels on CUDA, kvfleet's C++ paged-attention kernel on the CPU "
                        "(cpu; built on first use, cached), the PyTorch reference (torch) when neither can run; "
                        "triton on a CPU only under TRITON_INTERPRET=1 (slow, for tests)")
    e.add_argument("--kv-cache-dtype", default="auto",
                   help="KV-cache dtype: auto (= the model dtype), fp8 (= fp8_e4m3) or fp8_e5m2 (per-layer K/V "
                        "scales)")
    e.add_argument("--num-threads", type=_positive_int, default=None,
                   help="intra-op threads of each engine rank on CPU (default: usable CPUs // "
                        "--tensor-parallel-size, at least 1, respecting the affinity set and a cgroup CPU limit "
                        "rounded down; OMP_NUM_THREADS also sets it)")
    e.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="tensor-parallel ranks: one model over N processes / GPUs (rank 0 is this process; "
                        "the model's head counts must split, see docs/tensor_parallel.md)")
    e.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int, default=1,
                   help="number of pipeline stages (only 1)")
    e.add_argument("--compilation-config", "-O", type=_compilation_arg, default=None,
                   help='torch.compile of the decoder layers (vLLM\'s flag): -O3 / {"level": 3} piecewise around '
                        'attention, -O0 / {"level": 0} eager; default 3 on CUDA, 0 on the CPU (measured: no gain there)')
    e.add_argument("--speculative-config", type=_json_arg, default=None,
                   help='speculative decoding, JSON (e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
                        'methods ngram, draft_model, layer_skip: docs/spec_decode.md)')
    lo = p.add_argument_group("LoRA adapters (docs/lora.md)")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters: requests pick one by the model field")
    lo.add_argument("--lora-modules", nargs="+", type=_lora_module_arg, default=None, metavar="NAME=PATH",
                    help='adapters loaded at start-up: name=path or JSON {"name", "path", "base_model_name"}')
    lo.add_argument("--max-loras", type=_positive_int, default=1, help="adapters that can run in one batch")
    lo.add_argument("--max-lora-rank", type=_positive_int, default=16, help="largest adapter rank r")
    lo.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                    help="adapters kept in host memory (default: --max-loras)")
    e.add_argument("--structured-outputs-config", type=_json_arg, default=None,
                   help='structured output, JSON: vLLM\'s {"backend": "auto"|"xgrammar", "disable_any_whitespace": '
                        'bool} and kvfleet\'s {"max_whitespace": int (JSON whitespace between tokens, default 2), '
                        '"compile_timeout": seconds (default 5)}')
    e.add_argument("--enable-jump-forward", action="store_true",
                   help="append a grammar's forced continuation without sampling it (structured output)")
    e.add_argument("--kv-events-config", type=_json_arg, default=None,
                   help='publish the prefix cache\'s KV events over ZeroMQ in vLLM\'s wire format, vLLM\'s JSON keys: '
                        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": "kv@POD@MODEL", "buffer_steps": 10000, '
                        '"hwm": 100000, "max_queue_size": 100000} (docs/routing.md)')
    t = p.add_argument_group("tools")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the model decides, --tool-call-parser extracts the calls')
    t.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="tool-call format of the model's output for tool_choice auto")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="0.0.0.0", help="address to bind")
    s.add_argument("--port", type=int, default=8000, help="port to bind")
    s.add_argument("--root-path", default=None,
                   help="path prefix the server sits under behind a path-based proxy (ASGI root_path)")
    s.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or os.environ.get("KVFLEET_API_KEY"),
                   help=API_KEY_HELP)
    s.add_argument("--allowed-origins", type=json.loads, default=["*"], help="CORS allowed origins, JSON list")
    s.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS allowed methods, JSON list")
    s.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS allowed headers, JSON list")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    s.add_argument("--max-queue-len", type=_positive_int, default=None,
                   help="answer 429 (Retry-After) when this many requests are already waiting (default: unbounded)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM: do not log each request. kvfleet logs no request contents (only uvicorn's "
                        "access log lines, see --disable-uvicorn-access-log)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="vLLM: no periodic stats log line (the kvfleet.stats line every 10 s while busy); "
                        "/metrics is unchanged, as in vLLM")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="kvfleet's log level")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no per-request access log lines")
    return p


ENGINE_FIELDS = ("model", "tokenizer", "dtype", "device", "block_size", "gpu_memory_utilization",
                 "kv_cache_memory_bytes", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "enable_prefix_caching", "quantization", "kv_cache_dtype", "tensor_parallel_size",
                 "speculative_config", "seed", "num_threads", "max_logprobs",
                 "structured_outputs_config", "enable_jump_forward", "attention_backend", "enforce_eager",
                 "compilation_config", "cpu_weight_prepack", "cpu_fused_ops", "generation_config",
                 "enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras")


def parse_flags(argv: list[str]) -> argparse.Namespace:
    """Parse a kvfleet-server command line and apply the server's start-up checks, without I/O.

    Raises FlagError (argparse's message: unknown flag, bad value), UnsupportedFeatureError (the first
    hit of ``unsupported.ENGINE_REFUSALS``) or ValueError (a value EngineConfig refuses, or a
    setting the server refuses). Used by ``main`` and by ``kvfleet-operator render``."""
    from .errors import UnsupportedFeatureError
    from .unsupported import engine_refusals

    args = build_parser().parse_args(argv)
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise FlagError(f"give the model once: positional {args.model_tag!r} and --model {args.model!r} differ")
    args.model = args.model if args.model is not None else (args.model_tag or "smollm2")
    if args.shutdown_timeout < 0:
        raise FlagError("--shutdown-timeout must be non-negative")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise FlagError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.max_logprobs < -1:
        raise FlagError(f"--max-logprobs must be -1 or non-negative, got {args.max_logprobs}")
    if args.kv_events_config is not None:
        from .config import KVEventsConfig

        try:
            args.kv_events_config = KVEventsConfig.from_dict(args.kv_events_config)
        except ValueError as exc:
            raise FlagError(f"--kv-events-config: {exc}") from None
    for flag in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, flag)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise FlagError(f"--{flag.replace('_', '-')} must be a JSON list of strings, got {value!r}")
    refused = engine_refusals(vars(args))
    if refused:  # param: the flag, so that the operator can name the spec field that rendered it
        raise UnsupportedFeatureError(refused[0].message(vars(args)), param=refused[0].flag)
    engine_config(args)  # EngineConfig's own checks (ValueError naming the field)
    return args


def engine_config(args: argparse.Namespace):
    """EngineConfig from the parsed flags (raises UnsupportedFeatureError / ValueError on bad values)."""
    from .config import EngineConfig

    kwargs = {name: getattr(args, name) for name in ENGINE_FIELDS if getattr(args, name, None) is not None}
    if args.served_model_name:
        kwargs["served_model_name"] = args.served_model_name[0]
    if "num_threads" not in kwargs and not os.environ.get("OMP_NUM_THREADS"):
        kwargs["num_threads"] = default_num_threads(args.tensor_parallel_size or 1)
    return EngineConfig(**kwargs)
