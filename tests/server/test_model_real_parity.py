"""Must-show 1: kvfleet vs Hugging Face transformers on the real SmolLM2-135M-Instruct GGUF
(float32, greedy, 64 new tokens, ignore_eos ⇔ transformers' eos_token_id=-1)."""

from __future__ import annotations

import os

import pytest
import torch

from kvfleet_server import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter "
    "and his three daughters. Every morning he walked into the forest",
    "1, 2, 3, 4,",
    "Q: What is the boiling point of water at sea level?\nA:",
    "<|im_start|>user\nWrite a haiku about autumn leaves.<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "import numpy as np\n\n# compute the mean of a list\ndef mean(xs):",
    "Translate to French: 'Good morning, how are you today?'\n",
    "In 1969, Neil Armstrong",
    "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n<|im_start|>user\nExplain what a hash table "
    "is, what its average lookup cost is, and name two ways to resolve collisions.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
    "Dear team,\n\nI wanted to share a quick update on the project timeline. As of this week, we have "
    "completed the design review, the first prototype is running in the lab, and",
    "A list of fruits: apple, banana,",
    "The quick brown fox",
    "Machine learning models are trained by minimizing a loss function. The most common optimizer is",
]


@pytest.fixture(scope="module")
def hf_reference(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            # explicit all-ones mask: without it transformers masks every prompt token equal to
            # pad_token_id (2 = <|im_end|> here), which changes the chat prompts' logits
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                               eos_token_id=-1, pad_token_id=2)
            refs.append((ids[0].tolist(), g[0, ids.shape[1]:].tolist()))
    return refs


def test_greedy_matches_transformers_on_real_gguf(hf_reference):
    llm = LLM("smollm2", dtype="float32", device="cpu", max_num_batched_tokens=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    identical = 0
    for (ref_prompt, ref_out), o in zip(hf_reference, outs):
        assert o.prompt_token_ids == ref_prompt  # same tokenizer
        got = o.outputs[0].token_ids
        assert len(got) == 64 and o.outputs[0].finish_reason == "length"
        assert got[:32] == ref_out[:32]
        identical += got == ref_out
    assert identical >= 15, f"only {identical}/16 sequences identical"
