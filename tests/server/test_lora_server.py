"""LoRA through real kvfleet-server processes and the official openai client (vLLM's API): adapters listed
with their parent and picked by ``model``, the runtime load/unload API (only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING), refusals in OpenAI's error shape, vllm:lora_requests_info, the prefix
cache isolating an adapter from a cache_salt of the same name, and a bad --lora-modules exiting 2."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from transformers import AutoConfig

from lora_helpers import make_adapter
from server_fixtures import build_tiny_llama, metric, openai_client, running_server, scrape

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_srv")
    model = build_tiny_llama(str(d / "model"))
    cfg = AutoConfig.from_pretrained(model)
    ads = {f"t{i}": make_adapter(str(d / f"t{i}"), cfg, r=4 * (i + 1), alpha=16, std=0.5, seed=i) for i in range(3)}
    return model, ads


@pytest.fixture(scope="module")
def server(model_and_adapters, tmp_path_factory):
    model, ads = model_and_adapters
    log = str(tmp_path_factory.mktemp("lora_srv_log") / "server.log")
    args = ["--model", model, "--dtype", "float32", "--served-model-name", "base", "--enable-lora",
            "--lora-modules", f"t0={ads['t0']}", "--max-loras", "2", "--max-lora-rank", "8",
            "--kv-cache-memory-bytes", str(16 << 20)]
    with running_server(args, log, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}) as srv:
        yield srv


def _complete(client, model: str, prompt: str = "Hello", **kw) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, **kw)


def test_adapters_are_listed_selected_loaded_and_unloaded(server, model_and_adapters):
    _, ads = model_and_adapters
    client = openai_client(server)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "t0"}
    assert models["t0"].parent == "base" and models["t0"].root == ads["t0"]
    base, t0 = _complete(client, "base"), _complete(client, "t0")
    assert t0.model == "t0" and t0.choices[0].text != base.choices[0].text
    chat = client.chat.completions.create(model="t0", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "t0"
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "t1")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"

    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "t1", "lora_path": ads["t1"]})
    assert r.status_code == 200 and "t1" in r.text
    assert {m.id for m in client.models.list().data} == {"base", "t0", "t1"}
    t1 = _complete(client, "t1")
    assert t1.model == "t1" and t1.choices[0].text not in (base.choices[0].text, t0.choices[0].text)
    assert _complete(client, "t0").choices[0].text == t0.choices[0].text  # unchanged by t1 beside it

    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "t1"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "t1")
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "t1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize("case, status, param, words", [
    ("rank", 400, "r", "r=12 exceeds --max-lora-rank 8"),
    ("missing", 404, "lora_path", "is not a directory"),
    ("taken", 400, "lora_name", "already been loaded"),
    ("base_name", 400, "lora_name", "base model"),
])
def test_bad_loads_are_refused_in_openai_shape(server, model_and_adapters, tmp_path, case, status, param, words):
    _, ads = model_and_adapters
    body = {"rank": {"lora_name": "big", "lora_path": ads["t2"]},
            "missing": {"lora_name": "x", "lora_path": str(tmp_path / "nowhere")},
            "taken": {"lora_name": "t0", "lora_path": ads["t1"]},
            "base_name": {"lora_name": "base", "lora_path": ads["t1"]}}[case]
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # nothing crashed
    assert _complete(openai_client(server), "t0").choices  # and the engine still serves


def test_lora_requests_info_names_the_running_adapter(server):
    client = openai_client(server)
    seen = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.extend(k for k in scrape(server.url) if k.startswith("vllm:lora_requests_info"))

    t = threading.Thread(target=watch)
    t.start()
    try:
        stream = client.completions.create(model="t0", prompt="Count:", max_tokens=300, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            pass
    finally:
        done.set()
        t.join()
    assert any("running_lora_adapters=t0" in k and "max_lora=2" in k for k in seen), set(seen)
    now = [k for k in scrape(server.url) if k.startswith("vllm:lora_requests_info")]
    assert len(now) == 1 and "running_lora_adapters=," in now[0]  # one series, the current one


def test_the_prefix_cache_keeps_an_adapter_and_a_same_named_salt_apart(server):
    client = openai_client(server)

    def hits_of(**kw) -> float:
        before = metric(server.url, "vllm:prefix_cache_hits_total")
        client.completions.create(prompt=PROMPT, max_tokens=1, temperature=0, **kw)
        return metric(server.url, "vllm:prefix_cache_hits_total") - before

    salt = {"cache_salt": "t0-isolation"}
    assert hits_of(model="t0", extra_body=salt) == 0
    assert hits_of(model="base", extra_body=salt) == 0  # same salt text, base model: no hit
    assert hits_of(model="t0", extra_body=salt) > 0  # the adapter's own blocks


def test_runtime_api_is_absent_without_the_switch_json_modules_name_their_parent_and_a_bad_adapter_exits_2(model_and_adapters, tmp_path):
    model, ads = model_and_adapters
    module = json.dumps({"name": "j", "path": ads["t0"], "base_model_name": "other-base"})
    with running_server(["--model", model, "--dtype", "float32", "--enable-lora", "--lora-modules", module],
                        str(tmp_path / "a.log")) as srv:
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "t0", "lora_path": ads["t0"]})
        assert r.status_code == 404
        cards = {m["id"]: m for m in httpx.get(srv.url + "/v1/models").json()["data"]}
        assert cards["j"]["parent"] == "other-base"  # vLLM's JSON form: base_model_name is the parent
    proc = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--model", model, "--dtype", "float32",
                           "--port", "0", "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                           f"big={ads['t2']}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"--lora-modules big={ads['t2']}: adapter 'big': r=12 exceeds --max-lora-rank 8" in proc.stderr
