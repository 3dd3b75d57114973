"""Tiny random-weight Llama / Qwen2 checkpoints saved as Hugging Face directories (imported as a plain
module: tests/server is on sys.path; not from conftest, whose module name another conftest can take)."""

from __future__ import annotations

import os

import torch


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
