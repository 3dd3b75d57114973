"""What the HTTP handlers share: settings, the engine bridge (None while loading), metrics and drain state."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import KVEventsConfig
from ..generation_config import GenerationDefaults
from ..metrics import ServerMetrics
from .async_engine import AsyncEngine
from .drain import Drain
from .errors import APIError

logger = logging.getLogger("kvfleet.server")


@dataclass
class ServerSettings:
    """HTTP-layer settings (the engine's live in EngineConfig).

    Attributes:
        served_model_names: names accepted in the ``model`` field; the first is reported and labels metrics.
        api_key: when set, /v1/*, /tokenize and /detokenize need ``Authorization: Bearer <api_key>``.
        max_queue_len: refuse new requests with 429 once this many are waiting (None: unbounded).
        shutdown_timeout: seconds in-flight requests get to finish after SIGTERM.
        max_model_len / max_num_batched_tokens: only size the token histograms before the engine is loaded.
        retry_after_s: value of the Retry-After header on 429/503.
        root: what /v1/models reports as each model's ``root`` (the --model value).
        max_logprobs: most log-probabilities per token a request may ask for (-1: no limit).
        chat_template: Jinja chat template replacing the tokenizer's (--chat-template), or None.
        cors: keyword arguments of starlette's CORSMiddleware (--allowed-origins etc.), or None for no CORS.
        enable_auto_tool_choice / tool_call_parser: vLLM's flags for ``tool_choice: "auto"`` (api/tools.py).
        log_stats: write the periodic stats log line (False: vLLM's --disable-log-stats).
        kv_events_config: --kv-events-config (``config.KVEventsConfig``): publish the prefix cache's events
            over ZeroMQ (``kv_events.ZmqEventPublisher``), or None.
    """

    served_model_names: list[str]
    api_key: str | None = None
    max_queue_len: int | None = None
    shutdown_timeout: float = 30.0
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    retry_after_s: int = 1
    root: str | None = None
    max_logprobs: int = 20
    chat_template: str | None = None
    cors: dict | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    log_stats: bool = True
    kv_events_config: "KVEventsConfig | None" = None


class ServerState:
    """Owns the engine bridge. Created before the model is loaded so /health can answer 503 meanwhile.

    Args:
        settings: ServerSettings.
        engine: an already built LLMEngine, or None when ``engine_factory`` builds it at start-up.
        engine_factory: zero-argument callable returning an LLMEngine (run in a worker thread).
    """

    def __init__(self, settings: ServerSettings, engine=None, engine_factory: Callable | None = None):
        self.settings = settings
        self.model_name = settings.served_model_names[0]
        self.metrics = ServerMetrics(self.model_name, settings.max_model_len, settings.max_num_batched_tokens,
                                     **({} if settings.log_stats else {"log_stats_interval_s": None}))
        self.drain = Drain()
        self.llm = None
        self.engine: AsyncEngine | None = None
        self._pending_engine = engine
        self._factory = engine_factory
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.created = int(time.time())
        self.load_seconds: float | None = None
        #: set when the server can no longer serve at all (a tensor-parallel worker died); /health is 503
        self.fatal_error: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self.kv_events = None  # kv_events.ZmqEventPublisher while publishing

    # ------------------------------------------------------------------ lifecycle (asyncio loop)

    async def start(self) -> None:
        """Attach a given engine now, or load one in a worker thread (the loop keeps answering /health).
        A load that fails, or a KV-events endpoint that cannot be bound, is reported through
        ``load_error`` / ``on_load_error`` (the server exits non-zero)."""
        llm = self._pending_engine
        if llm is None and self._factory is not None:
            t0 = time.monotonic()
            try:
                llm = await _in_daemon_thread(self._factory)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - reported, process exits non-zero
                self._load_failed(exc, "loading the engine failed")
                return
            self.load_seconds = time.monotonic() - t0
        if llm is None:
            return
        try:
            self._start_kv_events(llm)
        except Exception as exc:  # noqa: BLE001 - e.g. the ZeroMQ port is taken
            self._load_failed(exc, "starting the KV-events publisher failed")
            return
        self._attach(llm)

    def _load_failed(self, exc: BaseException, what: str) -> None:
        logger.error("%s: %s", what, exc, exc_info=exc)
        self.load_error = exc
        if self.on_load_error is not None:
            self.on_load_error(exc)

    def _start_kv_events(self, llm) -> None:
        """Bind the KV-events publisher and make the engine hand it each step's events (--kv-events-config)."""
        cfg = self.settings.kv_events_config
        if cfg is None or not cfg.publishes:
            return
        if not llm.config.enable_prefix_caching:
            logger.warning("--kv-events-config with --no-enable-prefix-caching: no block is ever cached, so no "
                           "KV event is published")
        from ..kv_events import ZmqEventPublisher

        self.kv_events = ZmqEventPublisher(cfg, llm.config.block_size,
                                           on_drop=self.metrics.kv_events_dropped.inc)
        llm.set_kv_events_sink(self.kv_events.publish)

    def _attach(self, llm) -> None:
        self.llm = llm
        cfg = getattr(llm, "config", None)
        engine = AsyncEngine(llm, self.metrics)
        engine.start()
        watch = getattr(llm, "watch_workers", None)
        if watch is not None:
            loop = asyncio.get_running_loop()
            watch(lambda rank, pid, code: loop.call_soon_threadsafe(
                self.fail, f"tensor-parallel worker rank {rank} (pid {pid}) died with exit code {code}"))
        stats = llm.get_stats()
        self.metrics.set_scheduler_stats(stats)
        self.metrics.set_cache_config(
            block_size=getattr(cfg, "block_size", 0), num_gpu_blocks=stats.num_blocks_total,
            enable_prefix_caching=getattr(cfg, "enable_prefix_caching", False),
            gpu_memory_utilization=getattr(cfg, "gpu_memory_utilization", 0.0),
            kv_cache_dtype=getattr(cfg, "kv_cache_dtype", "auto"))
        spec = getattr(llm, "spec_config", None)
        if spec is not None:
            self.metrics.enable_spec_decode(spec.num_speculative_tokens)
        self.engine = engine

    def fail(self, reason: str) -> None:
        """The server cannot serve any more (asyncio loop): /health turns 503, ``on_fatal`` is told."""
        if self.fatal_error is not None:
            return
        self.fatal_error = reason
        logger.error("%s: the server cannot serve without every rank; stopping", reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        stop = getattr(self.llm, "shutdown", None)
        if stop is not None and self.fatal_error is None:
            stop()

    # ------------------------------------------------------------------ request-time checks

    @property
    def ready(self) -> bool:
        """True when a request would be served now (loaded, engine alive, not draining)."""
        return (self.engine is not None and self.engine.is_running and not self.drain.draining
                and self.fatal_error is None)

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.llm, "max_model_len", self.settings.max_model_len))

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The loaded engine's request defaults (--generation-config)."""
        self.require_engine()
        return self.llm.generation_defaults

    @property
    def tokenizer(self):
        self.require_engine()
        return self.llm.tokenizer

    def require_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise APIError(503, "the model is still loading", code="model_loading",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        if not self.engine.is_running:
            raise APIError(503, f"the engine is not running: {self.engine.dead_error}", code="engine_dead")
        return self.engine

    def check_model(self, model: str | None) -> None:
        self.resolve_model(model)

    def resolve_model(self, model: str | None):
        """The LoRA adapter (``sequence.LoRARequest``) the ``model`` field names, or None for the base model
        (a served model name, or no name). Raises APIError 404 for any other name."""
        if model is None or model in self.settings.served_model_names:
            return None
        if self.llm is None:  # adapters are known once the engine is loaded: 503 while loading
            self.require_engine()
        lora = self.llm.get_lora(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return lora

    def admit(self, num_requests: int) -> AsyncEngine:
        """Admission control for generation: 503 while draining/loading, 429 when the waiting queue is full."""
        if self.drain.draining:
            self.metrics.admission_rejected("draining")
            raise APIError(503, "the server is shutting down and accepts no new requests", code="draining",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        engine = self.require_engine()
        limit = self.settings.max_queue_len
        if limit is not None and engine.num_waiting() + num_requests > limit:
            self.metrics.admission_rejected("queue_full")
            raise APIError(429, f"the waiting queue is full (--max-queue-len {limit}); retry later",
                           code="queue_full", headers={"Retry-After": str(self.settings.retry_after_s)})
        return engine


def _settle(fut: asyncio.Future, result, exc: BaseException | None) -> None:
    if not fut.done():
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)


async def _in_daemon_thread(fn):
    """Run ``fn()`` in a daemon thread (a SIGTERM during loading must not wait for the load to end)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def work():
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            # bind the exception now: Python unbinds ``exc`` when the except block ends, before the
            # loop runs the callback (a closure over it raised NameError and the load hung)
            loop.call_soon_threadsafe(_settle, fut, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, fut, result, None)

    threading.Thread(target=work, name="kvfleet-load", daemon=True).start()
    return await fut
