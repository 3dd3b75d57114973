"""Must-show 2: 48 requests of mixed lengths submitted together, with chunked prefill (small
max_num_batched_tokens) and a pool small enough to force preemption, give the same greedy tokens as
each request run alone (a divergence is only tolerated at a float rounding tie: top-2 logits within 1e-4)."""

from __future__ import annotations

import random

from kvfleet_server import SamplingParams

from engine_helpers import assert_all_blocks_free, run_to_completion

BS = 4
PER_BLOCK_BYTES = BS * 2 * 2 * 2 * 16 * 4  # tokens × (K,V) × layers × kv_heads × head_dim × fp32


def _workload():
    rng = random.Random(0)
    reqs = []
    for i in range(48):
        plen = rng.randint(3, 60)
        reqs.append((f"r{i}", [rng.randrange(100, 40000) for _ in range(plen)], rng.randint(4, 24)))
    return reqs


def test_batched_equals_alone_with_chunked_prefill_and_preemption(tiny_engine_factory):
    work = _workload()
    alone_eng = tiny_engine_factory(block_size=BS, enable_prefix_caching=False)
    alone = {}
    for rid, prompt, mt in work:
        alone_eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True, logprobs=2))
        alone.update(run_to_completion(alone_eng))

    eng = tiny_engine_factory(block_size=BS, kv_cache_memory_bytes=60 * PER_BLOCK_BYTES, max_num_batched_tokens=48,
                              max_num_seqs=32, enable_prefix_caching=False)
    assert eng.kv.num_blocks == 60
    for rid, prompt, mt in work:
        eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True))
    stats = {"preempt": 0, "mixed": 0}

    def on_step(e):
        stats["preempt"] += e.last_iteration.num_preemptions
        it = e.last_iteration
        stats["mixed"] += bool(it.num_prompt_tokens and it.num_generation_tokens)

    batched = run_to_completion(eng, on_step=on_step)
    assert stats["preempt"] > 0, "the small pool should have forced preemption"
    assert stats["mixed"] > 0, "decodes and prefill chunks should share steps"
    assert_all_blocks_free(eng)

    mismatches = []
    for rid, _, mt in work:
        a, b = alone[rid].outputs[0], batched[rid].outputs[0]
        assert len(b.token_ids) == mt
        if a.token_ids != b.token_ids:
            k = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            top2 = sorted((lp.logprob for lp in a.logprobs[k].values()), reverse=True)[:2]
            mismatches.append((rid, k, top2[0] - top2[1]))
    assert len(mismatches) <= 2, mismatches
    assert all(gap < 1e-4 for _, _, gap in mismatches), mismatches
