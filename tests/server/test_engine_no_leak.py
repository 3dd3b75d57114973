"""Must-show 3: every block returns to the pool after finish, abort mid-prefill, abort mid-decode,
preemption and n > 1; a live sequence never holds more than block_size - 1 unused slots."""

from __future__ import annotations

from kvfleet_server import SamplingParams

from engine_helpers import assert_all_blocks_free, assert_pool_consistent, run_to_completion

BS = 4


def _check_waste(engine):
    assert_pool_consistent(engine)
    for seq in engine.scheduler.running:
        table = engine.kv.block_tables.get(seq.seq_id, [])
        # blocks cover exactly the computed tokens: waste <= block_size - 1 slots
        assert len(table) * BS - seq.num_computed_tokens < BS, (len(table), seq.num_computed_tokens)


def test_finish_releases_blocks(tiny_engine_factory):
    eng = tiny_engine_factory(block_size=BS, max_num_batched_tokens=32)
    for i in range(6):
        eng.add_request(f"r{i}", list(range(10, 10 + 7 * i + 3)), SamplingParams(temperature=0, max_tokens=9))
    finals = run_to_completion(eng, on_step=_check_waste)
    assert len(finals) == 6 and all(f.outputs[0].finish_reason == "length" for f in finals.values())
    assert_all_blocks_free(eng)


def test_abort_mid_prefill_and_mid_decode(tiny_engine_factory):
    eng = tiny_engine_factory(block_size=BS, max_num_batched_tokens=8)
    eng.add_request("long", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=5))
    eng.add_request("dec", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50))
    eng.step()  # "long" has 8 of 40 prompt tokens computed
    long_seq = eng.requests["long"].seqs[0]
    assert 0 < long_seq.num_computed_tokens < 40
    eng.abort_request("long")
    outs = eng.step()
    ab = [o for o in outs if o.request_id == "long"]
    assert ab and ab[0].finished and ab[0].outputs[0].finish_reason == "abort"
    for _ in range(5):
        eng.step()
    dec = eng.requests["dec"].seqs[0]
    assert dec.num_output_tokens > 1  # decoding
    eng.abort_request(["dec", "unknown-id"])
    outs = eng.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "dec"] == ["abort"]
    assert not eng.has_unfinished()
    assert_all_blocks_free(eng)


def test_preemption_releases_and_resumes(tiny_engine_factory):
    # pool of 24 blocks × 4 tokens: 8 requests of 20 + 20 tokens cannot all stay resident
    eng = tiny_engine_factory(block_size=BS, kv_cache_memory_bytes=24 * BS * 2 * 2 * 2 * 16 * 4,
                              max_num_batched_tokens=64, enable_prefix_caching=False)
    assert eng.kv.num_blocks == 24
    preemptions = 0
    for i in range(8):
        eng.add_request(f"r{i}", list(range(200 + i, 220 + i)), SamplingParams(temperature=0, max_tokens=20))

    def on_step(e):
        nonlocal preemptions
        preemptions += e.last_iteration.num_preemptions
        _check_waste(e)

    finals = run_to_completion(eng, on_step=on_step)
    assert preemptions > 0
    assert all(len(f.outputs[0].token_ids) == 20 for f in finals.values())
    assert any(f.metrics.num_preemptions for f in finals.values())
    assert_all_blocks_free(eng)


def test_n_greater_than_one_shares_prompt_blocks(tiny_engine_factory):
    eng = tiny_engine_factory(block_size=BS, enable_prefix_caching=False)
    eng.add_request("n4", list(range(300, 318)), SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12))
    first = eng.step()  # prompt computed once, then forked into 4 samples
    seqs = eng.requests["n4"].seqs
    assert len(seqs) == 4
    tables = [eng.kv.block_tables[s.seq_id] for s in seqs]
    assert all(t[:4] == tables[0][:4] for t in tables)  # 4 full prompt blocks shared
    assert tables[0][0].ref_cnt == 4
    assert eng.num_free_blocks == eng.kv.num_blocks - 5  # 4 full + 1 partial block for 18 tokens
    finals = run_to_completion(eng, on_step=_check_waste, first_outputs=first)
    outs = finals["n4"].outputs
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 12 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # independent samples
    assert_all_blocks_free(eng)
