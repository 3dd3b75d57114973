"""kvfleet-server subprocess on a tiny random-weight Llama: client disconnect (must-show 2), metrics under
load (must-show 6), and the small endpoints, over real HTTP with the real engine."""

import asyncio
import time

import httpx
import openai
import pytest

from server_fixtures import check_exposition, peak_gauges, running_server, scrape

TINY_ARGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", "4000000", "--max-num-seqs", "8",
             "--served-model-name", "tiny", "--shutdown-timeout", "5"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with running_server(["--model", tiny_llama_dir, *TINY_ARGS], str(tmp_path_factory.mktemp("tiny") / "server.log")) as srv:
        yield srv


def _until(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _idle(m: dict) -> bool:
    return (m["vllm:num_requests_running{}"] == 0 and m["vllm:num_requests_waiting{}"] == 0
            and m["vllm:kv_cache_usage_perc{}"] == 0
            and m["kvfleet:kv_cache_blocks_free{}"] == m["kvfleet:kv_cache_blocks_total{}"] > 0)


def test_disconnect_mid_stream_frees_request_and_blocks(server):
    """Must-show 2: within a second of the disconnect the request is gone and every block is free."""
    body = {"model": "tiny", "prompt": "hello " * 50, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            while got < 5:
                if next(lines).startswith("data: {"):
                    got += 1
            m = scrape(server.url)
            assert m["vllm:num_requests_running{}"] == 1 and m["vllm:kv_cache_usage_perc{}"] > 0
        gone = time.monotonic()
    assert _until(lambda: _idle(scrape(server.url)), timeout=1.0 - (time.monotonic() - gone))
    assert scrape(server.url)['vllm:request_success_total{finished_reason=abort}'] >= 1


def test_disconnect_non_streaming_aborts(server):
    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            t = asyncio.create_task(c.post(server.url + "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900,
                "ignore_eos": True}))
            for _ in range(200):
                await asyncio.sleep(0.02)
                if scrape(server.url)["vllm:num_requests_running{}"] == 1:
                    break
            assert scrape(server.url)["vllm:num_requests_running{}"] == 1
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t

    asyncio.run(go())
    assert _until(lambda: _idle(scrape(server.url)), timeout=1.0)


def test_metrics_under_load_and_back_to_zero(server):
    """Must-show 6: exposition parses, holds every vLLM name, gauges move under load and return to 0."""
    check_exposition(httpx.get(server.url + "/metrics").text, "tiny")
    before = scrape(server.url)
    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            tasks = [asyncio.create_task(c.post(server.url + "/v1/completions", json={
                "model": "tiny", "prompt": f"request {i} " * 20, "max_tokens": 60, "ignore_eos": True}))
                for i in range(12)]
            peak = await peak_gauges(server.url, tasks, period=0.03)
            return [t.result() for t in tasks], peak

    rs, peak = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs)
    assert peak["running"] >= 2 and peak["usage"] > 0
    assert _until(lambda: _idle(scrape(server.url)), timeout=2.0)
    after = scrape(server.url)
    assert after["vllm:generation_tokens_total{}"] - before["vllm:generation_tokens_total{}"] == 12 * 60
    prompt_tokens = sum(r.json()["usage"]["prompt_tokens"] for r in rs)
    assert after["vllm:prompt_tokens_total{}"] - before["vllm:prompt_tokens_total{}"] == prompt_tokens  # whole prompts
    assert (after["vllm:request_success_total{finished_reason=length}"]
            - before["vllm:request_success_total{finished_reason=length}"]) == 12
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_time_per_output_token_seconds",
              "vllm:time_per_output_token_seconds", "vllm:request_generation_tokens"):
        assert after[h + "_count{}"] - before.get(h + "_count{}", 0) == 12, h
    assert after["vllm:inter_token_latency_seconds_count{}"] > before["vllm:inter_token_latency_seconds_count{}"]
    assert after["vllm:iteration_tokens_total_count{}"] > before["vllm:iteration_tokens_total_count{}"]


def test_prefix_cache_counters(server):
    before = scrape(server.url)
    prompt = "a shared system prompt for every tenant " * 8
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200
    after = scrape(server.url)
    assert after["vllm:prefix_cache_queries_total{}"] > before["vllm:prefix_cache_queries_total{}"]
    assert after["vllm:prefix_cache_hits_total{}"] - before["vllm:prefix_cache_hits_total{}"] >= 16


def test_chat_template_refusal_and_errors_with_openai_client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "s"},
                                                          {"role": "user", "content": "u"}], max_tokens=2)
    assert "System role not supported" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=5000)
    assert "max_model_len" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt=[10**9], max_tokens=1)


def test_health_tokenize_version(server):
    assert httpx.get(server.url + "/health").status_code == 200
    toks = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) and toks["max_model_len"] == 1024
    assert httpx.post(server.url + "/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"].endswith("Hello world")
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    assert httpx.get(server.url + "/version").json()["version"]
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"} <= set(spec["paths"])


def test_max_tokens_absent_means_up_to_context_limit(server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "x " * 1000}).json()["tokens"][:1000]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ids, "ignore_eos": True}, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 1024 - 1000 and r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_prompt_logprobs_are_returned(server, stream):
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) {token_id: {logprob, rank, decoded_token}}."""
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there my friend"}).json()["tokens"]
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "prompt_logprobs": 1, "n": 2, "temperature": 0.5,
            "stream": stream}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        import json
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        choices = [c for ch in chunks for c in ch["choices"] if c.get("prompt_logprobs") is not None]
    else:
        choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1]
    for c in choices:
        pl = c["prompt_logprobs"]
        assert len(pl) == len(ids) and pl[0] is None
        for tid, pos in zip(ids[1:], pl[1:]):
            assert str(tid) in pos and 1 <= len(pos) <= 2  # the prompt token plus the top-1
            assert all(v["logprob"] <= 0 and v["rank"] >= 1 and "decoded_token" in v for v in pos.values())


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_text_offsets_never_go_back(server, stream):
    """Prompt tokens that split a character (emoji) decode to more characters than the prompt has; the
    generated tokens' text_offset must continue after the prompt tokens', never jump back (as in vLLM)."""
    import json
    body = {"model": "tiny", "prompt": "😀🇫🇷日本語 ok", "max_tokens": 4, "logprobs": 1, "echo": True,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        offsets, tokens = [], []
        for ch in chunks:
            for c in ch["choices"]:
                if c.get("logprobs"):
                    offsets += c["logprobs"]["text_offset"]
                    tokens += c["logprobs"]["tokens"]
    else:
        lp = r.json()["choices"][0]["logprobs"]
        offsets, tokens = lp["text_offset"], lp["tokens"]
    assert len(offsets) == len(tokens) > 4
    assert offsets == sorted(offsets), offsets
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], tokens)), (offsets, tokens)
