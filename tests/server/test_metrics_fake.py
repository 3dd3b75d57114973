"""vLLM metric names/types/labels, gauges under load and back to zero, 429 admission (fake engine)."""

import asyncio
import time

import httpx
import pytest

from kvfleet_server.api import ServerSettings, ServerState, build_app
from kvfleet_server.metrics import ServerMetrics, build_1_2_5_buckets

from server_fake_engine import FakeEngine
from server_fixtures import InProcessServer, check_exposition, metric, peak_gauges, scrape

def test_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_registries_are_per_server():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.admission_rejected("queue_full")
    assert b"queue_full" in a.render() and a.registry is not b.registry


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine(max_model_len=4096, max_num_seqs=2, step_delay=0.01)
    state = ServerState(ServerSettings(served_model_names=["fake"], max_queue_len=3), engine=engine)
    with InProcessServer(build_app(state)) as srv:
        yield srv


def test_exposition_names_types_labels(served):
    check_exposition(httpx.get(served.url + "/metrics").text, "fake")


def test_gauges_move_under_load_and_return_to_zero(served):
    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            reqs = [asyncio.create_task(c.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 40}))
                    for _ in range(5)]
            seen = await peak_gauges(served.url, reqs, period=0.05)
            return [t.result().status_code for t in reqs], seen

    codes, seen = asyncio.run(go())
    assert codes.count(200) >= 3
    assert seen["running"] == 2 and seen["usage"] > 0
    time.sleep(0.2)
    m = scrape(served.url)
    assert m["vllm:num_requests_running{}"] == 0 and m["vllm:num_requests_waiting{}"] == 0
    assert m["vllm:kv_cache_usage_perc{}"] == 0 and m["vllm:gpu_cache_usage_perc{}"] == 0
    assert m["kvfleet:kv_cache_blocks_free{}"] == m["kvfleet:kv_cache_blocks_total{}"] > 0
    assert m["vllm:generation_tokens_total{}"] >= 40 * codes.count(200)
    assert m["vllm:time_to_first_token_seconds_count{}"] >= codes.count(200)


def test_queue_full_is_429_with_retry_after(served):
    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            return await asyncio.gather(*[c.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 20})
                                          for _ in range(20)])

    before = metric(served.url, "vllm:admission_rejections_total", reason="queue_full")
    rs = asyncio.run(go())
    rejected = [r for r in rs if r.status_code == 429]
    assert rejected and all(r.headers["retry-after"] for r in rejected)
    assert rejected[0].json()["error"]["code"] == "queue_full"
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in rs if r.status_code == 200)
    assert {r.status_code for r in rs} == {200, 429}
    assert metric(served.url, "vllm:admission_rejections_total", reason="queue_full") - before == len(rejected)
