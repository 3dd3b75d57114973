"""``kvfleet-server``: the OpenAI-compatible server, with vLLM's flag names and meanings.

Start-up order (each phase is logged with its duration, cold start matters to autoscaling):
parse flags → validate EngineConfig (unbuilt features are refused here: "not supported yet: ...",
exit status 2) → bind the HTTP port (/health answers 503 "loading") → build the engine in a worker
thread (weights, tokenizer, KV-cache allocation) → /health turns 200.
SIGTERM/SIGINT: graceful drain (see ``api/drain.py``), exit status 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time

logger = logging.getLogger("kvfleet.server")


def _process_age_s() -> float | None:
    """Seconds since this process was started by the OS (Linux /proc), to report launch → ready."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def available_cpus() -> int:
    """CPUs this process may use: its affinity set, capped by a cgroup v2 CPU quota (a pod's CPU limit)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def default_num_threads() -> int:
    """Compute threads for the engine on CPU: all usable CPUs but one, which is left to the HTTP side
    (vLLM's CPU backend also keeps a core for its frontend). Oversubscribed OpenMP threads spin-wait
    against each other and slow every step several-fold."""
    return max(1, available_cpus() - 1)


def _json_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfleet-server",
        description="OpenAI-compatible LLM server (vLLM's flag names). Serves /v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize, /version.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default="smollm2",
                   help="HF-style model directory (safetensors + tokenizer), a .gguf file, or 'smollm2' for the "
                        "bundled SmolLM2-135M-Instruct GGUF")
    m.add_argument("--tokenizer", default=None, help="tokenizer directory or file (default: the model's own)")
    m.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) accepted in the request's 'model' field; the first labels the metrics "
                        "(default: the --model value)")
    m.add_argument("--dtype", default="auto", help="weights/activation dtype: auto, float32, float16, bfloat16")
    m.add_argument("--quantization", default=None, help="weight quantization method (refused if not built)")
    m.add_argument("--seed", type=int, default=0, help="random seed of the engine")
    e = p.add_argument_group("engine")
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    e.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV-cache block")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of accelerator memory the engine may use (weights + KV cache)")
    e.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV-cache size in bytes (overrides --gpu-memory-utilization for the KV pool)")
    e.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length: prompt + generated tokens (default: the model's)")
    e.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help="most sequences in one batch (running requests)")
    e.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="most tokens computed in one engine step (prefill chunks + decodes)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of shared prompt prefixes (automatic prefix caching)")
    e.add_argument("--kv-cache-dtype", default="auto", help="KV-cache dtype: auto (= model dtype) or a supported one")
    e.add_argument("--num-threads", type=_positive_int, default=None,
                   help="intra-op threads of the engine on CPU (default: usable CPUs - 1, respecting the "
                        "affinity set and a cgroup CPU limit; OMP_NUM_THREADS also sets it)")
    e.add_argument("--tensor-parallel-size", type=_positive_int, default=1, help="number of tensor-parallel ranks")
    e.add_argument("--speculative-config", type=_json_arg, default=None,
                   help='speculative decoding, JSON (e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\')')
    e.add_argument("--structured-outputs-config", type=_json_arg, default=None,
                   help='structured output, JSON: vLLM\'s {"backend": "auto"|"xgrammar", "disable_any_whitespace": '
                        'bool} and kvfleet\'s {"max_whitespace": int (JSON whitespace between tokens, default 2), '
                        '"compile_timeout": seconds (default 5)}')
    e.add_argument("--enable-jump-forward", action="store_true",
                   help="append a grammar's forced continuation without sampling it (structured output)")
    t = p.add_argument_group("tools")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the model decides, --tool-call-parser extracts the calls')
    t.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="tool-call format of the model's output for tool_choice auto")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="0.0.0.0", help="address to bind")
    s.add_argument("--port", type=int, default=8000, help="port to bind")
    s.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or os.environ.get("KVFLEET_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on the API (not on /health, /metrics); "
                        "default from env VLLM_API_KEY or KVFLEET_API_KEY")
    s.add_argument("--max-queue-len", type=_positive_int, default=None,
                   help="answer 429 (Retry-After) when this many requests are already waiting (default: unbounded)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="kvfleet's log level")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no per-request access log lines")
    return p


ENGINE_FIELDS = ("model", "tokenizer", "dtype", "device", "block_size", "gpu_memory_utilization",
                 "kv_cache_memory_bytes", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "enable_prefix_caching", "quantization", "kv_cache_dtype", "tensor_parallel_size",
                 "speculative_config", "seed", "num_threads", "structured_outputs_config", "enable_jump_forward")


def engine_config(args: argparse.Namespace):
    """EngineConfig from the parsed flags (raises UnsupportedFeatureError / ValueError on bad values)."""
    from .config import EngineConfig

    kwargs = {name: getattr(args, name) for name in ENGINE_FIELDS if getattr(args, name) is not None}
    if args.served_model_name:
        kwargs["served_model_name"] = args.served_model_name[0]
    if "num_threads" not in kwargs and not os.environ.get("OMP_NUM_THREADS"):
        kwargs["num_threads"] = default_num_threads()
    return EngineConfig(**kwargs)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvfleet-server``; returns the process exit status."""
    t_main = time.monotonic()
    age_at_main = _process_age_s()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        print("error: --enable-auto-tool-choice requires --tool-call-parser", file=sys.stderr)
        return 2
    if args.shutdown_timeout < 0:
        print("error: --shutdown-timeout must be non-negative", file=sys.stderr)
        return 2
    try:
        config = engine_config(args)
    except (ValueError, TypeError) as exc:  # UnsupportedFeatureError / InvalidRequestError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logger.info("start-up: interpreter + imports %.2fs, flags and config %.2fs; engine threads: %s",
                age_at_main if age_at_main is not None else float("nan"), time.monotonic() - t_main,
                config.num_threads or os.environ.get("OMP_NUM_THREADS") or "torch default")

    from .api import ServerSettings, ServerState, build_app

    settings = ServerSettings(
        served_model_names=args.served_model_name or [config.resolved_served_name()], api_key=args.api_key,
        max_queue_len=args.max_queue_len, shutdown_timeout=args.shutdown_timeout,
        max_model_len=args.max_model_len or 2048, max_num_batched_tokens=args.max_num_batched_tokens or 2048,
        root=args.model, enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser)

    def factory():
        t0 = time.monotonic()
        from .engine.llm_engine import LLMEngine
        t1 = time.monotonic()
        llm = LLMEngine(config)
        t2 = time.monotonic()
        parts = getattr(llm, "startup_timings", None)
        detail = ", ".join(f"{k} {v:.2f}s" for k, v in parts.items()) if isinstance(parts, dict) else ""
        logger.info("start-up: engine imports %.2fs, engine build %.2fs%s", t1 - t0, t2 - t1,
                    f" ({detail})" if detail else "")
        return llm

    state = ServerState(settings, engine_factory=factory)
    app = build_app(state)
    return asyncio.run(_serve(app, state, args, t_main, age_at_main))


