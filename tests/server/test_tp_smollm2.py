"""Must-show 1: the real SmolLM2-135M-Instruct (9 query heads, 3 KV heads) at TP = 3 on the CPU gives
the greedy tokens of TP = 1 on at least 15 of 16 prompts in float32, logprobs within 1e-4, through
preemption (a KV pool smaller than the batch needs) and prefix-cache hits (a shared 3-block preamble);
with n-gram speculation at TP = 3 too.

The float32 weights are transformers' dequantization of the bundled GGUF saved as safetensors (dense
float32 matmuls keep the test fast; conftest's ``smollm2_f32_dir``); the packed-GGUF path at TP = 3 is checked on fewer tokens below.
Ranks 1 and 2 are real worker processes (gloo), one intra-op thread each."""

from __future__ import annotations

import pytest

from kvfleet_server import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

PREAMBLE = ("You are a careful assistant who answers in one short sentence and never repeats the question. "
            "Think about the facts first, then answer plainly.\n")
QUESTIONS = ["What is the capital of France?", "Name a prime number above 50.", "Why is the sky blue?",
             "What do bees make?", "How many legs has a spider?", "What is water made of?",
             "Who wrote Hamlet?", "What is the largest planet?", "def add(a, b):", "1, 1, 2, 3, 5,",
             "Translate 'cat' to French.", "What melts ice?", "The quick brown fox", "Once upon a time",
             "What is 12 times 12?", "Describe autumn in five words."]
KV_BLOCKS = 40  # the 16 requests need ~96 blocks at once: the scheduler must preempt
BLOCK_BYTES_TP1 = 16 * 2 * 30 * 3 * 64 * 4  # 16 tokens × K+V × 30 layers × 3 KV heads × 64 × float32


def generate(model: str, tp: int, prompts: list[str], max_tokens: int, kv_blocks: int, spec: dict | None = None,
             counts: dict | None = None):
    """Greedy outputs, preemptions and prefix-cache hits; ``counts`` (if given) gets the drafts verified and
    accepted."""
    eng = LLMEngine(EngineConfig(model=model, tensor_parallel_size=tp, dtype="float32", device="cpu",
                                 kv_cache_memory_bytes=kv_blocks * BLOCK_BYTES_TP1 // tp, max_model_len=256,
                                 max_num_batched_tokens=256, num_threads=1, speculative_config=spec))
    try:
        assert eng.num_blocks == kv_blocks
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                       logprobs=1))
        outs, preemptions, hits = {}, 0, 0
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0]
            it = eng.last_iteration
            preemptions += it.num_preemptions
            hits += it.prefix_cache_hits
            if counts is not None:
                counts["draft_tokens"] = counts.get("draft_tokens", 0) + it.num_draft_tokens
                counts["accepted"] = counts.get("accepted", 0) + it.num_accepted_tokens
        return [outs[f"r{i}"] for i in range(len(prompts))], preemptions, hits
    finally:
        eng.shutdown()


def compare(ref, got):
    same = 0
    for a, b in zip(ref, got):
        n = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        same += n == len(a.token_ids)
        # logprobs of the chosen tokens up to the first difference (identical inputs so far)
        for k in range(n):
            t = a.token_ids[k]
            assert abs(a.logprobs[k][t].logprob - b.logprobs[k][t].logprob) <= 1e-4
    return same


def test_tp3_greedy_equals_tp1_through_preemption_and_prefix_hits(smollm2_f32_dir):
    prompts = [PREAMBLE + q for q in QUESTIONS]
    ref, pre1, hits1 = generate(smollm2_f32_dir, 1, prompts, 24, KV_BLOCKS)
    got, pre3, hits3 = generate(smollm2_f32_dir, 3, prompts, 24, KV_BLOCKS)
    assert pre1 > 0 and pre3 > 0, (pre1, pre3)
    assert hits1 > 0 and hits3 > 0, (hits1, hits3)
    assert compare(ref, got) >= 15


def test_tp3_on_the_packed_gguf_matches_tp1(gguf_path):
    """--quantization gguf (the bundled model's default): Q4_1/Q8_0 blocks are cut per rank, scales with them."""
    prompts = [PREAMBLE + q for q in QUESTIONS[:3]]
    ref, _, _ = generate(gguf_path, 1, prompts, 6, KV_BLOCKS)
    got, _, _ = generate(gguf_path, 3, prompts, 6, KV_BLOCKS)
    assert compare(ref, got) == 3


def test_tp3_ngram_speculation_gives_the_tokens_of_tp1_without_it(smollm2_f32_dir):
    """Prompt lookup at TP = 3: the drafts are verified in one pass on every rank (the verification rows'
    logits computed with the step) and the greedy tokens are TP = 1's without speculation."""
    passage = ("The harbor town of Westmere was founded in 1821 by fishermen from the northern coast. Its "
               "lighthouse, built of grey granite, still guides the ferries across the bay.")
    prompts = [f"<|im_start|>user\nRepeat this text word for word: {passage}<|im_end|>\n<|im_start|>assistant\n",
               PREAMBLE + QUESTIONS[9]]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    counts: dict = {}
    ref, _, _ = generate(smollm2_f32_dir, 1, prompts, 32, KV_BLOCKS)
    got, _, _ = generate(smollm2_f32_dir, 3, prompts, 32, KV_BLOCKS, spec, counts)
    assert counts["accepted"] > 10 and counts["accepted"] <= counts["draft_tokens"], counts
    assert compare(ref, got) == len(prompts)
