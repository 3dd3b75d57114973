"""Issue 7: automatic prefix caching — identical outputs on/off, eviction under pressure, salt isolation,
exact hit accounting including partial-block reuse."""

from __future__ import annotations

import random

from kvfleet_server import SamplingParams

from engine_helpers import assert_all_blocks_free, assert_pool_consistent, run_to_completion

BS = 4
PER_BLOCK = BS * 2 * 2 * 2 * 16 * 4


def _collect(eng, reqs, abort_after=None):
    """Submit (id, prompt, params, salt) in waves; abort some mid-way. Returns finals + hit totals."""
    hits = queries = 0
    eng.preemptions_seen = 0
    finals = {}
    for wave in reqs:
        for rid, prompt, p, salt in wave:
            eng.add_request(rid, prompt, p, cache_salt=salt)
        steps = 0
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    finals[o.request_id] = o
            it = eng.last_iteration
            hits += it.prefix_cache_hits
            queries += it.prefix_cache_queries
            eng.preemptions_seen += it.num_preemptions
            steps += 1
            if abort_after and steps == 3:
                eng.abort_request(abort_after)
            assert_pool_consistent(eng)
    assert_all_blocks_free(eng)
    return finals, hits, queries


def _mixed_workload():
    rng = random.Random(7)
    system = [rng.randrange(100, 40000) for _ in range(23)]
    other = [rng.randrange(100, 40000) for _ in range(9)]
    waves = []
    for w in range(3):
        wave = []
        for i in range(8):
            q = [rng.randrange(100, 40000) for _ in range(rng.randint(2, 12))]
            prefix = system if i % 3 else system[:13] + other
            n = 2 if i == 5 else 1
            p = SamplingParams(temperature=0 if n == 1 else 0.8, seed=11, n=n, max_tokens=rng.randint(3, 14),
                               ignore_eos=True)
            wave.append((f"w{w}r{i}", prefix + q, p, None))
        waves.append(wave)
    return waves


def test_same_tokens_with_caching_on_and_off(tiny_engine_factory):
    waves = _mixed_workload()
    outs = {}
    for caching in (False, True):
        eng = tiny_engine_factory(block_size=BS, enable_prefix_caching=caching, kv_cache_memory_bytes=40 * PER_BLOCK,
                                  max_num_batched_tokens=24)
        finals, hits, _ = _collect(eng, waves, abort_after="w1r7")
        assert eng.preemptions_seen > 0  # the 40-block pool forces preemption
        assert finals["w1r7"].outputs[0].finish_reason == "abort"
        outs[caching] = ({k: [c.token_ids for c in v.outputs] for k, v in finals.items()
                          if v.outputs[0].finish_reason != "abort"}, hits)
    assert outs[False][1] == 0 and outs[True][1] > 0
    assert outs[True][0] == outs[False][0]


def test_stop_string_and_preempted_requests_publish_only_computed_blocks(tiny_engine_factory):
    rng = random.Random(3)
    prompt = [rng.randrange(100, 40000) for _ in range(30)]
    eng = tiny_engine_factory(block_size=BS, kv_cache_memory_bytes=24 * PER_BLOCK, max_num_batched_tokens=16)
    base = run_to_completion_single(eng, "base", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop = base.outputs[0].text[5:8]
    stopped = run_to_completion_single(eng, "s", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                          stop=[stop]))
    assert stopped.outputs[0].finish_reason == "stop"
    again = run_to_completion_single(eng, "again", prompt, SamplingParams(temperature=0, max_tokens=20,
                                                                          ignore_eos=True))
    assert again.outputs[0].token_ids == base.outputs[0].token_ids
    assert again.num_cached_tokens == 29  # whole prompt but its last token


def run_to_completion_single(eng, rid, prompt, params):
    eng.add_request(rid, prompt, params)
    return run_to_completion(eng)[rid]


def test_eviction_under_pressure_keeps_hot_prefix(tiny_engine_factory):
    rng = random.Random(5)
    hot = [rng.randrange(100, 40000) for _ in range(16)]
    eng = tiny_engine_factory(block_size=BS, kv_cache_memory_bytes=20 * PER_BLOCK, max_num_batched_tokens=64)
    hot_hits = []
    for i in range(30):
        cold = [rng.randrange(100, 40000) for _ in range(24)]
        eng.add_request(f"cold{i}", cold, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        eng.add_request(f"hot{i}", hot + [i + 1000], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        finals = run_to_completion(eng)
        hot_hits.append(finals[f"hot{i}"].num_cached_tokens)
        assert_all_blocks_free(eng)
    assert eng.kv.pool.num_evictions > 0
    assert all(h == 16 for h in hot_hits[1:]), hot_hits


def test_salts_isolate_tenants(tiny_engine_factory):
    eng = tiny_engine_factory(block_size=BS)
    prompt = list(range(500, 530))
    p = SamplingParams(temperature=0, max_tokens=3)
    got = {}
    for rid, salt in [("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a"), ("n1", None), ("n2", None)]:
        eng.add_request(rid, prompt, p, cache_salt=salt)
        got[rid] = run_to_completion(eng)[rid].num_cached_tokens
    assert got == {"a1": 0, "b1": 0, "a2": 29, "n1": 0, "n2": 29}


def test_hit_accounting_with_partial_block_reuse(tiny_engine_factory):
    eng = tiny_engine_factory(block_size=BS, max_num_batched_tokens=64)
    first = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34, 41, 42, 43, 44]
    second = first[:10] + [99, 98, 97, 96, 95]  # shares 10 tokens: 2 full blocks + 2 slots of the third
    ref = tiny_engine_factory(block_size=BS, enable_prefix_caching=False)
    ref_out = run_to_completion_single(ref, "r", second, SamplingParams(temperature=0, max_tokens=6))
    run_to_completion_single(eng, "first", first, SamplingParams(temperature=0, max_tokens=2))
    eng.add_request("second", second, SamplingParams(temperature=0, max_tokens=6))
    out = None
    hits = queries = computed = 0
    while eng.has_unfinished():
        for o in eng.step():
            out = o
        hits += eng.last_iteration.prefix_cache_hits
        queries += eng.last_iteration.prefix_cache_queries
        computed += eng.last_iteration.num_prompt_tokens
    assert (hits, queries, computed) == (10, 15, 5)
    assert out.num_cached_tokens == 10
    assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids
    # block-only matching would reuse 8
    eng.scheduler.partial_block_matching = False
    eng.kv.pool.reset_prefix_cache()
    run_to_completion_single(eng, "first2", first, SamplingParams(temperature=0, max_tokens=2))
    assert run_to_completion_single(eng, "second2", second, SamplingParams(temperature=0, max_tokens=6)).num_cached_tokens == 8
    assert_all_blocks_free(eng)
