"""The fused CPU layer ops (model/layers/layer_ops.py, attention/csrc/layer_ops_cpu.cpp): each op
against the torch reference (float32 within rounding, bfloat16 / float16 within two units of
the last place), bad shapes refused by name, and whole engines giving the same greedy tokens and close
log-probabilities with and without them (the real SmolLM2 against transformers runs with them by
default: test_model_real_parity.py)."""

from __future__ import annotations

import pytest
import torch

from kvfleet_server.model.layers.layer_ops import TORCH_OPS, CpuLayerOps, cpu_layer_ops

CPU = cpu_layer_ops()
pytestmark = pytest.mark.skipif(CPU is None, reason="kvfleet's CPU kernels cannot be built here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """float32: within float32 rounding of a different summation order; 16-bit: two units in the last place
    (a sum of squares reduced in another order can move a value over one rounding boundary, and the
    weight multiply rounds again)."""
    if dtype == torch.float32:
        return torch.allclose(a, b, rtol=2e-6, atol=2e-6)
    eps = torch.finfo(dtype).eps
    return bool(((a.float() - b.float()).abs() <= 2 * eps * b.float().abs() + 1e-6).all())


def rand(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 576), (7, 64), (300, 576), (3, 100)])
def test_rms_norm_and_fused_add_match_reference(dtype, T, H):
    g = torch.Generator().manual_seed(T * H)
    x, res = rand(g, T, H, dtype=dtype), rand(g, T, H, dtype=dtype, scale=3.0)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    assert close(CPU.rms_norm(x, w, 1e-5), TORCH_OPS.rms_norm(x, w, 1e-5), dtype)
    ref_normed, ref_sum = TORCH_OPS.add_rms_norm(x, res, w, 1e-6)
    res_before = res.clone()
    normed, new_sum = CPU.add_rms_norm(x.clone(), res, w, 1e-6)
    assert torch.equal(new_sum, ref_sum)  # the residual add is exact
    assert close(normed, ref_normed, dtype)
    assert torch.equal(res, res_before)  # the residual stream itself is never written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 130])
def test_rope_in_place_on_qkv_views_equals_reference(dtype, T):
    """q and k are views into the fused qkv output (row stride 960): both rotate in place exactly as
    the reference does, and v's columns are not touched."""
    g = torch.Generator().manual_seed(T)
    qkv = rand(g, T, 9 * 64 + 2 * 3 * 64, dtype=dtype)
    pos = torch.randint(0, 4096, (T,), generator=g)
    from kvfleet_server.model.rope import rope_cos_sin, rope_inv_freq

    cos, sin = rope_cos_sin(rope_inv_freq(64, 100000.0, None), 4096)
    cos, sin = cos[pos].to(dtype).unsqueeze(1), sin[pos].to(dtype).unsqueeze(1)
    q, k, v = qkv.split([576, 192, 192], dim=-1)
    ref_q, ref_k = TORCH_OPS.rope(q.view(T, 9, 64), k.view(T, 3, 64), cos, sin)
    work = qkv.clone()
    wq, wk, wv = work.split([576, 192, 192], dim=-1)
    out_q, out_k = CPU.rope(wq.view(T, 9, 64), wk.view(T, 3, 64), cos, sin)
    assert out_q.data_ptr() == wq.data_ptr() and out_k.data_ptr() == wk.data_ptr()
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(wv, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 1536), (9, 13), (64, 1536)])
def test_silu_and_mul_matches_reference(dtype, T, inter):
    g = torch.Generator().manual_seed(T + inter)
    x = rand(g, T, 2 * inter, dtype=dtype, scale=4.0)  # down to e^-16 and up to saturation
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)
    got, ref = CPU.silu_and_mul(x), TORCH_OPS.silu_and_mul(x)
    assert got.shape == (T, inter) and torch.isfinite(got).all()
    assert close(got, ref, dtype)


@pytest.mark.parametrize("call,message", [
    (lambda: CPU.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-5), "rms_norm_cpu"),
    (lambda: CPU.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5),
     "unsupported dtype"),
    (lambda: CPU.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5), "fused_add_rms_norm_cpu"),
    (lambda: CPU.rope(torch.zeros(2, 3, 8), torch.zeros(2, 1, 6), torch.zeros(2, 1, 8), torch.zeros(2, 1, 8)),
     "rotary_embedding_cpu"),
    (lambda: CPU.rope(torch.zeros(2, 3, 8), torch.zeros(2, 1, 8), torch.zeros(3, 1, 8), torch.zeros(3, 1, 8)),
     "cos and sin"),
    (lambda: CPU.silu_and_mul(torch.zeros(2, 7)), "silu_and_mul_cpu"),
])
def test_bad_shapes_and_dtypes_are_refused_by_name(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_engine_uses_fused_ops_by_default_and_the_knob_turns_them_off(tiny_engine_factory):
    on, off = tiny_engine_factory(), tiny_engine_factory(cpu_fused_ops=False)
    assert isinstance(on.model.layer_ops, CpuLayerOps) and all(l.ops is on.model.layer_ops for l in on.model.layers)
    assert off.model.layer_ops is TORCH_OPS and all(l.ops is TORCH_OPS for l in off.model.layers)
    compiled = tiny_engine_factory(compilation_config={"level": 3})  # Inductor fuses the reference ops itself
    assert compiled.model.layer_ops is TORCH_OPS


def test_cli_flag_reaches_the_engine_config():
    from kvfleet_server.flags import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--no-cpu-fused-ops"])).cpu_fused_ops is False
    assert engine_config(build_parser().parse_args([])).cpu_fused_ops is True


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_engine_same_greedy_tokens_and_close_logprobs_with_and_without(tiny_llama_dir, dtype):
    from kvfleet_server import LLM, SamplingParams

    prompts = [[3 + (i * 11 + j) % 60 for j in range(n)] for i, n in enumerate((4, 19, 33, 8))]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    runs = []
    for flag in (False, True):
        llm = LLM(model=tiny_llama_dir, dtype=dtype, device="cpu", kv_cache_memory_bytes=2 << 20,
                  cpu_fused_ops=flag, max_num_batched_tokens=24)
        runs.append(llm.generate(prompts, sp))
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        ids = a.outputs[0].token_ids
        la = torch.tensor([d[t].logprob for t, d in zip(ids, a.outputs[0].logprobs)])
        lb = torch.tensor([d[t].logprob for t, d in zip(ids, b.outputs[0].logprobs)])
        assert torch.allclose(la, lb, atol=1e-4 if dtype == "float32" else 5e-2)
