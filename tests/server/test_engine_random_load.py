"""Engine invariants under random load: random prompts sharing prefixes, n > 1, stop strings, aborts at
random steps, a small pool (preemption), chunked prefill and prefix caching on. After every step the
block reference counts match the live block tables; at the end every request finished exactly once and
every block is back in the pool."""

from __future__ import annotations

import random

import pytest

from kvfleet_server import SamplingParams

from engine_helpers import assert_all_blocks_free, assert_pool_consistent

BS = 4
PER_BLOCK = BS * 2 * 2 * 2 * 16 * 4  # bytes of one block of the tiny Llama (float32)


@pytest.mark.parametrize("seed, kv_cache_dtype", [(0, "auto"), (1, "auto"), (2, "auto"), (0, "fp8")])
def test_random_requests_and_aborts_leave_no_leak(tiny_engine_factory, seed, kv_cache_dtype):
    rng = random.Random(seed)
    ratio = 4 if kv_cache_dtype == "fp8" else 1  # fp8 blocks take a quarter of float32's bytes
    eng = tiny_engine_factory(block_size=BS, kv_cache_memory_bytes=20 * PER_BLOCK // ratio, max_num_batched_tokens=16,
                              max_num_seqs=6, enable_prefix_caching=True, kv_cache_dtype=kv_cache_dtype)
    assert eng.kv.num_blocks == 20
    shared = [rng.randrange(100, 40000) for _ in range(rng.randint(3, 13))]
    submitted, aborted, finished = set(), set(), {}
    next_id = preemptions = 0
    for step in range(400):
        if next_id < 30 and rng.random() < 0.5:
            rid = f"r{next_id}"
            next_id += 1
            prompt = (shared if rng.random() < 0.6 else []) + [rng.randrange(100, 40000)
                                                              for _ in range(rng.randint(1, 20))]
            n = rng.choice([1, 1, 2, 3])
            params = SamplingParams(n=n, temperature=0 if n == 1 and rng.random() < 0.5 else 0.9,
                                    seed=rng.randrange(1000), max_tokens=rng.randint(1, 16),
                                    stop=["e"] if rng.random() < 0.2 else None, ignore_eos=True)
            eng.add_request(rid, prompt, params, cache_salt=rng.choice([None, None, "tenant"]))
            submitted.add(rid)
        live = sorted(submitted - set(finished) - aborted)
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            eng.abort_request(victim)
            aborted.add(victim)
        for out in eng.step():
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} finished twice"
                finished[out.request_id] = out
        preemptions += eng.last_iteration.num_preemptions
        assert_pool_consistent(eng)
        if next_id >= 30 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    assert preemptions > 0 and aborted  # the load did reach the paths under test
    assert set(finished) == submitted
    for rid, out in finished.items():
        reasons = {c.finish_reason for c in out.outputs}
        assert reasons <= {"stop", "length", "abort"}, (rid, reasons)
        if rid not in aborted:
            assert "abort" not in reasons, rid
    assert_all_blocks_free(eng)
