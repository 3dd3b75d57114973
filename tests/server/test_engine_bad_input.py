"""Must-show 5: bad input raises a typed error with a clear message at submission, and the engine keeps
serving the other requests."""

from __future__ import annotations

import re

import pytest

from kvfleet_server import EngineConfig, SamplingParams
from kvfleet_server.errors import InvalidRequestError, PromptTooLongError, UnsupportedFeatureError

from engine_helpers import assert_all_blocks_free, run_to_completion


@pytest.fixture(scope="module")
def eng(tiny_engine_factory):
    # 32 blocks × 4 tokens = 128-token pool; max_model_len 512 so "larger than the pool" is reachable
    return tiny_engine_factory(block_size=4, kv_cache_memory_bytes=32 * 4 * 2 * 2 * 2 * 16 * 4,
                               max_model_len=100)


@pytest.mark.parametrize("kwargs, param, text", [
    (dict(max_tokens=-1), "max_tokens", "at least 0 (0: compute the prompt only"),
    (dict(temperature=-0.5), "temperature", "non-negative, got -0.5"),
    (dict(top_p=0.0), "top_p", "(0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p", "(0, 1], got 1.5"),
    (dict(logprobs=-1), "logprobs", "non-negative, got -1"),
    (dict(prompt_logprobs=-1), "prompt_logprobs", "non-negative, got -1"),
    (dict(n=0), "n", "at least 1"),
    (dict(top_k=-3), "top_k", "got -3"),
    (dict(stop=[""]), "stop", "non-empty"),
])
def test_bad_sampling_params(kwargs, param, text):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and text in str(e.value) and param in str(e.value)


def test_logprobs_above_max_logprobs_are_refused(eng, tiny_engine_factory):
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=r"\[0, 20\] \(max_logprobs\), got 21") as e:
            eng.add_request(f"lp-{name}", [5, 6], SamplingParams(max_tokens=1, **{name: 21}))
        assert e.value.param == name
    wide = tiny_engine_factory(max_logprobs=30)
    wide.add_request("lp30", [5, 6], SamplingParams(max_tokens=1, logprobs=30, temperature=0))
    out = run_to_completion(wide)
    assert len(out["lp30"].outputs[0].logprobs[0]) >= 30


def test_bad_requests_rejected_while_others_run(eng):
    good = SamplingParams(temperature=0, max_tokens=6)
    eng.add_request("ok1", [10, 11, 12], good)
    first = eng.step()
    with pytest.raises(InvalidRequestError, match="prompt must not be empty") as e:
        eng.add_request("empty", "", good)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="prompt must not be empty"):
        eng.add_request("empty2", [], good)
    with pytest.raises(PromptTooLongError, match=r"prompt \(90 tokens\) \+ max_tokens \(20\) = 110 exceeds max_model_len=100"):
        eng.add_request("long", [5] * 90, SamplingParams(max_tokens=20))
    with pytest.raises(PromptTooLongError, match="prompt has 100 tokens, max_model_len is 100"):
        eng.add_request("long2", [5] * 100, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("ok1", [1, 2], good)
    with pytest.raises(InvalidRequestError, match=r"token ids must be in \[0, 49152\)"):
        eng.add_request("oov", [1, 99999], good)
    eng.add_request("ok2", [20, 21], good)
    outs = run_to_completion(eng, first_outputs=first)
    assert set(outs) == {"ok1", "ok2"}
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs.values())
    assert_all_blocks_free(eng)


def test_prompt_larger_than_pool(tiny_engine_factory):
    eng = tiny_engine_factory(block_size=4, kv_cache_memory_bytes=8 * 4 * 2 * 2 * 2 * 16 * 4)
    assert eng.kv.num_blocks == 8 and eng.max_model_len == 32  # default capped at the pool's capacity
    with pytest.raises(PromptTooLongError, match=r"prompt has 40 tokens and needs 11 KV blocks of 4 tokens, "
                                                 r"but the KV pool holds only 8 blocks \(32 tokens\)"):
        eng.add_request("huge", list(range(1, 41)), SamplingParams(max_tokens=1))
    eng.add_request("fits", [3, 4, 5], SamplingParams(temperature=0, max_tokens=4))
    assert run_to_completion(eng)["fits"].outputs[0].finish_reason == "length"


def test_n_above_max_num_seqs_is_refused_instead_of_blocking_the_queue(tiny_engine_factory):
    # its n sequences start together: such a request could never be admitted and would hold up every
    # request behind it (a hang the fuzzing suite found: n=54 with --max-num-seqs 16)
    eng = tiny_engine_factory(max_num_seqs=4)
    with pytest.raises(InvalidRequestError, match=r"n must be at most 4 \(max_num_seqs\), got 5") as e:
        eng.add_request("wide", [3, 4, 5], SamplingParams(n=5, max_tokens=2))
    assert e.value.param == "n"
    eng.add_request("four", [3, 4, 5], SamplingParams(n=4, temperature=1.0, max_tokens=2))
    eng.add_request("next", [6, 7], SamplingParams(temperature=0, max_tokens=2))
    out = run_to_completion(eng)
    assert len(out["four"].outputs) == 4 and len(out["next"].outputs[0].token_ids) == 2
    assert_all_blocks_free(eng)


def test_max_tokens_none_fills_to_max_model_len(eng):
    eng.add_request("fill", [7] * 90, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    out = run_to_completion(eng)["fill"].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


@pytest.mark.parametrize("kwargs, text", [
    (dict(speculative_config={"method": "eagle3", "num_speculative_tokens": 3}),
     'not supported yet: --speculative-config {"method": "eagle3", "num_speculative_tokens": 3}'),
    (dict(quantization="awq"), "not supported: quantization='awq' (an already-quantized checkpoint format"),
    (dict(quantization="fp4"), "not supported: quantization='fp4'; expected one of ['fp8', 'int8', 'int4', 'gguf']"),
    (dict(model="/models/llama", quantization="gguf"), "quantization='gguf' needs a .gguf model file"),
    (dict(kv_cache_dtype="int8"), "not supported: kv_cache_dtype='int8'; expected one of ['auto', 'fp8', "),
    (dict(dtype="float16", device="cpu"), "not supported yet: --dtype float16"),
])
def test_unsupported_features_refused(kwargs, text):
    # the Python API refuses what the command line refuses (the same list, kvfleet_server.unsupported)
    with pytest.raises(UnsupportedFeatureError, match=re.escape(text)):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, text", [
    (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(dtype="int8"), "dtype"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"), (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
])
def test_bad_config_values(kwargs, text):
    with pytest.raises(ValueError, match=text):
        EngineConfig(**kwargs)


def test_max_model_len_beyond_model_or_pool(tiny_llama_dir, tiny_engine_factory):
    from kvfleet_server import LLMEngine

    with pytest.raises(ValueError, match="max_model_len=4096 exceeds the model's max_position_embeddings=1024"):
        LLMEngine(EngineConfig(model=tiny_llama_dir, max_model_len=4096, device="cpu"))
    with pytest.raises(ValueError, match="does not fit in the KV pool"):
        tiny_engine_factory(block_size=4, kv_cache_memory_bytes=8 * 4 * 2 * 2 * 2 * 16 * 4, max_model_len=64)
