"""OpenAI-shaped errors over a fake engine (in-process): 400 never 422, 404, 401, 429, content type."""

import pytest
from fastapi.testclient import TestClient

from kvfleet_server.api import ServerSettings, ServerState, build_app

from server_fake_engine import FakeEngine


def _client(**settings):
    state = ServerState(ServerSettings(served_model_names=["fake"], **settings), engine=FakeEngine())
    return TestClient(build_app(state), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client():
    with _client() as c:
        yield c


def _err(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["code"], str) and err["code"], err  # one shape: code is always a string
    return err


@pytest.mark.parametrize("body,param", [
    ({"model": "fake", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "fake", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "fake", "prompt": "x", "n": 0}, "n"),
    ({"model": "fake", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "fake", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "fake", "prompt": []}, "prompt"),
    ({"model": "fake", "prompt": [[1], []]}, "prompt"),
    ({"model": "fake", "prompt": [999999]}, "prompt"),
    ({"model": "fake", "prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ({"model": "fake"}, "prompt"),
    ({"model": "fake", "prompt": "x", "stop": [""]}, "stop"),
])
def test_invalid_completion_params_are_400_naming_the_field(client, body, param):
    err = _err(client.post("/v1/completions", json=body), 400)
    assert param in (err["param"] or "") or param in err["message"]


def test_not_supported_yet_is_400(client):
    err = _err(client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"1": 2.0}}), 400)
    assert "not supported yet" in err["message"]


@pytest.mark.parametrize("extra", [
                                   {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                                   {"prompt_logprobs": 1}, {"echo": True}, {"bad_words": ["x"]},
                                   {"use_beam_search": True}, {"allowed_token_ids": [1, 2]}])
def test_chat_features_not_built_are_refused(client, extra):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    err = _err(client.post("/v1/chat/completions", json=body), 400)
    assert "not supported yet" in err["message"]


def test_chat_template_refusal_is_400_with_template_message(client):
    err = _err(client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "s"}]}), 400)
    assert "user message" in err["message"]


def test_top_logprobs_without_logprobs_is_400(client):
    err = _err(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "s"}],
                                                        "top_logprobs": 2}), 400)
    assert err["param"] == "top_logprobs"


@pytest.mark.parametrize("content,headers", [
    (b"{not json", {"content-type": "application/json"}),
    (b"[1, 2]", {"content-type": "application/json"}),
    (b"", {"content-type": "application/json"}),
    (b'{"prompt": "x"}', {"content-type": "text/plain"}),
    (b'{"prompt": "x", "temperature": NaN}', {"content-type": "application/json"}),
])
def test_malformed_bodies_are_400(client, content, headers):
    err = _err(client.post("/v1/completions", content=content, headers=headers), 400)
    assert err["type"] == "invalid_request_error"


def test_content_type_message(client):
    err = _err(client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}), 400)
    assert "application/json" in err["message"]


def test_unknown_model_is_404(client):
    err = _err(client.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"
    _err(client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404)


def test_unknown_path_is_404_openai_shape(client):
    _err(client.get("/v1/nothing"), 404)


def test_api_key():
    with _client(api_key="sekret") as c:
        _err(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}), 401)
        _err(c.post("/v1/completions", content=b"{bad", headers={"authorization": "Bearer wrong"}), 401)
        _err(c.get("/v1/models"), 401)
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"authorization": "Bearer sekret"})
        assert r.status_code == 200, r.text


def test_tokenize_detokenize(client):
    r = client.post("/tokenize", json={"prompt": "hi"})
    assert r.json() == {"count": 2, "max_model_len": 256, "tokens": [104, 105]}
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    _err(client.post("/detokenize", json={"tokens": [-1]}), 400)
    _err(client.post("/tokenize", json={}), 400)


def test_models_and_version(client):
    data = client.get("/v1/models").json()["data"]
    assert data[0]["id"] == "fake" and data[0]["max_model_len"] == 256
    assert client.get("/version").json()["version"]


@pytest.mark.parametrize("raw,status,param", [
    (rb'{"model": "\ud800", "prompt": "x"}', 404, "model"),
    (rb'{"prompt": "x", "logit_bias": {"\ud800": "high"}}', 400, None),
    (rb'{"prompt": "x", "max_tokens": 1, "stop_token_ids": ["\udfff"]}', 400, "stop_token_ids.0"),
])
def test_lone_surrogates_echoed_in_errors_are_not_500(client, raw, status, param):
    # JSON may carry lone UTF-16 surrogates; an error message quoting them must still encode
    err = _err(client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), status)
    if param is not None:
        assert err["param"] == param
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("extra", [{"truncate_prompt_tokens": 3},
                                   {"logits_processors": ["x"]}, {"return_tokens_as_token_ids": True}])
def test_completion_features_not_built_are_refused(client, extra):
    # vLLM users send these; silently ignoring them would return unconstrained output as if they had applied
    err = _err(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **extra}), 400)
    assert "not supported yet" in err["message"] and next(iter(extra)) in err["message"]
    assert err["param"] == next(iter(extra)) and err["code"] == "unsupported_parameter"


def test_unbuilt_fields_at_their_defaults_are_accepted(client):
    body = {"prompt": "x", "max_tokens": 1, "use_beam_search": False, "guided_json": None, "bad_words": []}
    assert client.post("/v1/completions", json=body).status_code == 200
