"""Must-show 4: seeded sampling reproduces alone and in a batch; stop strings split across tokens are
caught and removed (held back while partial); emoji/CJK stream as whole characters; penalties stay
with their own request. Plus unit checks of the sampling knobs."""

from __future__ import annotations

import pytest
import torch

from kvfleet_server import SamplingParams
from kvfleet_server.engine.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_len
from kvfleet_server.sample.sampler import SampleRow, sample

from engine_helpers import assert_all_blocks_free, run_to_completion

PROMPT = [431, 2200, 17, 9000, 555, 31000, 42]


@pytest.fixture(scope="module")
def eng(tiny_engine_factory):
    return tiny_engine_factory(block_size=4, max_num_batched_tokens=32)


def _gen(eng, reqs):
    for rid, prompt, p in reqs:
        eng.add_request(rid, prompt, p)
    out = run_to_completion(eng)
    assert_all_blocks_free(eng)
    return out


def test_seeded_request_reproduces_alone_and_in_batch(eng):
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone1 = _gen(eng, [("a1", PROMPT, p)])["a1"].outputs[0].token_ids
    alone2 = _gen(eng, [("a2", PROMPT, p)])["a2"].outputs[0].token_ids
    noise = [(f"n{i}", [100 + i] * (5 + 3 * i), SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True))
             for i in range(6)]
    batched = _gen(eng, noise[:3] + [("b", PROMPT, p)] + noise[3:])["b"].outputs[0].token_ids
    other_seed = _gen(eng, [("c", PROMPT, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99,
                                                         max_tokens=20, ignore_eos=True))])["c"]
    assert alone1 == alone2 == batched
    assert other_seed.outputs[0].token_ids != alone1


def test_seeded_sampling_survives_preemption(tiny_engine_factory):
    p = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, frequency_penalty=0.5)
    big = tiny_engine_factory(block_size=4)
    ref = _gen(big, [("x", PROMPT, p)])["x"].outputs[0].token_ids
    small = tiny_engine_factory(block_size=4, kv_cache_memory_bytes=16 * 4 * 2 * 2 * 2 * 16 * 4,
                                enable_prefix_caching=False)
    fillers = [(f"f{i}", [200 + i] * 20, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
               for i in range(3)]
    preempt = 0
    # x arrives last among running ones so it is the preemption victim
    for rid, prompt, pp in fillers + [("x", PROMPT, p)]:
        small.add_request(rid, prompt, pp)

    def on_step(e):
        nonlocal preempt
        preempt += e.last_iteration.num_preemptions

    outs = run_to_completion(small, on_step=on_step)
    assert preempt > 0 and outs["x"].metrics.num_preemptions > 0
    assert outs["x"].outputs[0].token_ids == ref


def test_stop_string_across_tokens(eng):
    base = _gen(eng, [("s0", PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))])["s0"]
    out = base.outputs[0]
    # pick a stop string that starts inside one token's text and ends inside a later one
    pieces = [eng.tokenizer.decode(out.token_ids[: i + 1]) for i in range(len(out.token_ids))]
    k = next(i for i in range(3, len(pieces) - 1)
             if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    cut = len(pieces[i := k]) - 1
    stop = out.text[cut - 0 : cut + 2]
    assert len(stop) == 2 and stop not in out.text[:cut]
    eng.add_request("s1", PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    streamed = ""
    while eng.has_unfinished():
        for o in eng.step():
            c = o.outputs[0]
            streamed += c.delta_text
            assert stop not in streamed
            assert not c.finished or c.finish_reason == "stop"
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == out.text[:cut] == streamed
    assert len(c.token_ids) == k + 2  # the token completing the stop string ends generation

    eng.add_request("s2", PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True))
    assert run_to_completion(eng)["s2"].outputs[0].text == out.text[: cut + 2]


def test_stop_helpers():
    assert find_stop("hello world", 4, ["wor", "lo"]) == (3, "lo")
    assert find_stop("hello world", 6, ["wor", "lo"]) == (6, "wor")
    assert find_stop("hello world", 9, ["lo"]) is None
    assert partial_stop_len("abc</", ["</s>"]) == 2
    assert partial_stop_len("abc", ["</s>"]) == 0


def test_multibyte_characters_stream_whole(eng):
    text = "Hi 👋 世界! 🎉🎉 naïve — 日本語です 🧑‍🚀"
    ids = eng.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte-level pieces split characters across tokens
    d = IncrementalDetokenizer(eng.tokenizer, [], True)
    deltas = [d.add(t) for t in ids]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == text
    assert sum(1 for x in deltas if x == "") > 0  # some tokens held back (incomplete UTF-8)


def test_penalties_do_not_leak_to_neighbours(eng):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # negative penalties reward repeating: the random tiny model never repeats on its own
    pen = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=0.2,
                         frequency_penalty=-2.0, presence_penalty=-2.0)
    alone_a = _gen(eng, [("pa", PROMPT, plain)])["pa"].outputs[0].token_ids
    alone_b = _gen(eng, [("pb", PROMPT[:5], plain)])["pb"].outputs[0].token_ids
    both = _gen(eng, [("a", PROMPT, plain), ("b", PROMPT[:5], pen)])
    assert both["a"].outputs[0].token_ids == alone_a
    penalized = both["b"].outputs[0].token_ids
    assert len(set(alone_b)) == len(alone_b)
    assert penalized != alone_b
    assert len(set(penalized)) < len(penalized)


def _row(**kw):
    return SampleRow(SamplingParams(**kw), [1, 2], [3], torch.Generator().manual_seed(0), [])


def test_sampler_knobs():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = logits.argmax(-1).tolist()
    toks, _ = sample(logits.clone(), [_row(temperature=1.0, top_k=1), _row(temperature=2.0, top_p=1e-6),
                                      _row(temperature=1.0, min_p=1.0), _row(temperature=0.0)])
    assert toks == greedy
    toks, lps = sample(logits.clone(), [_row(temperature=0.0, logprobs=3)] * 4)
    lp = lps[0]
    assert lp.rank == 1 and len(lp.top_ids) == 3 and lp.top_ids[0] == greedy[0]
    assert abs(lp.logprob - torch.log_softmax(logits[0], -1).max().item()) < 1e-6
    # min_tokens masks the stop ids
    row = SampleRow(SamplingParams(temperature=0.0, min_tokens=5), [], [], None, [greedy[0]])
    toks, _ = sample(logits[:1].clone(), [row])
    assert toks[0] != greedy[0]
    # repetition penalty on the greedy token's id changes the choice when strong enough
    row = SampleRow(SamplingParams(temperature=0.0, repetition_penalty=1e6), [greedy[1]], [], None, [])
    toks, _ = sample(logits[1:2].clone(), [row])
    assert toks[0] != greedy[1]