async def _serve(app, state, args, t_main: float, age_at_main: float | None) -> int:
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn without its own signal handling: SIGTERM must drain, not cut streams."""

        def capture_signals(self):  # noqa: D401
            import contextlib
            return contextlib.nullcontext()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=5,
                            timeout_graceful_shutdown=5, lifespan="on")
    server = _Server(config)
    loop = asyncio.get_running_loop()
    exit_code = 0
    drain_task: asyncio.Task | None = None

    def on_load_error(exc: BaseException) -> None:
        nonlocal exit_code
        print(f"error: loading the model failed: {exc}", file=sys.stderr)
        exit_code = 1
        server.should_exit = True

    state.on_load_error = on_load_error

    async def drain(sig_name: str) -> None:
        state.drain.start()
        timeout = args.shutdown_timeout
        logger.info("%s: draining (/health 503, new requests 503); %d request(s) in flight, up to %.0fs",
                    sig_name, state.drain.inflight, timeout)
        if not await state.drain.wait_idle(timeout):
            ids = state.engine.abort_all() if state.engine is not None else []
            logger.warning("shutdown timeout: aborted %d request(s)", len(ids))
            await state.drain.wait_idle(5.0)
        logger.info("drained; stopping")
        server.should_exit = True

    def on_signal(sig: signal.Signals) -> None:
        nonlocal drain_task
        if drain_task is None:
            drain_task = loop.create_task(drain(sig.name))
        else:
            logger.warning("second %s: exiting now", sig.name)
            server.should_exit = True
            server.force_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    async def report_ready() -> None:
        while state.engine is None and state.load_error is None:
            await asyncio.sleep(0.02)
        if state.engine is not None:
            since_main = time.monotonic() - t_main
            logger.info("start-up: ready to serve %.2fs after launch (model load %.2fs); /health is 200",
                        since_main + (age_at_main or 0.0), state.load_seconds or 0.0)

    ready_task = loop.create_task(report_ready())
    serve_task = loop.create_task(server.serve())
    while not server.started and not serve_task.done():
        await asyncio.sleep(0.01)
    if server.started:
        logger.info("start-up: HTTP listening on %s:%d %.2fs after launch", args.host, args.port,
                    time.monotonic() - t_main + (age_at_main or 0.0))
    try:
        await serve_task
    except SystemExit as exc:  # uvicorn exits on bind errors
        ready_task.cancel()
        return int(exc.code or 1)
    ready_task.cancel()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
