"""The bridge between the asyncio HTTP loop and the (not thread-safe) ``LLMEngine``.

One dedicated engine thread owns the engine. Each loop turn it drains a command queue (add, abort),
runs one ``engine.step()`` when work is pending (blocking on the queue when idle), feeds the metrics
(and their periodic stats log line, checked after each step and on each idle wake-up), and hands the
step's ``RequestOutput``s to the asyncio loop in one ``call_soon_threadsafe``. The HTTP loop never waits
on model compute: it only awaits per-request ``asyncio.Queue``s.

Admission: ``num_waiting()`` counts requests sent to the engine thread but not yet added plus the
engine's waiting queue as of its last step; the HTTP layer refuses new work (429) when that reaches
``--max-queue-len``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from ..errors import EngineDeadError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..sequence import LoRARequest
from ..stats import SchedulerStats

logger = logging.getLogger("kvfleet.engine_loop")


class RequestAborted(Exception):
    """The request was aborted by the server (drain timeout, shutdown) before it finished."""


_ABORTED = object()


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    future: asyncio.Future
    arrival: float
    add_special_tokens: bool = True
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: object
    future: asyncio.Future


_STOP = object()


class AsyncEngine:
    """Runs an ``LLMEngine`` in its own thread; ``add_many`` returns one async ``RequestStream`` per request.

    Args:
        engine: an ``LLMEngine`` (anything with add_request/abort_request/step/has_unfinished/get_stats).
        metrics: ``ServerMetrics`` fed from the engine thread, or None.
        idle_poll_s: how long the idle engine thread waits on its command queue before re-checking stop.
    """

    def __init__(self, engine, metrics=None, idle_poll_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self._idle_poll_s = idle_poll_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._stats = SchedulerStats()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_error: BaseException | None = None
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: the running loop)."""
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still in it are dropped)."""
        self._cmds.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # ------------------------------------------------------------------ views (any thread)

    def num_waiting(self) -> int:
        """Requests accepted but not yet scheduled: queued to the engine thread + the engine's waiting queue."""
        with self._lock:
            return self._pending_adds + self._stats.num_waiting

    def stats(self) -> SchedulerStats:
        """The engine's gauges as of its last loop turn."""
        with self._lock:
            return self._stats

    # ------------------------------------------------------------------ asyncio side

    async def add_many(self, requests: list[tuple[str, str | list[int], SamplingParams, str | None]],
                       add_special_tokens: bool = True, lora_request=None) -> list["RequestStream"]:
        """Submit requests ``(request_id, prompt, params, cache_salt)`` together; returns one stream each.

        ``add_special_tokens``: whether the engine adds BOS etc. when it tokenizes a text prompt;
        ``lora_request``: the LoRA adapter they run with (``sequence.LoRARequest``), or None.

        Waits until the engine thread has accepted all of them.

        Raises:
            InvalidRequestError / PromptTooLongError: the engine refused one (HTTP 400); all are aborted.
            EngineDeadError: the engine thread is not running.
        """
        if not self.is_running:
            raise EngineDeadError(str(self.dead_error or "engine loop is not running"))
        loop = asyncio.get_running_loop()
        streams, futures = [], []
        with self._lock:
            self._pending_adds += len(requests)
        for request_id, prompt, params, salt in requests:
            stream = RequestStream(self, request_id)
            self._streams[request_id] = stream.queue
            fut = loop.create_future()
            self._cmds.put(_Add(request_id, prompt, params, salt, fut, time.monotonic(), add_special_tokens,
                                lora_request))
            streams.append(stream)
            futures.append(fut)
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except BaseException:
            for s in streams:
                s.close()
            raise
        for r in results:
            if isinstance(r, BaseException):
                for s in streams:
                    s.close()
                raise r
        return streams

    async def call(self, fn):
        """Run ``fn()`` on the engine thread between two steps and return its result.

        For work that touches engine-owned objects which are not thread-safe (the tokenizer used by
        /tokenize and /detokenize); exceptions propagate to the caller.
        """
        if not self.is_running:
            raise EngineDeadError(str(self.dead_error or "engine loop is not running"))
        fut = asyncio.get_running_loop().create_future()
        self._cmds.put(_Call(fn, fut))
        return await fut

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._cmds.put(_Abort(request_id))

    def abort_all(self) -> list[str]:
        """Abort every live request (drain timeout); iterating their streams raises RequestAborted."""
        ids = list(self._streams)
        for rid in ids:
            q = self._streams.pop(rid, None)
            if q is not None:
                q.put_nowait(_ABORTED)
            self._cmds.put(_Abort(rid))
        return ids

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._streams):
            q = self._streams.pop(rid, None)
            if q is not None:
                q.put_nowait(EngineDeadError(str(exc)))

    # ------------------------------------------------------------------ engine thread

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _handle(self, cmd) -> bool:
        """Apply one command; returns False on stop."""
        if cmd is _STOP:
            return False
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival,
                                        cache_salt=cmd.cache_salt, add_special_tokens=cmd.add_special_tokens,
                                        lora_request=cmd.lora_request)
            except Exception as exc:  # noqa: BLE001 - handed to the HTTP handler (400 for InvalidRequestError)
                self._post(_set_exception, cmd.future, exc)
                return True
            if self.metrics is not None:
                self.metrics.request_added(cmd.request_id, cmd.arrival)
            self._post(_set_result, cmd.future, None)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                self._post(_set_exception, cmd.future, exc)
            else:
                self._post(_set_result, cmd.future, result)
        elif isinstance(cmd, _Abort):
            try:
                self.engine.abort_request(cmd.request_id)
            except Exception:  # noqa: BLE001 - unknown / already finished ids are fine
                logger.debug("abort of %s ignored", cmd.request_id, exc_info=True)
            if self.metrics is not None:
                self.metrics.on_abort(cmd.request_id)
        return True

    def _refresh_stats(self, consumed_adds: int = 0) -> None:
        stats = self.engine.get_stats()
        with self._lock:  # one update, so num_waiting() never misses a request between queue and engine
            self._stats = stats
            self._pending_adds -= consumed_adds
        if self.metrics is not None:
            self.metrics.set_scheduler_stats(stats)
            self.metrics.maybe_log(stats)

    def _run(self) -> None:
        try:
            import torch
        except ImportError:  # engines without torch (test doubles)
            self._loop_body()
            return
        with torch.inference_mode():  # the serving loop never needs autograd (as vLLM's workers)
            self._loop_body()

    def _loop_body(self) -> None:
        try:
            running = True
            self._refresh_stats()
            while running:
                cmds = []
                if not self.engine.has_unfinished():
                    try:
                        cmds.append(self._cmds.get(timeout=self._idle_poll_s))
                    except queue.Empty:
                        if self.metrics is not None:  # the last interval's line is due even when idle
                            self.metrics.maybe_log(self.stats())
                        continue
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    if not self._handle(cmd):
                        running = False
                if not running:
                    break
                outputs = []
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    if self.metrics is not None:
                        it = getattr(self.engine, "last_iteration", None)
                        if it is not None:
                            self.metrics.on_iteration(it)
                        now = time.monotonic()
                        for out in outputs:
                            self.metrics.on_output(out, now)
                self._refresh_stats(sum(isinstance(c, _Add) for c in cmds))
                if outputs:
                    self._post(self._deliver, outputs)
        except BaseException as exc:  # noqa: BLE001 - the engine died: fail every request, /health turns 503
            logger.exception("engine loop died")
            self.dead_error = exc
            self._post(self._fail_all, exc)
        finally:
            self._stopped.set()
            self._fail_queued_commands(EngineDeadError(str(self.dead_error or "engine loop stopped")))

    def _fail_queued_commands(self, exc: BaseException) -> None:
        """Answer adds and calls that the stopped loop will never run (their handlers would wait forever)."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Call)):
                self._post(_set_exception, cmd.future, exc)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class RequestStream:
    """Outputs of one engine request, consumed on the asyncio loop.

    Iterate with ``async for out in stream``; call ``close()`` when done (always, e.g. in ``finally``):
    a stream closed before its request finished aborts it in the engine, freeing its KV blocks.
    """

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def __aiter__(self):
        while not self.finished:
            item = await self.queue.get()
            if item is _ABORTED:
                self.finished = True
                raise RequestAborted(self.request_id)
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            yield item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._abort(self.request_id)
