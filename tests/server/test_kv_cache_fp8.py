"""FP8 KV cache (--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2) on the tiny random-weight Llama: pool
geometry, per-layer scales (checkpoint or first-prefill calibration), and that prefix caching,
copy-on-write and preemption behave exactly as with the model-dtype cache."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from kvfleet_server import SamplingParams
from kvfleet_server.attention.kv_quant import HEADROOM, hadamard, rotate

from engine_helpers import assert_all_blocks_free, run_to_completion

BYTES = 1 << 20


@pytest.mark.parametrize("dtype, ratio", [("float32", 4), ("bfloat16", 2)])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_blocks_grow_by_the_byte_ratio(tiny_engine_factory, caplog, dtype, ratio, kv):
    base = tiny_engine_factory(dtype=dtype, kv_cache_memory_bytes=BYTES)
    with caplog.at_level(logging.INFO, logger="kvfleet.engine"):
        eng = tiny_engine_factory(dtype=dtype, kv_cache_memory_bytes=BYTES, kv_cache_dtype=kv)
    assert eng.num_blocks == ratio * base.num_blocks
    want = torch.float8_e5m2 if kv == "fp8_e5m2" else torch.float8_e4m3fn
    assert eng.runner.kv_caches[0][0].dtype == want and eng.runner.kv_caches[0][2].shape == (2,)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache: ")][-1]
    assert f"{eng.num_blocks} blocks" in line and str(want) in line


def test_scales_are_calibrated_once_from_the_first_prefill(tiny_engine_factory, caplog):
    with caplog.at_level(logging.INFO, logger="kvfleet.engine"):
        eng = tiny_engine_factory(kv_cache_dtype="fp8")
    layers = len(eng.runner.kv_caches)
    assert any(f"k/v scales of {layers} layers calibrated from the first prefill" in r.getMessage()
               for r in caplog.records)
    assert all(float(s.abs().sum()) == 0 for _, _, s in eng.runner.kv_caches)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvfleet.engine"):
        eng.add_request("a", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=4))
        run_to_completion(eng)
    first = [s.clone() for _, _, s in eng.runner.kv_caches]
    assert all(bool((s > 0).all()) for s in first)
    # each layer calibrated once, in the first pass
    assert sum("a layer's k_scale" in r.getMessage() for r in caplog.records) == layers
    # scale = absmax * HEADROOM / 448: every value written so far fits within 1/HEADROOM of the range
    k_cache, v_cache, s = eng.runner.kv_caches[0]
    assert k_cache.view(torch.uint8).any()
    assert float(k_cache.float().abs().max()) <= 448 / HEADROOM * 1.07
    eng.add_request("b", list(range(2000, 2100)), SamplingParams(temperature=0, max_tokens=4))
    run_to_completion(eng)
    assert all(torch.equal(a, b) for a, (_, _, b) in zip(first, eng.runner.kv_caches)), "scales must stay fixed"


def _greedy(eng, prompts, max_tokens=12, on_step=None):
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    outs = run_to_completion(eng, on_step=on_step)
    assert_all_blocks_free(eng)
    return [outs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


PREFIX = list(range(300, 333))
PROMPTS = [PREFIX + [7, 8, 9], PREFIX + [10, 11], PREFIX + [12], list(range(900, 950))]


def _calibrated(tiny_engine_factory, **kw):
    eng = tiny_engine_factory(kv_cache_dtype="fp8", block_size=4, **kw)
    _greedy(eng, [list(range(100, 140))], 1)  # the same first prefill → the same scales in every engine
    return eng


def test_prefix_caching_and_preemption_unchanged_under_fp8(tiny_engine_factory):
    ref = _greedy(_calibrated(tiny_engine_factory, enable_prefix_caching=False), PROMPTS)
    cached = _calibrated(tiny_engine_factory, enable_prefix_caching=True)
    assert _greedy(cached, PROMPTS) == ref
    hits = []
    assert _greedy(cached, PROMPTS, on_step=lambda e: hits.append(e.last_iteration.prefix_cache_hits)) == ref
    assert sum(hits) >= 3 * 32, "second pass: the prompts' full blocks come from the cache"
    # a pool of 24 blocks of 4 tokens: the four requests cannot all run, some are preempted and recomputed
    small = _calibrated(tiny_engine_factory, enable_prefix_caching=False, kv_cache_memory_bytes=24 * 4 * 2 * 2 * 2 * 16)
    assert small.num_blocks == 24
    preempted = []
    for i, p in enumerate(PROMPTS):
        small.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    outs = run_to_completion(small, on_step=lambda e: preempted.append(e.last_iteration.num_preemptions))
    assert sum(preempted) > 0
    long_ref = _greedy(_calibrated(tiny_engine_factory, enable_prefix_caching=False), PROMPTS, 40)
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(4)] == long_ref
    assert_all_blocks_free(small)


def test_copy_on_write_for_n_samples_under_fp8(tiny_engine_factory):
    eng = _calibrated(tiny_engine_factory)
    eng.add_request("n", PREFIX + [5, 6], SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True))
    a = [c.token_ids for c in run_to_completion(eng)["n"].outputs]
    eng2 = _calibrated(tiny_engine_factory)
    eng2.add_request("n", PREFIX + [5, 6], SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True))
    assert [c.token_ids for c in run_to_completion(eng2)["n"].outputs] == a
    assert_all_blocks_free(eng2)


def test_greedy_close_to_model_dtype_cache(tiny_engine_factory):
    ref = _greedy(tiny_engine_factory(block_size=4), PROMPTS, 8)
    got = _greedy(_calibrated(tiny_engine_factory), PROMPTS, 8)
    # random weights give near-flat logits; the first tokens still agree
    assert sum(a[0] == b[0] for a, b in zip(got, ref)) >= 3


def _prompt_logprobs(eng, prompt):
    eng.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    out = run_to_completion(eng)["p"]
    return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])


def test_hadamard_rotation_changes_nothing_on_a_float_cache(tiny_engine_factory):
    """q, k, v and the attention output rotated by H (its own inverse): the same log-probs as unrotated,
    through prefill and decode (a missing or wrong back-rotation changes them by far more)."""
    r = hadamard(16, torch.float64)
    assert torch.allclose(r @ r, torch.eye(16, dtype=torch.float64)) and torch.equal(r, r.T)
    assert hadamard(48, torch.float32) is None
    # bfloat16 activations are rotated in float32: no systematic scale where ±1/√n is inexact (n = 128)
    x = torch.randn(4096, 128).to(torch.bfloat16)
    h128 = hadamard(128, torch.float32)
    back = rotate(rotate(x, h128), h128)
    assert back.dtype == torch.bfloat16 and abs(float((back.float() * x.float()).sum() / x.float().pow(2).sum()) - 1) < 2e-5
    plain = tiny_engine_factory()
    assert all(layer.kv_rotation is None for layer in plain.model.layers), "no rotation without an fp8 cache"
    ref_lp, ref_tok = _prompt_logprobs(plain, PROMPTS[3]), _greedy(plain, PROMPTS, 8)
    rotated = tiny_engine_factory()
    hd = rotated.model.config.head_dim
    rotated.model.set_kv_rotation(hadamard(hd, torch.float32), range(rotated.model.config.num_hidden_layers))
    assert torch.allclose(_prompt_logprobs(rotated, PROMPTS[3]), ref_lp, atol=1e-4)
    assert _greedy(rotated, PROMPTS, 8) == ref_tok
    rotated.model.layers[0].kv_rotation = hadamard(hd, torch.float32)[torch.randperm(hd)]  # not symmetric
    assert not torch.allclose(_prompt_logprobs(rotated, PROMPTS[3]), ref_lp, atol=1e-2)


def test_fp8_cache_rotates_layers_with_engine_scales(tiny_engine_factory, caplog):
    with caplog.at_level(logging.INFO, logger="kvfleet.engine"):
        eng = tiny_engine_factory(kv_cache_dtype="fp8")
    hd = eng.model.config.head_dim
    assert all(torch.equal(layer.kv_rotation, hadamard(hd, torch.float32)) for layer in eng.model.layers)
    bf16 = tiny_engine_factory(kv_cache_dtype="fp8", dtype="bfloat16")
    assert bf16.model.layers[0].kv_rotation.dtype == torch.float32  # see kv_quant.rotate
    _greedy(bf16, PROMPTS[:2], 3)
    assert any(f"rotated by a {hd}x{hd} Hadamard matrix" in r.getMessage() for r in caplog.records)


def test_scales_from_the_checkpoint(tiny_llama_dir, tmp_path, caplog):
    from safetensors.torch import save_file

    from kvfleet_server import EngineConfig, LLMEngine

    d = tmp_path / "with_scales"
    shutil.copytree(tiny_llama_dir, d)
    assert not os.path.exists(d / "model.safetensors.index.json")
    save_file({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(0.01 * (i + 1) * (2 if n == "v" else 1))
               for i in range(2) for n in ("k", "v")}, str(d / "kv_scales.safetensors"))
    with caplog.at_level(logging.INFO, logger="kvfleet.engine"):
        eng = LLMEngine(EngineConfig(model=str(d), dtype="float32", device="cpu", kv_cache_memory_bytes=BYTES,
                                     kv_cache_dtype="fp8"))
    assert torch.allclose(eng.runner.kv_caches[1][2], torch.tensor([0.02, 0.04]))
    assert any("scales of 2 layers from the checkpoint" in r.getMessage() for r in caplog.records)
    # those scales were calibrated on the plain K/V: no rotation
    assert all(layer.kv_rotation is None for layer in eng.model.layers)
    _greedy(eng, PROMPTS[:1], 2)
    assert torch.allclose(eng.runner.kv_caches[1][2], torch.tensor([0.02, 0.04])), "checkpoint scales are kept"


def test_scales_for_some_layers_rotate_only_the_others(tiny_llama_dir, tmp_path):
    """Layer 1's scales come from the checkpoint (plain K/V), layer 0 calibrates and rotates; layer 1 gets
    the identity, so both layers run the same code (one compiled graph)."""
    from safetensors.torch import save_file

    from kvfleet_server import EngineConfig, LLMEngine

    d = tmp_path / "layer1_scales"
    shutil.copytree(tiny_llama_dir, d)
    save_file({f"model.layers.1.self_attn.{n}_scale": torch.tensor(0.05) for n in ("k", "v")},
              str(d / "kv_scales.safetensors"))
    eng = LLMEngine(EngineConfig(model=str(d), dtype="float32", device="cpu", kv_cache_memory_bytes=BYTES,
                                 kv_cache_dtype="fp8"))
    hd = eng.model.config.head_dim
    l0, l1 = (layer.kv_rotation for layer in eng.model.layers)
    assert torch.equal(l0, hadamard(hd, torch.float32)) and torch.equal(l1, torch.eye(hd))
    _greedy(eng, PROMPTS[:2], 3)
    assert torch.allclose(eng.runner.kv_caches[1][2], torch.tensor([0.05, 0.05]))


def test_already_quantized_checkpoint_is_refused_by_name(tiny_llama_dir, tmp_path):
    from kvfleet_server import EngineConfig, LLMEngine
    from kvfleet_server.errors import UnsupportedFeatureError

    d = tmp_path / "awq"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedFeatureError, match="already quantized: quantization_config.quant_method='awq' is not supported"):
        LLMEngine(EngineConfig(model=str(d), dtype="float32", device="cpu", kv_cache_memory_bytes=BYTES))


def test_max_tokens_zero_scores_the_prompt(tiny_engine_factory):
    eng = tiny_engine_factory(block_size=4, max_num_batched_tokens=16)  # chunked prefill of a 40-token prompt
    prompt = list(range(500, 540))
    eng.add_request("s", prompt, SamplingParams(max_tokens=0, prompt_logprobs=2, n=2))
    out = run_to_completion(eng)["s"]
    assert [c.token_ids for c in out.outputs] == [[], []]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert all(prompt[i] in out.prompt_logprobs[i] for i in range(1, len(prompt)))
    assert_all_blocks_free(eng)
    # the same logprobs as a request that also generates
    eng.add_request("g", prompt, SamplingParams(max_tokens=3, prompt_logprobs=2, temperature=0))
    g = run_to_completion(eng)["g"]
    assert [e[t].logprob for e, t in zip(g.prompt_logprobs[1:], prompt[1:])] == \
           [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])]
