"""Shared fixtures for engine tests: tiny random-weight models saved as HF directories (fast), and the
real SmolLM2-135M-Instruct GGUF (module-scoped where used)."""

from __future__ import annotations

import os

import pytest
import torch

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


def _save_tiny(kind: str, out_dir: str, tok_dir: str, **overrides) -> str:
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    torch.manual_seed(1234)
    if kind == "llama":
        cfg = LlamaConfig(
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
            **common,
        )
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(tie_word_embeddings=True, rope_theta=10000.0, **common)
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init make logits less flat (fewer near-ties)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(out_dir, max_shard_size="1MB" if kind == "qwen2" else "100MB")
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), out_dir)
    return out_dir


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


@pytest.fixture
def spec_break_even_floor(monkeypatch):
    """Speculation mechanics tests: every method's acceptance cut-off at the n-gram floor (30 %), so that
    layer_skip and draft_model keep drafting on tiny models whose drafts cost about as much as the target
    (the cost-aware break-even would otherwise verify them only on rare probes)."""
    monkeypatch.setattr("kvfleet_server.spec_decode.proposer.break_even_acceptance", lambda cost, device: 0.0)
