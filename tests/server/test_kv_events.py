"""KV events (--kv-events-config) seen by a real ZeroMQ subscriber, decoded with msgspec against vLLM's layout.

The decoding structs below are written from vLLM's field layout (vllm/distributed/kv_events.py, the
positional encoding; examples/online_serving/kv_events_subscriber.py), not imported from kvfleet: a field
kvfleet put in the wrong place fails here.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_server.flags import FlagError, parse_flags
from kvfleet_server.config import KVEventsConfig
from kvfleet_server.sequence import hash_block_tokens
from kvfleet_server.kv_events import ZmqEventPublisher
from kvfleet_server.metrics import ServerMetrics
from kvfleet_server.sampling_params import SamplingParams

from engine_helpers import run_to_completion
from server_fixtures import free_port


# --- vLLM's layout (subscriber side) ------------------------------------------------------------
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VKVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(VKVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(VKVCacheEvent):
    pass


class VKVEventBatch(VEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VKVEventBatch)
BS = 4
TOPIC = "kv@pod-a@tiny"


class Subscriber:
    """A SUB socket connected to the publisher; ``messages`` = [(topic, seq, KVEventBatch)] in arrival order."""

    def __init__(self, port: int, topic: str = "kv@"):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)  # ZeroMQ's slow joiner: let the subscription reach the PUB socket
        self.messages: list[tuple[str, int, VKVEventBatch]] = []

    def receive(self, n: int, timeout: float = 5.0) -> list[tuple[str, int, VKVEventBatch]]:
        """Wait for ``n`` more messages; returns them."""
        start = len(self.messages)
        deadline = time.monotonic() + timeout
        while len(self.messages) < start + n:
            left = deadline - time.monotonic()
            assert left > 0, f"got {len(self.messages) - start} of {n} messages"
            if self.sock.poll(int(left * 1000)):
                topic, seq, payload = self.sock.recv_multipart()
                assert len(seq) == 8
                self.messages.append((topic.decode(), int.from_bytes(seq, "big"), DECODER.decode(payload)))
        return self.messages[start:]

    def events(self) -> list:
        return [e for _, _, batch in self.messages for e in batch.events]

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def publishing(tiny_engine_factory):
    """(engine, publisher, subscriber, metrics, port): a tiny engine (block size 4) publishing on a free port."""
    made = []

    def make(**engine_kw):
        port, replay = free_port(), free_port()
        eng = tiny_engine_factory(block_size=BS, **engine_kw)
        metrics = ServerMetrics("tiny", log_stats_interval_s=None)
        cfg = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                        "replay_endpoint": f"tcp://*:{replay}", "topic": TOPIC,
                                        "max_queue_size": 4})
        pub = ZmqEventPublisher(cfg, BS, on_drop=metrics.kv_events_dropped.inc)
        eng.set_kv_events_sink(pub.publish)
        sub = Subscriber(port)
        made.append((pub, sub))
        return eng, pub, sub, metrics, replay

    yield make
    for pub, sub in made:
        sub.close()
        pub.shutdown()


def _run(eng, rid: str, prompt: list[int], max_tokens: int = 1):
    eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return run_to_completion(eng)[rid]


def _chain(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // BS):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * BS : (i + 1) * BS]))
    return hashes


def test_config_is_vllms():
    cfg = KVEventsConfig()
    assert (cfg.enable_kv_cache_events, cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps,
            cfg.hwm, cfg.max_queue_size, cfg.topic) == (False, "null", "tcp://*:5557", None, 10_000, 100_000,
                                                        100_000, "")
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    args = parse_flags(["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv@p@m"}'])
    assert args.kv_events_config.publishes and args.kv_events_config.topic == "kv@p@m"
    assert not parse_flags(["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}']) \
        .kv_events_config.publishes
    with pytest.raises(FlagError, match=r"--kv-events-config: kv_events_config: unknown key\(s\) \['endpiont'\]"):
        parse_flags(["--kv-events-config", '{"endpiont": "tcp://*:1"}'])
    with pytest.raises(FlagError, match="publisher must be 'zmq' or 'null'"):
        parse_flags(["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'])
    with pytest.raises(FlagError, match="buffer_steps must be a positive integer"):
        parse_flags(["--kv-events-config", '{"buffer_steps": 0}'])


def test_block_stored_removed_cleared_with_the_prefix_caches_hashes(publishing):
    # 10 blocks of 4 tokens; prompts of 3 full blocks (+2 tokens) leave room for 3 cached prompts
    eng, pub, sub, _, _ = publishing(kv_cache_memory_bytes=10 * BS * 512)
    assert eng.kv.num_blocks == 10
    a = list(range(100, 114))  # 14 tokens: 3 full blocks
    _run(eng, "a", a)
    (topic, seq, batch), = sub.receive(1)
    assert topic == TOPIC and seq == 0 and batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 30
    (stored,) = batch.events
    hashes = _chain(a)
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == hashes  # the prefix cache's own chained hashes, every full block
    assert [eng.kv.pool.lookup(h) is not None for h in hashes] == [True] * 3
    assert stored.parent_block_hash is None and stored.token_ids == a[:12]
    assert (stored.block_size, stored.lora_id, stored.medium) == (BS, None, "GPU")

    # the same prefix again: cache hits, nothing new stored, no message
    _run(eng, "a2", a[:12] + [7, 8])
    # a prompt continuing the cached prefix: only its new blocks, parented on the cached chain
    b = a[:12] + list(range(200, 210))  # 22 tokens: 5 full blocks, 3 cached
    _run(eng, "b", b)
    (_, seq, batch), = sub.receive(1)
    assert seq == 1
    (stored,) = batch.events
    assert stored.block_hashes == _chain(b)[3:] and stored.parent_block_hash == hashes[-1]
    assert stored.token_ids == b[12:20]

    # a long unrelated prompt needs more blocks than are uncached: the LRU cached blocks are evicted
    c = list(range(300, 330))  # 30 tokens: 8 blocks of the 10
    _run(eng, "c", c)
    msgs = sub.receive(1)
    removed = [h for _, _, bt in msgs for e in bt.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(_chain(b))
    assert sorted(h for h in _chain(b) if eng.kv.pool.lookup(h) is None) == sorted(removed)  # <=> gone from the cache
    assert all(e.medium == "GPU" for _, _, bt in msgs for e in bt.events if isinstance(e, BlockRemoved))
    assert any(isinstance(e, BlockStored) and e.token_ids == c[:28] for _, _, bt in msgs for e in bt.events)

    eng.reset_prefix_cache()
    (_, _, batch), = sub.receive(1)
    assert [type(e) for e in batch.events] == [AllBlocksCleared]
    assert eng.kv.pool.lookup(_chain(c)[0]) is None

    seqs = [s for _, s, _ in sub.messages]
    assert seqs == list(range(len(seqs)))  # no gaps
    assert pub.num_dropped == 0


def test_replay_answers_a_late_subscriber(publishing):
    eng, pub, sub, _, replay_port = publishing()
    for i in range(3):
        _run(eng, f"r{i}", [1000 * (i + 1) + t for t in range(9)])  # 2 full blocks each
    live = sub.receive(3)
    dealer = zmq.Context.instance().socket(zmq.DEALER)  # what llm-d's subscriber uses
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    finally:
        dealer.close(linger=0)
    assert got == [(seq, batch) for _, seq, batch in live[1:]]


def test_a_stalled_subscriber_never_slows_the_step(publishing):
    eng, pub, live, metrics, _ = publishing()
    port = int(pub.config.endpoint.rsplit(":", 1)[1])
    stalled = zmq.Context.instance().socket(zmq.SUB)  # subscribes, then never reads
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt_string(zmq.SUBSCRIBE, "")
    stalled.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)
    try:
        # the reading subscriber misses nothing. Each batch is received before the next run: the fixture's queue
        # holds 4 batches, and a publisher thread starved for the few ms of six tiny runs would drop some (CI did)
        for i in range(6):
            _run(eng, f"s{i}", [5000 + 100 * i + t for t in range(8)])
            assert [s for _, s, _ in live.receive(1)] == [i]
        assert pub.num_dropped == 0

        # the publisher thread itself stalls (as if starved): the queue holds max_queue_size batches, the
        # engine's call never waits, the overflow is dropped and counted, and its sequence numbers are skipped
        release = threading.Event()
        sent = pub._send
        pub._send = lambda seq, payload: (release.wait(30), sent(seq, payload))
        durations = []

        def timed_publish(events):
            t0 = time.perf_counter()
            pub.publish(events)
            durations.append(time.perf_counter() - t0)

        eng.set_kv_events_sink(timed_publish)
        _run(eng, "blocked", [9000 + t for t in range(8)])  # one batch, taken by the thread, which hangs in _send
        deadline = time.monotonic() + 5
        while pub._queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(8):  # one batch each
            _run(eng, f"q{i}", [7000 + 100 * i + t for t in range(8)])
        assert len(durations) == 9 and max(durations) < 0.05
        assert pub._queue.qsize() == pub.config.max_queue_size == 4
        assert pub.num_dropped == 8 - 4
        text = metrics.render().decode()
        (dropped,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                      if s.name == "kvfleet:kv_events_dropped_total"]
        assert dropped == 4
        release.set()
        later = [s for _, s, _ in live.receive(1 + 4)]
        assert later == [6, 7, 8, 9, 10]  # the 4 dropped batches (11-14) never appear: a subscriber sees
        _run(eng, "after", [8000 + t for t in range(8)])  # the gap once the next batch arrives
        assert [s for _, s, _ in live.receive(1)] == [15]
    finally:
        stalled.close(linger=0)


def test_server_publishes_and_exports_what_the_endpoint_picker_reads(tiny_llama_dir, tmp_path):
    """A real kvfleet-server process: --kv-events-config wired to the engine, /v1/completions/render giving the
    token ids BlockStored then reports, vllm:cache_config_info with block_size and num_gpu_blocks, the drop
    counter exported; a taken port stops the server with a clear error."""
    from server_fixtures import running_server, scrape, start_server

    port = free_port()
    cfg = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}", "topic": "kv@p@tiny"}}'
    args = ["--model", tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
            "--block-size", "16", "--kv-cache-memory-bytes", str(4 << 20), "--num-threads", "1",
            "--kv-events-config", cfg]
    with running_server(args, str(tmp_path / "server.log")) as srv:
        sub = Subscriber(port)
        try:
            import httpx

            # what llm-d's token-producer asks (/v1/completions/render) is what the server caches: the
            # rendered token ids are the ones BlockStored reports after the request runs
            body = {"model": "tiny", "prompt": "the quick brown fox jumps over the lazy dog " * 6, "max_tokens": 1,
                    "temperature": 0}
            rendered = httpx.post(srv.url + "/v1/completions/render", json=body, timeout=30)
            assert rendered.status_code == 200, rendered.text
            (gen,) = rendered.json()
            assert gen["model"] == "tiny" and gen["request_id"].startswith("cmpl-")
            tokens = gen["token_ids"]
            assert tokens == httpx.post(srv.url + "/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
            r = httpx.post(srv.url + "/v1/completions", timeout=60, json=body)
            assert r.status_code == 200, r.text
            (topic, seq, batch), = sub.receive(1, timeout=15)
            assert (topic, seq) == ("kv@p@tiny", 0)
            (stored,) = batch.events
            full = len(tokens) // 16
            assert stored.block_size == 16 and stored.token_ids == tokens[: full * 16] and len(stored.block_hashes) == full
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}
            rendered = httpx.post(srv.url + "/v1/chat/completions/render", json=chat, timeout=30).json()
            assert rendered["token_ids"] == httpx.post(srv.url + "/tokenize", json=chat).json()["tokens"]
            assert httpx.post(srv.url + "/v1/chat/completions/render", json={**chat, "model": "nope"}).status_code == 404
        finally:
            sub.close()
        m = scrape(srv.url)
        info = [k for k in m if k.startswith("vllm:cache_config_info{")]
        assert len(info) == 1 and "block_size=16" in info[0] and f"num_gpu_blocks={(4 << 20) // (16 * 512)}" in info[0]
        assert m["kvfleet:kv_events_dropped_total{}"] == 0
        with pytest.raises(RuntimeError, match="Address already in use"):
            start_server(args, str(tmp_path / "second.log"))
