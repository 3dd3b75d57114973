"""Integration: the scraper and the policy against two real ``kvfleet-server`` processes on
127.0.0.1 serving a tiny random-weight Llama. A load generator fills their queues; the
recommendation rises; after the load stops and a test-shortened scale-down window passes, the
decision returns to minReplicas."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvfleet_operator.autoscale import AutoscalingPolicy, History, PodObservation, decide
from kvfleet_operator.scrape import ScrapeTarget, scrape_all

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer, 64-wide random Llama with SmolLM2's tokenizer, saved as a HF directory."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvfleet_server.config import bundled_model_path

    out = str(tmp_path_factory.mktemp("tiny_llama_autoscale"))
    gguf = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir, tmp_path_factory):
    """Two kvfleet-server processes (2 sequences at a time each, so requests queue)."""
    logs = tmp_path_factory.mktemp("server_logs")
    procs = []
    try:
        for i in range(2):
            port = _free_port()
            log = open(logs / f"server{i}.log", "w")
            cmd = [sys.executable, "-m", "kvfleet_server.cli", "--model", tiny_model_dir,
                   "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                   "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
                   "--max-num-seqs", "2", "--disable-uvicorn-access-log"]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            procs.append((proc, port, logs / f"server{i}.log"))
        for proc, port, log in procs:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"kvfleet-server exited {proc.returncode}:\n{log.read_text()}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"kvfleet-server not ready:\n{log.read_text()}")
                time.sleep(0.2)
        yield [f"http://127.0.0.1:{port}" for _, port, _ in procs]
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _, _ in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _generate(client: httpx.AsyncClient, base: str) -> None:
    try:
        await client.post(f"{base}/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200,
                                "ignore_eos": True, "temperature": 0})
    except httpx.HTTPError:
        pass  # cancelled at the end of the test


async def _observe(targets: list[ScrapeTarget]) -> list[PodObservation]:
    results = await scrape_all(targets, timeout=2.0)
    return [PodObservation(r.name, ready=True, age_seconds=3600, metrics=r.metrics) for r in results]


async def test_recommendation_rises_under_load_and_returns_to_min(two_servers):
    window = 2.0
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=8, scale_down_stabilization_seconds=window,
                               metrics_interval_seconds=0.2)
    targets = [ScrapeTarget(f"pod{i}", f"{u}/metrics") for i, u in enumerate(two_servers)]
    history, current = History(), 2

    # Idle: the metrics are read (not missing) and nothing asks for more than 2.
    pods = await _observe(targets)
    assert all(p.metrics is not None and p.metrics.num_requests_waiting == 0 for p in pods)
    d = decide(policy, current, pods, history, time.monotonic())
    history = d.history
    assert d.desired_replicas <= 2

    # Load: 12 long requests per server, 2 run at a time -> ~10 waiting on each.
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        load = [asyncio.create_task(_generate(client, base)) for base in two_servers for _ in range(12)]
        peak = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pods = await _observe(targets)
            decided_at = time.monotonic()
            d = decide(policy, current, pods, history, decided_at)
            history, current = d.history, d.desired_replicas
            if d.changed and d.direction == "up":
                peak = d
                break
            await asyncio.sleep(policy.metrics_interval_seconds)
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    assert peak is not None, "the recommendation never rose under load"
    assert peak.desired_replicas > 2 and peak.recommendation > 2
    assert peak.code == "QueueLengthHigh" and "waiting requests" in peak.reason
    scaled_up_at = decided_at  # the high recommendation's own time stamp

    # Load stopped (requests aborted): the queues drain; after the window, back to minReplicas.
    final = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pods = await _observe(targets)
        now = time.monotonic()
        d = decide(policy, current, pods, history, now)
        history = d.history
        if d.direction == "down":
            # Never before a full window after the last high recommendation.
            assert now - scaled_up_at >= window
        current = d.desired_replicas
        if current == policy.min_replicas:
            final = d
            break
        await asyncio.sleep(policy.metrics_interval_seconds)
    assert final is not None, f"never returned to minReplicas (at {current}: {d.reason})"
    assert final.code == "LoadLow"
    assert all(p.metrics is not None and p.metrics.num_requests_waiting == 0 for p in pods)
