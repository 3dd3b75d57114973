"""Must-show 5: ``kvfleet-server --quantization fp8 --kv-cache-dtype fp8`` on the bundled model serves
the official openai client; /metrics keeps every vLLM name, ``vllm:cache_config_info`` shows the fp8
KV dtype and the block count from the log; prompt scoring (echo + max_tokens 0 + logprobs) returns
the prompt's tokens with their logprobs and generates nothing. Also the server's resident memory on
the bundled model with the defaults (packed GGUF) and a 64 MiB KV pool."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import check_exposition, openai_client, running_server

pytestmark = pytest.mark.slow
KV_BYTES = "67108864"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", KV_BYTES,
                         "--max-model-len", "1024", "--shutdown-timeout", "5"],
                        str(tmp_path_factory.mktemp("fp8") / "server.log"), ready_timeout=240) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_fp8_server_serves_the_openai_client(server, client):
    chat = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=12,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    log = server.log()
    assert "weights: fp8" in log and "fp8 weight-only" in log
    assert "calibrated from the first prefill" in log
    m = re.search(r"KV cache: (\d+) blocks .*float8_e4m3fn", log)
    assert m, log
    text = httpx.get(server.url + "/metrics").text
    check_exposition(text, "smollm2")
    info = {f.name: f for f in text_string_to_metric_families(text)}["vllm:cache_config_info"].samples[0].labels
    assert info["kv_cache_dtype"] == "fp8" and info["num_gpu_blocks"] == m.group(1)
    # 64 MiB of e4m3 K+V: 30 layers × 3 kv heads × 64 dims × 2 × 1 byte = 11520 B/token → 364 blocks of 16
    assert int(m.group(1)) == int(KV_BYTES) // (11520 * 16)


def test_echo_max_tokens_0_scores_the_prompt(client):
    prompt = "The capital of France is Paris."
    r = client.completions.create(model="smollm2", prompt=prompt, echo=True, max_tokens=0, logprobs=1)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    lp = c.logprobs
    assert "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.top_logprobs) == len(lp.tokens)
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=0)


def _rss_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def test_default_server_resident_memory_on_the_bundled_model(tmp_path):
    """The bundled Q4_1 GGUF served packed (the default): RSS after a request ≤ 600 MB, issue 11's target
    (it was 960 MB with the weights dequantized to float32; 518 MB measured once the freed heap of the load
    is returned to the OS, ``kvfleet_server.memory``)."""
    with running_server(["--kv-cache-memory-bytes", KV_BYTES, "--shutdown-timeout", "5"], str(tmp_path / "s.log"),
                        ready_timeout=240) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "smollm2", "prompt": "Hello",
                                                          "max_tokens": 8}, timeout=120)
        assert r.status_code == 200
        mem = _rss_kib(srv.proc.pid)
        assert "weights: gguf" in srv.log()
        assert "freed heap returned to the OS" in srv.log()
        assert mem["VmRSS"] * 1024 <= 600e6, mem
