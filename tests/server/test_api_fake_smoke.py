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
