"""Offline LLM API and step-level engine behaviour: ordering, token-id prompts, chat templates, n > 1,
logprobs / prompt_logprobs, stop_token_ids + min_tokens, abort output, stats."""

from __future__ import annotations

import math

import pytest

from kvfleet_server import LLM, SamplingParams
from kvfleet_server.errors import InvalidRequestError

from engine_helpers import assert_all_blocks_free, run_to_completion

PROMPT = [431, 2200, 17, 9000, 555, 31000, 42]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", device="cpu", block_size=4, kv_cache_memory_bytes=4 << 20,
               max_num_batched_tokens=32)


def test_generate_keeps_input_order_and_accepts_text_or_ids(llm):
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["hello there", PROMPT, "a much longer prompt " * 5], greedy)
    assert [o.prompt for o in outs] == ["hello there", None, "a much longer prompt " * 5]
    assert outs[1].prompt_token_ids == PROMPT
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("hello there")
    single = llm.generate(PROMPT, greedy)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and len(c.token_ids) == 5
        assert c.text == llm.tokenizer.decode(c.token_ids)
    assert_all_blocks_free(llm.engine)


def test_chat_template_and_its_errors(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3))
    assert out[0].prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(InvalidRequestError, match="System role not supported") as e:
        llm.chat([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    assert e.value.param == "messages"


def test_n_samples_and_logprobs(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, logprobs=4, prompt_logprobs=2, ignore_eos=True)
    (out,) = llm.generate([PROMPT], p)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.token_ids) == 6 and len(c.logprobs) == 6
        for tok, pos in zip(c.token_ids, c.logprobs):
            assert tok in pos and len(pos) <= 5
            assert all(lp.logprob <= 0 for lp in pos.values())
            top = [lp for t, lp in pos.items() if t != tok or lp.rank <= 4]
            assert sorted(lp.rank for lp in top if lp.rank <= 4)[:4] == [1, 2, 3, 4]
    pl = out.prompt_logprobs
    assert len(pl) == len(PROMPT) and pl[0] is None
    for tok, pos in zip(PROMPT[1:], pl[1:]):
        assert tok in pos and pos[tok].rank >= 1 and len(pos) <= 3
    # total probability of the top entries of a position is at most 1
    assert sum(math.exp(lp.logprob) for t, lp in pl[1].items() if lp.rank <= 2) <= 1.0 + 1e-5


def test_prompt_logprobs_match_chunked_and_unchunked(tiny_engine_factory):
    vals = []
    for mbt in (4, 64):
        eng = tiny_engine_factory(block_size=4, max_num_batched_tokens=mbt)
        eng.add_request("p", PROMPT * 3, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        out = run_to_completion(eng)["p"]
        vals.append([None if d is None else round(d[t].logprob, 4) for d, t in zip(out.prompt_logprobs, PROMPT * 3)])
    assert vals[0] == vals[1] and len(vals[0]) == 21


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    t = base.token_ids[2]
    first = base.token_ids.index(t)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[t]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == t
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.text == llm.tokenizer.decode(base.token_ids[:first])  # the stop token's text is left out
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[t],
                                                min_tokens=first + 3))[0].outputs[0]
    assert t not in out.token_ids[: first + 3]


def test_step_level_engine_abort_stats_and_deltas(llm):
    eng = llm.engine
    eng.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.add_request("b", PROMPT * 2, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    outs = eng.step()
    st = eng.get_stats()
    assert st.num_running == 2 and st.num_waiting == 0 and 0 < st.kv_cache_usage <= 1
    it = eng.last_iteration  # PROMPT was seen by earlier tests: its full blocks come from the prefix cache
    assert it.prefix_cache_queries == 21 and it.prefix_cache_hits > 0
    assert it.num_prompt_tokens + it.prefix_cache_hits == 21 and it.num_generation_tokens == 2
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(len(o.outputs[0].delta_token_ids) == 1 for o in outs)
    eng.step()
    eng.abort_request("a")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    assert len(outs["a"].outputs[0].token_ids) == 2 and outs["a"].outputs[0].delta_token_ids == []
    assert not outs["b"].finished
    eng.abort_request("b")
    eng.step()
    assert not eng.has_unfinished() and eng.get_stats().num_running == 0
    assert_all_blocks_free(eng)
