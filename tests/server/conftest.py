"""Shared fixtures for engine tests: tiny random-weight models saved as HF directories (fast), and the
real SmolLM2-135M-Instruct GGUF (module-scoped where used)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tiny_models import _save_tiny

# One intra-op thread: the test machines are shared, and two OpenMP threads on an oversubscribed CPU
# spin-wait for each other (tests measure behaviour, never speed).
torch.set_num_threads(1)

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def gguf_path() -> str:
    from kvfleet_server.config import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory, gguf_path):
    """SmolLM2's tokenizer (built from the GGUF metadata) saved as tokenizer.json etc."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def smollm2_f32_dir(tmp_path_factory, gguf_path):
    """The bundled SmolLM2-135M-Instruct dequantized by transformers to a float32 safetensors directory."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    out = str(tmp_path_factory.mktemp("smollm2_f32"))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights are dequantized: a plain float32 checkpoint
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, os.path.join(out, "model.safetensors"))
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, hf_tokenizer_dir) -> str:
    """Random-weight LlamaForCausalLM (Llama-3.1 rope scaling, untied embeddings, GQA 4/2)."""
    return _save_tiny("llama", str(tmp_path_factory.mktemp("tiny_llama")), hf_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, hf_tokenizer_dir) -> str:
    """Random-weight Qwen2ForCausalLM (q/k/v biases, tied embeddings), saved in several shards."""
    return _save_tiny("qwen2", str(tmp_path_factory.mktemp("tiny_qwen2")), hf_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_llama_dir):
    """Build an LLMEngine on the tiny Llama with the given EngineConfig overrides."""
    from kvfleet_server import EngineConfig, LLMEngine

    def make(**kw):
        kw.setdefault("dtype", "float32")
        kw.setdefault("device", "cpu")
        kw.setdefault("kv_cache_memory_bytes", 4 << 20)
        return LLMEngine(EngineConfig(model=tiny_llama_dir, **kw))

    return make

