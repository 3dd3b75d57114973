"""Must-show 4 (issue 37): ``--generation-config auto|vllm|PATH`` with vLLM's meaning and default.

A tiny model directory whose generation_config.json sets ``top_k: 1`` (and ``max_new_tokens``): two
requests that differ only in seed are identical by default and with ``auto`` (top-k 1 is argmax), and
differ with ``vllm`` (the file is ignored: plain temperature-1 sampling); a field the request sets wins
over the file; through the offline LLM API and the real server with the official openai client."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import openai
import pytest

from kvfleet_server import LLM
from kvfleet_server.config import EngineConfig
from kvfleet_server.generation_config import GenerationDefaults, read_generation_defaults

from server_fixtures import running_server

PROMPT = "hello there, how are"
MAX_NEW = 7


@pytest.fixture(scope="module")
def gc_model_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """The tiny Llama with a generation_config.json recommending top_k 1 and max_new_tokens 7."""
    d = tmp_path_factory.mktemp("gc") / "model"
    shutil.copytree(tiny_llama_dir, d)
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "top_k": 1, "temperature": 0.9, "max_new_tokens": MAX_NEW}))
    return str(d)


def _llm(model_dir: str, **kw) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20, **kw)


def _texts(llm: LLM, **fields) -> list[str]:
    """Output of two requests that differ only in seed (fields on top of the defaults)."""
    params = [llm.get_default_sampling_params(seed=s, ignore_eos=True, **fields) for s in (1, 2)]
    return [o.outputs[0].text for o in llm.generate([PROMPT, PROMPT], params)]


def test_reading_auto_vllm_and_path(gc_model_dir, tiny_llama_dir):
    auto = read_generation_defaults("auto", gc_model_dir)
    assert auto.params == {"temperature": 0.9, "top_k": 1} and auto.max_tokens == MAX_NEW
    assert not auto.cap_max_tokens and auto.resolve_max_tokens(None) == MAX_NEW and auto.resolve_max_tokens(50) == 50
    assert read_generation_defaults("vllm", gc_model_dir) == GenerationDefaults()
    path = read_generation_defaults(gc_model_dir, tiny_llama_dir)  # PATH: that directory's file, a cap
    assert path.params == auto.params and path.resolve_max_tokens(50) == MAX_NEW
    assert read_generation_defaults("auto", tiny_llama_dir).params == {}  # no sampling keys: vLLM's
    with pytest.raises(ValueError, match="--generation-config"):
        EngineConfig(model=tiny_llama_dir, generation_config=tiny_llama_dir + "/nowhere")


def test_gguf_metadata(gguf_path, monkeypatch):
    assert read_generation_defaults("auto", gguf_path).params == {}  # the bundled GGUF has no general.sampling.*
    field = lambda v: SimpleNamespace(contents=lambda: v)  # noqa: E731
    reader = SimpleNamespace(fields={"general.sampling.top_k": field(40), "general.sampling.temp": field(0.6),
                                     "general.sampling.penalty_repeat": field(1.1), "general.name": field("x")})
    got = read_generation_defaults("auto", gguf_path, reader)
    assert got.params == {"top_k": 40, "temperature": 0.6, "repetition_penalty": pytest.approx(1.1)}


def test_default_and_auto_apply_the_file_vllm_ignores_it(gc_model_dir):
    for llm in (_llm(gc_model_dir), _llm(gc_model_dir, generation_config="auto")):
        a, b = _texts(llm)
        assert a == b  # top_k 1 from the file: the seed does not matter
        out = llm.generate(PROMPT, llm.get_default_sampling_params(ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == MAX_NEW  # max_new_tokens is the default max_tokens
        a, b = _texts(llm, top_k=0)  # a field the request sets wins over the file
        assert a != b
        assert len(llm.generate(PROMPT, llm.get_default_sampling_params(max_tokens=12, ignore_eos=True))[0]
                   .outputs[0].token_ids) == 12
    vllm = _llm(gc_model_dir, generation_config="vllm")
    a, b = _texts(vllm)
    assert a != b and vllm.get_default_sampling_params().top_k == 0


def test_path_caps_max_tokens(gc_model_dir, tiny_llama_dir):
    llm = _llm(tiny_llama_dir, generation_config=gc_model_dir)
    a, b = _texts(llm, max_tokens=12)
    assert a == b
    assert len(llm.generate(PROMPT, llm.get_default_sampling_params(max_tokens=12, ignore_eos=True))[0]
               .outputs[0].token_ids) == MAX_NEW


def test_server_applies_and_logs_the_defaults(gc_model_dir, tmp_path):
    """The real server (default flags: auto) with the official openai client; its log names the defaults."""
    log = str(tmp_path / "server.log")
    with running_server(["--model", gc_model_dir, "--max-model-len", "256", "--kv-cache-memory-bytes", "4000000",
                         "--served-model-name", "tiny", "--shutdown-timeout", "5"], log) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def complete(seed: int, **extra) -> tuple[str, int]:
            r = client.completions.create(model="tiny", prompt=PROMPT, seed=seed, extra_body={"ignore_eos": True,
                                          **extra})
            return r.choices[0].text, r.usage.completion_tokens

        (a, na), (b, nb) = complete(1), complete(2)
        assert a == b and na == nb == MAX_NEW
        (a, _), (b, _) = complete(1, top_k=0), complete(2, top_k=0)
        assert a != b
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], seed=3,
                                           max_tokens=10, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 10  # an explicit max_tokens beats max_new_tokens under auto
        log_text = srv.log()
    assert "request defaults: {'temperature': 0.9, 'top_k': 1, 'max_tokens': 7}" in log_text, log_text
