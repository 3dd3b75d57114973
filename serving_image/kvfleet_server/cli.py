"""``kvfleet-server``: the OpenAI-compatible server, with vLLM's flag names and meanings.

Start-up order (each phase is logged with its duration, cold start matters to autoscaling):
parse flags → validate EngineConfig (unbuilt features are refused here: "not supported yet: ...",
exit status 2) → bind the HTTP port (/health answers 503 "loading") → build the engine in a worker
thread (weights, tokenizer, KV-cache allocation) → /health turns 200.
SIGTERM/SIGINT: graceful drain (see ``api/drain.py``), then the tensor-parallel workers stop; exit
status 0. A second signal exits at once. A tensor-parallel worker that dies makes /health 503, aborts
the in-flight requests and ends the server with status 1 (Kubernetes restarts the pod).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from .flags import FlagError, build_parser, engine_config, parse_flags

logger = logging.getLogger("kvfleet.server")

FATAL_EXIT_DELAY_S = 1.0  # /health stays up (503) this long after a fatal error before the server exits


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


def server_settings(args: argparse.Namespace, config, chat_template: str | None):
    """The HTTP layer's ServerSettings from the parsed flags, the EngineConfig and the read chat template."""
    from .api import ServerSettings

    return ServerSettings(
        served_model_names=args.served_model_name or [config.resolved_served_name()], api_key=args.api_key,
        max_queue_len=args.max_queue_len, shutdown_timeout=args.shutdown_timeout,
        max_model_len=args.max_model_len or 2048, max_num_batched_tokens=args.max_num_batched_tokens or 2048,
        root=args.model, max_logprobs=args.max_logprobs, chat_template=chat_template,
        cors={"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
              "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials},
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        log_stats=not args.disable_log_stats, kv_events_config=args.kv_events_config)


def uvicorn_settings(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``uvicorn.Config`` that come from the flags."""
    return dict(host=args.host, port=args.port, log_level=args.uvicorn_log_level, root_path=args.root_path or "",
                access_log=not args.disable_uvicorn_access_log)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a readable file's contents, else the value itself is the template (vLLM's rule)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise FlagError(f"--chat-template: {value!r} is neither a readable file nor a Jinja template")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvfleet-server``; returns the process exit status."""
    t_main = time.monotonic()
    age_at_main = _process_age_s()
    try:
        args = parse_flags(sys.argv[1:] if argv is None else argv)
        chat_template = read_chat_template(args.chat_template)
        config = engine_config(args)
    except FlagError as exc:
        build_parser().print_usage(sys.stderr)
        print(f"kvfleet-server: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as exc:  # UnsupportedFeatureError / InvalidRequestError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logger.info("start-up: interpreter + imports %.2fs, flags and config %.2fs; engine threads: %s",
                age_at_main if age_at_main is not None else float("nan"), time.monotonic() - t_main,
                config.num_threads or os.environ.get("OMP_NUM_THREADS") or "torch default")

    from .api import ServerState, build_app

    settings = server_settings(args, config, chat_template)

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
        from .memory import release_freed_heap, resident_bytes

        before = resident_bytes()
        if release_freed_heap() and before is not None:
            logger.info("start-up: freed heap returned to the OS: RSS %.0f MB -> %.0f MB", before / 1e6,
                        (resident_bytes() or 0) / 1e6)
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

    config = uvicorn.Config(app, **uvicorn_settings(args), timeout_keep_alive=5, timeout_graceful_shutdown=5,
                            lifespan="on")
    server = _Server(config)
    loop = asyncio.get_running_loop()
    exit_code = 0
    drain_task: asyncio.Task | None = None

    def on_load_error(exc: BaseException) -> None:
        nonlocal exit_code
        from .model.lora_checkpoint import LoRAError

        if isinstance(exc, LoRAError):  # a bad --lora-modules adapter: a usage error, as a bad flag
            print(f"error: {exc}", file=sys.stderr)
            exit_code = 2
        else:
            print(f"error: loading the model failed: {exc}", file=sys.stderr)
            exit_code = 1
        server.should_exit = True

    state.on_load_error = on_load_error

    def on_fatal(reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        if state.engine is not None:
            state.engine.abort_all()  # in-flight requests end now instead of waiting on a dead rank
        # keep answering /health 503 for a moment (probes and routers see why), then stop
        loop.call_later(FATAL_EXIT_DELAY_S, setattr, server, "should_exit", True)

    state.on_fatal = on_fatal

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
    if state.fatal_error is not None:
        # an engine thread may be blocked in a collective with the dead rank: do not wait for it
        logger.error("exiting with status %d: %s", exit_code, state.fatal_error)
        from .executor.workers import stop_all_workers

        stop_all_workers()
        logging.shutdown()
        sys.stderr.flush()
        os._exit(exit_code)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
