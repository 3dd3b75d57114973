"""vLLM flags users copy from their deployments keep vLLM's meaning in a real kvfleet-server (tiny random-weight
Llama, subprocess on 127.0.0.1): served-name aliases, --chat-template, --max-logprobs, --root-path,
--allowed-origins, and the error shape (param = the field the request sent)."""

import httpx
import openai
import pytest

from server_fixtures import start_server

TEMPLATE = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}<<assistant>>"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("flags")
    (d / "chat.jinja").write_text(TEMPLATE)
    srv = start_server([tiny_llama_dir, "--served-model-name", "tiny", "tiny-alias", "--max-model-len", "512",
                        "--kv-cache-memory-bytes", "4000000", "--chat-template", str(d / "chat.jinja"),
                        "--max-logprobs", "30", "--root-path", "/llm", "--allowed-origins", '["https://chat.example"]',
                        "--trust-remote-code", "--disable-log-requests", "--enforce-eager", "--shutdown-timeout", "5"],
                       str(d / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


def test_served_model_name_aliases(server):
    ids = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert ids == ["tiny", "tiny-alias"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model="tiny-alias", prompt="hello", max_tokens=2)
    assert r.model == "tiny"  # vLLM reports the first served name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=server.url, prompt="hello", max_tokens=2)


def test_chat_template_flag_replaces_the_tokenizers(server):
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert "<<user>>hi<<assistant>>" in text.replace(" ", "")


def test_max_logprobs_sets_the_limit(server):
    ok = httpx.post(server.url + "/v1/completions",
                    json={"model": "tiny", "prompt": "hello", "max_tokens": 1, "logprobs": 30}).json()
    assert len(ok["choices"][0]["logprobs"]["top_logprobs"][0]) >= 30
    err = httpx.post(server.url + "/v1/chat/completions",
                     json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                           "logprobs": True, "top_logprobs": 31}).json()["error"]
    assert err["param"] == "top_logprobs" and "at most 30" in err["message"] and err["code"] == "invalid_value"


def test_param_names_the_field_sent(server):
    err = httpx.post(server.url + "/v1/chat/completions",
                     json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                           "max_completion_tokens": 5000}).json()["error"]
    assert err["param"] == "max_completion_tokens" and "max_completion_tokens" in err["message"], err
    assert isinstance(err["code"], str)


def test_root_path_and_cors(server):
    assert httpx.get(server.url + "/openapi.json").json()["servers"] == [{"url": "/llm"}]
    pre = httpx.options(server.url + "/v1/completions",
                        headers={"Origin": "https://chat.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://chat.example"
    other = httpx.options(server.url + "/v1/completions",
                          headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
