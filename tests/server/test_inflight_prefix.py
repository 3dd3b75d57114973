"""Requests that arrive together and share a prefix that is not cached yet compute it once.

The scheduler defers a waiting request whose first uncached full block is being computed by a running
one (SGLang's in-batch prefix caching). Tiny random-weight Llama, block size 4, greedy.
"""

from __future__ import annotations

import pytest

from kvfleet_server import LLM, SamplingParams

from engine_helpers import assert_all_blocks_free, run_to_completion

PREFIX = [(37 * i) % 30000 + 100 for i in range(40)]  # 10 full blocks of 4
SUFFIXES = [[501, 502, 503], [601, 602, 603], [701, 702, 703], [801, 802, 803]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make(tiny_llama_dir, **kw):
    kw.setdefault("max_num_batched_tokens", 256)
    return LLM(tiny_llama_dir, dtype="float32", device="cpu", block_size=4, kv_cache_memory_bytes=4 << 20, **kw)


@pytest.fixture(scope="module")
def solo(tiny_llama_dir):
    """Each prompt alone, with prefix caching off: the reference tokens."""
    llm = make(tiny_llama_dir, enable_prefix_caching=False)
    return [llm.generate([PREFIX + s], GREEDY)[0].outputs[0].token_ids for s in SUFFIXES]


def test_a_shared_uncached_prefix_is_computed_once(tiny_llama_dir, solo):
    eng = make(tiny_llama_dir).engine
    for i, s in enumerate(SUFFIXES):
        eng.add_request(f"r{i}", PREFIX + s, GREEDY)
    first = eng.step()
    it = eng.last_iteration
    assert it.num_prompt_tokens == len(PREFIX) + 3  # only r0 ran: the others wait for its blocks
    assert eng.get_stats().num_waiting == 3 and [o.request_id for o in first] == ["r0"]
    second = eng.step()
    it = eng.last_iteration
    assert it.prefix_cache_hits == 3 * len(PREFIX) and it.num_prompt_tokens == 3 * 3
    finals = run_to_completion(eng, first_outputs=first + second)
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(4)] == solo
    assert_all_blocks_free(eng)


def test_without_prefix_caching_or_a_shared_prefix_nothing_waits(tiny_llama_dir):
    eng = make(tiny_llama_dir, enable_prefix_caching=False).engine
    for i, s in enumerate(SUFFIXES):
        eng.add_request(f"r{i}", PREFIX + s, GREEDY)
    first = eng.step()
    assert eng.last_iteration.num_prompt_tokens == 4 * (len(PREFIX) + 3) and eng.get_stats().num_waiting == 0
    run_to_completion(eng, first_outputs=first)

    eng = make(tiny_llama_dir).engine
    for i, s in enumerate(SUFFIXES):  # the shared part is shorter than one block: nothing to wait for
        eng.add_request(f"d{i}", s + PREFIX, GREEDY)
    first = eng.step()
    assert eng.get_stats().num_waiting == 0
    run_to_completion(eng, first_outputs=first)
    assert_all_blocks_free(eng)


def test_a_waiting_request_whose_prefix_owner_is_aborted_computes_it_itself(tiny_llama_dir, solo):
    eng = make(tiny_llama_dir, max_num_seqs=8).engine
    eng.add_request("owner", PREFIX + SUFFIXES[0], GREEDY)
    eng.add_request("waiter", PREFIX + SUFFIXES[1], GREEDY)
    first = eng.step()
    assert eng.get_stats().num_waiting == 1
    eng.abort_request("owner")  # its blocks were published after its step: the waiter hits them
    out = run_to_completion(eng, first_outputs=first)
    assert out["waiter"].outputs[0].token_ids == solo[1]
    assert_all_blocks_free(eng)

    eng = make(tiny_llama_dir, max_num_batched_tokens=16).engine  # the owner prefills in chunks of 16
    eng.add_request("owner", PREFIX + SUFFIXES[0], GREEDY)
    eng.add_request("waiter", PREFIX + SUFFIXES[1], GREEDY)
    first = eng.step()
    assert eng.get_stats().num_waiting == 1
    eng.abort_request("owner")  # mid-prefix: nothing in flight any more, the waiter computes the rest
    first += eng.step()
    assert eng.get_stats().num_waiting == 0
    out = run_to_completion(eng, first_outputs=first)
    assert out["waiter"].outputs[0].token_ids == solo[1]
    assert_all_blocks_free(eng)


def test_a_waiter_keeps_its_seat_and_short_shared_headers_do_not_wait(tiny_llama_dir):
    # max_num_seqs 2: the owner runs, the waiter holds the second seat, a later unrelated request waits
    eng = make(tiny_llama_dir, max_num_seqs=2).engine
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.add_request("owner", PREFIX + SUFFIXES[0], long)
    eng.add_request("waiter", PREFIX + SUFFIXES[1], GREEDY)
    eng.add_request("later", [9, 8, 7, 6, 5], long)
    first_token_step = {}
    for step in range(1, 200):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            if o.outputs[0].token_ids:
                first_token_step.setdefault(o.request_id, step)
    assert first_token_step["owner"] == 1 and first_token_step["waiter"] == 2  # not after the owner's 30 tokens
    assert first_token_step["later"] > 2
    assert_all_blocks_free(eng)

    # a common header shorter than INFLIGHT_MIN_TOKENS (here 7 blocks of 4 = 28 tokens) is not worth a step
    eng = make(tiny_llama_dir).engine
    header = PREFIX[:28]
    for i, s in enumerate(SUFFIXES):
        eng.add_request(f"h{i}", header + s * 5, GREEDY)
    first = eng.step()
    assert eng.get_stats().num_waiting == 0 and len(first) == 4
    run_to_completion(eng, first_outputs=first)
    assert_all_blocks_free(eng)
