"""HTTP-layer behaviour over a fake engine (in-process, fast): shapes, errors, streaming framing."""

import json

import pytest
from fastapi.testclient import TestClient

from kvfleet_server.api import ServerSettings, ServerState, build_app

from server_fake_engine import FakeEngine


@pytest.fixture()
def client():
    state = ServerState(ServerSettings(served_model_names=["fake"]), engine=FakeEngine())
    with TestClient(build_app(state)) as c:
        yield c


def test_completion_roundtrip(client):
    r = client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "hello"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


def test_stream_chat(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        lines = [l for l in r.iter_lines() if l]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[6:]) for l in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "hello"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_health_is_503_while_loading_then_200():
    import threading
    import time

    release = threading.Event()

    def factory():
        release.wait(10)
        return FakeEngine()

    state = ServerState(ServerSettings(served_model_names=["fake"]), engine_factory=factory)
    with TestClient(build_app(state)) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading" and r.headers["retry-after"]
        # clients that poll /v1/models for readiness must not see a card with a made-up max_model_len
        r = c.get("/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        release.set()
        deadline = time.monotonic() + 10
        while c.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == FakeEngine().max_model_len


def test_engine_failure_turns_health_503_and_requests_503():
    engine = FakeEngine()

    def broken_step():
        raise RuntimeError("boom")

    state = ServerState(ServerSettings(served_model_names=["fake"]), engine=engine)
    with TestClient(build_app(state)) as c:
        engine.step = broken_step
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 503
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503


def test_n_and_multiple_prompts_and_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 3, "logprobs": 1,
                                             "echo": True}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in r["choices"]] == ["ahel", "ahel", "bhel", "bhel"]
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "e", "l"] and lp["text_offset"] == [1, 2, 3]
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 12, "total_tokens": 14}


def test_requests_queued_when_the_engine_dies_get_503_not_a_hang():
    import threading

    engine = FakeEngine(step_delay=0.05)
    state = ServerState(ServerSettings(served_model_names=["fake"]), engine=engine)
    entered = threading.Event()

    def dying_step():
        entered.set()
        import time
        time.sleep(0.3)  # adds queue up meanwhile
        raise RuntimeError("boom")

    with TestClient(build_app(state)) as c:
        first = threading.Thread(target=lambda: c.post("/v1/completions", json={"prompt": "x", "max_tokens": 50}))
        engine.step = dying_step
        first.start()
        entered.wait(5)
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            c.post("/v1/completions", json={"prompt": "y", "max_tokens": 2}).status_code)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads + [first]:
            t.join(15)
        assert results == [503, 503, 503]


def test_stream_chat_logprobs_and_n(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True, "n": 2,
            "logprobs": True, "top_logprobs": 2}) as r:
        chunks = [json.loads(l[6:]) for l in r.iter_lines() if l.startswith("data: {")]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    content = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert len(content) == 6
    for ch in content:
        (entry,) = ch["logprobs"]["content"]
        assert entry["token"] == ch["delta"]["content"] and len(entry["top_logprobs"]) == 2
    assert all("usage" not in c for c in chunks)  # include_usage not asked


def test_stream_completion_usage(client):
    with client.stream("POST", "/v1/completions", json={
            "prompt": "x", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(l[6:]) for l in r.iter_lines() if l.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "hello wo"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["prompt_tokens"] == 1 and all(c["usage"] is None for c in chunks[:-1])
