"""Must-show 1b: random-weight LlamaForCausalLM (Llama-3.1 rope scaling) and Qwen2ForCausalLM built with
transformers, saved as safetensors directories, load through kvfleet and match transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvfleet_server import LLM, SamplingParams
from kvfleet_server.model.loader import load_model
from kvfleet_server.sequence import Request, ScheduledSeq, Sequence
from kvfleet_server.engine.kv_cache import KVCacheManager
from kvfleet_server.executor.model_runner import ModelRunner
from kvfleet_server.attention import TorchAttentionBackend

PROMPT = [5, 17, 923, 4410, 88, 12000, 301, 7, 7, 9, 45000, 1234, 16, 2048, 99, 3, 600, 42, 420, 4242,
          31, 8, 77, 1500, 9000, 3, 3, 3, 123, 456, 789, 1011, 1213, 1415, 17, 18, 19]


def kvfleet_logits(model_dir: str, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position, computing the prompt in the given chunk sizes over a paged cache."""
    model, cfg = load_model(model_dir, torch.float32, "cpu", max_positions=1024)
    kv = KVCacheManager(num_blocks=64, block_size=4)
    runner = ModelRunner(model, 64, 4, "cpu", torch.float32, TorchAttentionBackend())
    req = Request("r", None, ids, SamplingParams(), 0.0, 1)
    seq = Sequence(req, 0, ids, None)
    out = []
    for n in chunks:
        kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, n)
        batch = runner.execute([ScheduledSeq(seq, n).span(kv.block_ids(seq.seq_id))])
        out.append(runner.compute_logits(batch))
        seq.num_computed_tokens += n
    return torch.cat(out)


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_logits_match_transformers(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    with torch.no_grad():
        ref = hf_model(model_dir)(torch.tensor([PROMPT])).logits[0]
    # one prefill; then chunked prefill + single-token decodes through the block table
    for chunks in ([len(PROMPT)], [10, 7, 1, 1, 13] + [1] * (len(PROMPT) - 32)):
        ours = kvfleet_logits(model_dir, PROMPT, chunks)
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_greedy_tokens_match_transformers(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    prompts = [PROMPT[:11], PROMPT, PROMPT[5:30]]
    hf = hf_model(model_dir)
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                            eos_token_id=-1, pad_token_id=0)
            refs.append(g[0, len(p):].tolist())
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_llama3_rope_scaling_is_read(tiny_llama_dir):
    from kvfleet_server.model.hf_reader import read_hf_config

    cfg = read_hf_config(tiny_llama_dir)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert cfg.rope_theta == 500000.0 and not cfg.tie_word_embeddings


def test_qwen2_is_sharded_and_biased(tiny_qwen2_dir):
    assert os.path.exists(os.path.join(tiny_qwen2_dir, "model.safetensors.index.json"))
    model, cfg = load_model(tiny_qwen2_dir, torch.float32, "cpu")
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias and cfg.tie_word_embeddings
    assert model.layers[0].qkv_proj.bias is not None
