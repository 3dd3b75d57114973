"""Client disconnects abort the engine request (fake engine, real uvicorn in a thread)."""

import asyncio
import json
import time

import httpx
import pytest

from kvfleet_server.api import ServerSettings, ServerState, build_app

from server_fake_engine import FakeEngine
from server_fixtures import InProcessServer, metric


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine(max_model_len=4096, step_delay=0.02)
    state = ServerState(ServerSettings(served_model_names=["fake"]), engine=engine)
    with InProcessServer(build_app(state)) as srv:
        yield srv, engine


def _wait(pred, timeout=2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_stream_disconnect_aborts(served):
    srv, engine = served
    body = {"prompt": "x", "max_tokens": 3000, "stream": True}
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            it = r.iter_lines()
            got = [json.loads(l[6:]) for l in (next(it) for _ in range(6)) if l.startswith("data: {")]
            assert got
            assert metric(srv.url, "vllm:num_requests_running") == 1
    rid = got[0]["id"]
    assert _wait(lambda: any(a.startswith(rid) for a in engine.aborted))
    assert _wait(lambda: metric(srv.url, "vllm:num_requests_running") == 0)
    assert metric(srv.url, "vllm:kv_cache_usage_perc") == 0
    assert metric(srv.url, "vllm:request_success_total", finished_reason="abort") >= 1


def test_non_stream_disconnect_aborts(served):
    srv, engine = served
    before = len(engine.aborted)

    async def go():
        async with httpx.AsyncClient(timeout=10) as c:
            task = asyncio.create_task(c.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3000}))
            await asyncio.sleep(0.5)
            assert metric(srv.url, "vllm:num_requests_running") == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert _wait(lambda: len(engine.aborted) > before)
    assert _wait(lambda: metric(srv.url, "vllm:num_requests_running") == 0)
