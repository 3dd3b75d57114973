"""KV-cache events over ZeroMQ in vLLM's wire format (``--kv-events-config``), for cache-aware routers.

What a subscriber sees (vLLM's ``ZmqEventPublisher``, vllm/distributed/kv_events.py):

- a PUB socket sending one multipart message per engine step that changed the prefix cache:
  ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian counter starting at 0, ``payload`` a msgpack
  ``KVEventBatch(ts, events, data_parallel_rank)``;
- events tagged by class name: ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium)``, ``BlockRemoved(block_hashes, medium)``, ``AllBlocksCleared()``. Block hashes are
  the prefix cache's own (32-byte blake2b digests, ``sequence.hash_block_tokens``), so a
  subscriber can match them against nothing else — it keys its index on ``token_ids`` and the parent
  chain, as llm-d's precise prefix-cache scorer does;
- structs encoded positionally (msgspec ``array_like=True``): the layout vLLM used before
  vllm-project/vllm#42892 moved the events to maps, and the one every consumer decodes (llm-d-router
  0.10's vLLM adapter reads both; AIBrix, Dynamo and kthena read arrays). ``medium`` is ``"GPU"``, vLLM's
  name for the engine's own KV pool, on any device; ``lora_id`` is None (an adapter's id is not passed on yet; its blocks' hashes differ from the base model's);
- a ROUTER socket (``replay_endpoint``) answering ``[identity, b"", start_seq]`` with every buffered
  batch whose seq >= start_seq as ``[identity, b"", seq, payload]``, then ``[identity, b"", -1, b""]``
  (vLLM's replay protocol; ``buffer_steps`` batches are kept).

The engine never waits on this module: after each step the engine thread puts the step's events in a
bounded queue (``max_queue_size`` batches) and returns; a publisher thread encodes and sends them and
serves replays. When the queue is full the batch is dropped and counted (``on_drop``; the server's
``kvfleet:kv_events_dropped_total``); its sequence number is skipped, so subscribers see the gap and
recover (llm-d asks for a replay, then rebuilds that pod's index). A subscriber that stops reading
costs nothing either: ZeroMQ drops its messages beyond ``hwm``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from .config import KVEventsConfig
from .engine.kv_cache import BlocksRemoved, BlocksStored, CacheCleared, KVEvent

logger = logging.getLogger("kvfleet.kv_events")

MEDIUM_GPU = "GPU"  # vLLM's medium of the engine's own KV pool
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # end of a replay


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events: ``ts`` (seconds since the epoch), ``events``, ``data_parallel_rank``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; msgspec writes the class name as the first array element."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(events: list[KVEvent], block_size: int) -> list[KVCacheEvent]:
    """The engine's records (``engine.kv_cache``) as vLLM's event structs."""
    out: list[KVCacheEvent] = []
    for e in events:
        if isinstance(e, BlocksStored):
            out.append(BlockStored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), block_size,
                                   None, MEDIUM_GPU))
        elif isinstance(e, BlocksRemoved):
            out.append(BlockRemoved(list(e.block_hashes), MEDIUM_GPU))
        elif isinstance(e, CacheCleared):
            out.append(AllBlocksCleared())
        else:
            raise TypeError(f"not a KV event: {e!r}")
    return out


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind an endpoint with a wildcard (``*``, ``::``) or an ipc:// / inproc:// one, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket + replay ROUTER + bounded queue + publisher thread (see the module docstring).

    Args:
        config: the server's ``KVEventsConfig`` (publisher "zmq").
        block_size: the engine's tokens per block (``BlockStored.block_size``).
        on_drop: called with 1 on the engine thread for each batch dropped because the queue was full.
        context: the ZeroMQ context (default: the process's shared one).

    Raises zmq.ZMQError when an endpoint cannot be bound or connected (e.g. the port is taken).
    """

    POLL_S = 0.05  # how long the publisher thread waits for a batch before checking replays again

    def __init__(self, config: KVEventsConfig, block_size: int, on_drop: Callable[[int], None] | None = None,
                 data_parallel_rank: int = 0, context: zmq.Context | None = None):
        self.config = config
        self.block_size = block_size
        self.on_drop = on_drop
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfleet-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (topic %r)%s", config.endpoint, config.topic,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    # ------------------------------------------------------------------ engine thread

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (never blocks). A full queue drops the batch and skips its sequence number."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.on_drop is not None:
                self.on_drop(1)

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), stop the thread, close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events: publisher thread still busy after %.1fs; %d batch(es) unsent",
                           timeout, self._queue.qsize())
        else:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # ------------------------------------------------------------------ publisher thread

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                seq, ts, events = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                batch = KVEventBatch(ts=ts, events=to_wire(events, self.block_size),
                                     data_parallel_rank=self.data_parallel_rank)
                payload = encoder.encode(batch)
                self._send(seq, payload)
                self._buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - a broken batch must not stop the next ones
                logger.exception("KV events: could not publish batch %d", seq)

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: ignoring a replay request of %d frame(s) (expected identity, '', seq)",
                           len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))
