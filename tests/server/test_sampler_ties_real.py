"""Must-show 6 (issue 37): on the default server's bfloat16 activations (the bundled SmolLM2-135M-Instruct
GGUF, served packed, which is bfloat16 on every device), ``temperature 0`` and ``temperature 1, top_k 1``
give identical text on 21 varied prompts of 48 tokens. Exact ties between the top bfloat16 logits are
frequent; before top-k broke them by the lowest token id as argmax does, most of these prompts diverged.
Both runs use the same engine settings and batch, so their logits are the same bits."""

from __future__ import annotations

import pytest
import torch

from kvfleet_server import EngineConfig, LLMEngine, SamplingParams

from engine_helpers import assert_all_blocks_free, run_to_completion

pytestmark = pytest.mark.slow

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [CHAT.format(q) for q in (
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
    "List three uses of copper.", "Why is the sky blue?", "Give me a recipe for pancakes.",
    "Translate 'good morning' into Spanish and German.", "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.", "Write a limerick about a programmer.",
    "What causes earthquakes?", "Suggest a name for a bakery.", "How do vaccines work?",
)] + [
    "Once upon a time, in a small village, there lived", "The three primary colors are",
    "def fibonacci(n):\n    ", "1, 2, 3, 4, 5, 6, 7, 8,", "In 1492, Columbus", "The best way to learn a language is",
    "Dear hiring manager,", "Q: What is the boiling point of water?\nA:",
]


def _texts(gguf_path: str, params: list[SamplingParams]) -> list[str]:
    eng = LLMEngine(EngineConfig(model=gguf_path, device="cpu", kv_cache_memory_bytes=64 << 20, seed=0))
    assert eng.config.resolved_dtype() == torch.bfloat16  # the default server's activations
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        eng.add_request(f"r{i}", prompt, p)
    out = run_to_completion(eng)
    assert_all_blocks_free(eng)
    return [out[f"r{i}"].outputs[0].text for i in range(len(PROMPTS))]


def test_top_k_1_equals_greedy_in_bfloat16(gguf_path):
    assert len(PROMPTS) == 21
    common = dict(max_tokens=48, ignore_eos=True)
    greedy = _texts(gguf_path, [SamplingParams(temperature=0.0, **common)] * 21)
    top1 = _texts(gguf_path, [SamplingParams(temperature=1.0, top_k=1, seed=1000 + i, **common) for i in range(21)])
    diverged = [i for i in range(21) if greedy[i] != top1[i]]
    assert not diverged, [(PROMPTS[i], greedy[i], top1[i]) for i in diverged]
